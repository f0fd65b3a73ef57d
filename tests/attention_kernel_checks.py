"""The fused decode-attention kernel (`legato/layers/fused_attention.py`) against its PyTorch contract.

`run_checks(device, dtype)` serves the GPU test (CUDA, bf16) and a CPU test that runs this file in a subprocess
under Triton's interpreter (`TRITON_INTERPRET=1`, fp32). Both cache layouts, grouped heads with a group that
is not a power of two, a new token at the start, middle and end of a block, rows in blocks of any order, an
`out` that is a strided view; outputs are poisoned first and the caches are compared whole (the new keys and
values land where they should and nothing else moves). `python tests/attention_kernel_checks.py [cuda|cpu]`.
"""

from __future__ import annotations

import os
import sys

import torch
from triton_interpreter import rel_err as _err
from triton_interpreter import report

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import patch_for_numpy

    patch_for_numpy()

from legato.layers.fused_attention import fused_decode_attention, fused_decode_attention_reference
from legato.layers.rotary import RotaryEmbedding


def _inputs(b, heads, kv_heads, d, positions, gen, device, dtype):
    qkv = (torch.randn(b, (heads + 2 * kv_heads) * d, generator=gen) * 2).to(device, dtype)
    qw = (1 + 0.3 * torch.randn(d, generator=gen)).to(device, dtype)
    kw = (1 + 0.3 * torch.randn(d, generator=gen)).to(device, dtype)
    cos, sin = RotaryEmbedding(d, 10000.0)(torch.as_tensor(positions))
    return qkv, qw, kw, cos.to(device), sin.to(device)


def _compare(name, args, kwargs, caches, errors, out_view=False):
    """Kernel and contract on copies of the same caches; with `out_view` the kernel writes into a strided view
    of a NaN-filled buffer."""
    qkv, heads, d = args[0], args[-1], caches[0].shape[-1]
    k1, v1 = (c.clone() for c in caches)
    k2, v2 = (c.clone() for c in caches)
    out = None
    if out_view:
        buf = torch.full((qkv.shape[0], 2, heads * d), float("nan"), dtype=qkv.dtype, device=qkv.device)
        out = buf[:, 1]
    got = fused_decode_attention(*args[:6], k1, v1, heads, out=out, **kwargs)
    want = fused_decode_attention_reference(*args[:6], k2, v2, heads, **kwargs)
    errors[f"{name}: out"] = _err(got if out is None else out, want)
    errors[f"{name}: k cache"] = _err(k1, k2)
    errors[f"{name}: v cache"] = _err(v1, v2)


def _long_rows(heads, kv_heads, d, gen, device, dtype, eps, errors, splits=None, block_n=None, dot=True,
               one_split_rows=None) -> None:
    """Paged rows long enough to split (`fused_attention.SPLITS`): a row's cached positions at, just under and
    just over a split's span and a loop block, one row on every split, one new token at position 0; block
    size 16, every row's blocks scattered over the cache. one_split_rows: `ONE_SPLIT_ROWS` for the launch (1: its
    8 rows go unsplit by the row-count rule)."""
    from legato.layers import fused_attention as fa

    lens = [1, fa.MIN_SPAN, fa.MIN_SPAN + 1, fa.MIN_SPAN + 2, fa.BLOCK_N * 3 + 1, 700,
            fa.SPLITS * fa.MIN_SPAN * 2 + 1, 1000]
    b, bs = len(lens), 16
    per_row = [-(-n // bs) for n in lens]
    order = torch.randperm(sum(per_row), generator=gen).to(torch.int32)
    tables = torch.zeros(b, max(per_row), dtype=torch.int32)
    at = 0
    for r, n in enumerate(per_row):
        tables[r, :n] = order[at:at + n]
        at += n
    qkv, qw, kw, cos, sin = _inputs(b, heads, kv_heads, d, [n - 1 for n in lens], gen, device, dtype)
    caches = [torch.randn(sum(per_row), bs, kv_heads, d, generator=gen).to(device, dtype) for _ in range(2)]
    kwargs = dict(block_tables=tables.to(device), context_lens=torch.tensor(lens, dtype=torch.int32, device=device))
    saved = fa.SPLITS, fa.BLOCK_N, fa.DOT, fa.ONE_SPLIT_ROWS
    fa.SPLITS, fa.BLOCK_N, fa.DOT = splits or fa.SPLITS, block_n or fa.BLOCK_N, dot
    fa.ONE_SPLIT_ROWS = one_split_rows or fa.ONE_SPLIT_ROWS
    try:
        _compare(f"paged long h{heads}/{kv_heads} d{d} splits {fa.splits(b)} block {fa.BLOCK_N}"
                 f"{'' if dot else ' reductions'}", (qkv, qw, kw, eps, cos, sin, heads), kwargs, caches, errors,
                 out_view=True)
    finally:
        fa.SPLITS, fa.BLOCK_N, fa.DOT, fa.ONE_SPLIT_ROWS = saved


def run_checks(device: str, dtype: torch.dtype) -> dict[str, float]:
    from legato.layers import fused_attention as fa

    fa.DOT_FP32 = device == "cpu"  # the interpreter runs fp32 only: check the tensor-core path's math there too
    gen = torch.Generator().manual_seed(0)
    errors: dict[str, float] = {}
    eps = 1e-6
    for heads, kv_heads, d in ((4, 2, 16), (6, 2, 32), (16, 8, 128)):
        # Paged: block size 4, three blocks per row, each row's own blocks (as the block manager guarantees)
        # in shuffled order; new tokens at a block's start (len 1, 5, 9), end (4, 12) and middle.
        lens = [1, 4, 5, 9, 12, 7]
        b, bs = len(lens), 4
        qkv, qw, kw, cos, sin = _inputs(b, heads, kv_heads, d, [n - 1 for n in lens], gen, device, dtype)
        tables = torch.arange(b * 3, dtype=torch.int32).view(b, 3)[:, torch.randperm(3, generator=gen)].flip(0)
        caches = [torch.randn(b * 3, bs, kv_heads, d, generator=gen).to(device, dtype) for _ in range(2)]
        kwargs = dict(block_tables=tables.contiguous().to(device),
                      context_lens=torch.tensor(lens, dtype=torch.int32, device=device))
        _compare(f"paged h{heads}/{kv_heads} d{d}", (qkv, qw, kw, eps, cos, sin, heads), kwargs, caches, errors)
        for splits, block_n in ((None, None), (4, 16), (1, 16)):  # the default, and the settings benchmarks try
            _long_rows(heads, kv_heads, d, gen, device, dtype, eps, errors, splits, block_n)
        _long_rows(heads, kv_heads, d, gen, device, dtype, eps, errors, one_split_rows=1)  # many rows: unsplit
        _long_rows(heads, kv_heads, d, gen, device, dtype, eps, errors, dot=False)  # CUDA-core reductions
        # Contiguous: every row at one position, capacity 16; `out` a strided view of a [B, 2, H*D] buffer.
        for position in (0, 1, 7, 15):
            qkv, qw, kw, cos, sin = _inputs(3, heads, kv_heads, d, [position] * 3, gen, device, dtype)
            caches = [torch.randn(3, kv_heads, 16, d, generator=gen).to(device, dtype) for _ in range(2)]

            _compare(f"contiguous h{heads}/{kv_heads} d{d} pos{position}", (qkv, qw, kw, eps, cos, sin, heads),
                     {"position": position}, caches, errors, out_view=True)
    return errors


def model_checks(device: str, dtype: torch.dtype) -> dict[str, float]:
    """The tiny talker with the kernel on and off: its code predictor's greedy codes are equal and its logits
    close; one paged talker decode step gives close hidden states and caches."""
    import copy

    from legato.engine.kv_cache import DecodeMeta, PagedKVCache
    from legato.layers import fused_attention
    from legato.models.qwen3_tts.decoder_layer import pack_projections
    from legato.models.qwen3_tts.talker import Talker
    from legato.models.qwen3_tts.testing import randomize_
    from legato.models.qwen3_tts.tiny import tiny_config

    cfg = tiny_config("base").talker_config
    talker = Talker(cfg)
    randomize_(talker, seed=1, std=0.1)
    talker.to(device=device, dtype=dtype).eval()
    pack_projections(talker)
    gen = torch.Generator().manual_seed(2)
    b, h = 5, cfg.hidden_size
    past, first = (torch.randn(b, h, generator=gen).to(device, dtype) for _ in range(2))
    embeds = torch.randn(b, 1, h, generator=gen).to(device, dtype)
    lens = torch.tensor([1, 2, 5, 8, 12], dtype=torch.int32)
    bs, per_row = 4, 3
    tables = torch.arange(b * per_row, dtype=torch.int32).view(b, per_row).flip(1).contiguous()
    pos = (lens - 1).long()
    slot_mapping = tables[torch.arange(b), pos // bs].long() * bs + pos % bs
    kv = PagedKVCache(cfg.num_hidden_layers, b * per_row, bs, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    meta = DecodeMeta(slot_mapping.to(device), tables.to(device), lens.to(device))
    # The kernel's run samples greedily; the unfused run is fed the same codes (teacher forcing), so each pass
    # of both sees the same input and their logits compare pass by pass: in bf16 one flipped argmax would
    # otherwise send every later pass elsewhere.
    runs = {}
    available = fused_attention.available
    for fused in (True, False):
        fused_attention.available = (lambda x: True) if fused else (lambda x: False)
        forced = runs[True][0] if not fused else None
        try:
            logits: list[torch.Tensor] = []

            def sample(scores, g, logits=logits, forced=forced):
                logits.append(scores)
                return scores.argmax(-1) if forced is None else forced[:, g - 1]

            with torch.inference_mode():
                codes = talker.code_predictor.predict_residuals(past, first, sample)
                cache = copy.copy(kv)
                cache.k, cache.v, cache.meta = kv.k.clone(), kv.v.clone(), meta
                hidden = talker(embeds, pos.to(device)[:, None], cache)
            runs[fused] = codes, torch.stack(logits), hidden, cache.k, cache.v
        finally:
            fused_attention.available = available
    (c1, l1, h1, k1, v1), (_, l2, h2, k2, v2) = runs[True], runs[False]
    # In fp32 the greedy codes must agree exactly: the unfused run's own argmax is the kernel run's code.
    exact = ({"model: code predictor codes differ": float(not torch.equal(l2.argmax(-1).T, c1))}
             if dtype == torch.float32 else {})
    return {**exact, "model: code predictor logits": _err(l1, l2), "model: talker hidden": _err(h1, h2),
            "model: talker k cache": _err(k1, k2), "model: talker v cache": _err(v1, v2)}


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    errors = {**run_checks(device, dtype), **model_checks(device, dtype)}
    return report({name: (err, tol) for name, err in errors.items()})


if __name__ == "__main__":
    sys.exit(main())
