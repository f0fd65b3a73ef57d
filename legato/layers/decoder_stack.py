"""A stack of Qwen3 decoder layers for a few rows as one persistent kernel: the code predictor's pass per codebook.

A frame runs the code predictor over 16 tokens (two prompt tokens, then one per codebook), each pass 5 layers. Unfused
that is ~45 kernels a pass: ~750 a frame at batch 1, each a few microseconds of launch and ramp around 4-12 MB of
weight reads (docs/benchmarks.md, "The frame step"). Here one launch runs a whole pass: 15 a frame, the two prompt
tokens sharing one (the weights read once for both), and a codebook's embedding lookup done by the launch's first
load where no projection sits between the embedding and the layers. Its programs (one per SM)
split every matmul's output columns, and a grid-wide barrier (an atomic counter in global memory) separates the
phases that need each other's results:

1. RMSNorm (every program computes it over the whole row) and the packed q/k/v projection;
2. the attention and the o projection split by kv head: each program takes a (kv head, rows of o) item, computes
   that head's group of query heads over at most 16 cached positions (the programs sharing a kv head compute the
   same, and one writes the new key and value into the cache), and multiplies the group's output by its rows of
   o's columns for that group: an fp32 partial of o per kv head. (A first version had every program compute all
   heads before its o columns: 26 us a phase at one row on the H200, +20 us per further row; then the o
   projection was a phase of its own, `run(split_o=False)`: 26 phases a pass instead of 21.)
3. the partials summed in kv-head order and the residual added (every program, into its own copy of the row),
   then RMSNorm and the packed gate/up projection with SiLU;
4. the down projection and the residual add;
then, after the last layer, the final norm and the codebook's head, whose logits the sampler reads. The barrier's
wait and the helpers the phases share are in `stack_parts`.

A barrier is an arrive (a release increment) and a wait (acquire polls). Weights are never written in a launch, so
each phase's weight tile is requested between the two: it streams in while the slowest program finishes the phase
before. (Requested before the arrive, as a first version did, the release waited for those loads to land, and the
pass ran slower: 134 against 123 us on the H200.) Bulk L2 prefetches of each weight phase's rows two phases ahead
(`cp.async.bulk.prefetch.L2`, one thread a program) made the pass slower, 139.7 against 128.7 us (H100,
2026-12-06), and were dropped. Each matmul phase reads its activation row spread over the weight tile's layout
(`_spread`): 123.4 against 128.3 us a pass. Under Nsight Compute 58% of a pass's warp-stall samples wait at the CTA
barrier behind the grid barrier's poll, and DRAM runs at 40% of its peak: a pass is the chain of its phases'
slowest programs and barriers, so fewer phases (or less skew within one) is what would move it
(docs/benchmarks.md, session of 2026-12-06 (5)); hence o inside the attention's phase: 119.95 against 123.87 us a
pass (H100, session of 2026-12-06 (6)).

Rounding follows the eager path (`decoder_layer.run_layers`): every activation is rounded to the activation dtype
where the unfused path stores one, and the sums run in fp32, so the only difference is the order of the sums.
Under Triton's interpreter programs run one after another, so a barrier could never be passed: there (and when
asked) each phase is its own launch (`sync=False`), the same code without the barrier.

The barrier needs every program resident at once: one launch per stream at a time, and no more programs than
SMs. The engine takes this path only when asked (`EngineConfig.code_predictor_stack`) and with one code-predictor
replica group (`predict_residuals(stack=...)`); a step whose barrier gave up fails its requests (`gave_up`). A wait
that runs past `SPIN_LIMIT` polls gives up and sets an error word instead of hanging the GPU (`barrier_errors`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from legato.layers import pdl

try:  # Triton ships with CUDA builds of torch; the CPU build has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# Rows a launch takes (a loop over rows reuses each program's weight tile); more decode rows take the unfused path,
# whose matmuls use tensor cores. On the H200 one row ran 1.10x faster than the unfused layers (0.6B frame: 3.56
# against 3.93 ms) and two rows 0.84x (docs/benchmarks.md). The engine uses the kernel only when asked
# (`EngineConfig.code_predictor_stack`).
MAX_ROWS = 1
# 16 warps a program. Alone, 8 ran a one-row pass in 123.7 us against 127.3 (4 warps 154.9; fewer programs than SMs
# slower still: 161.9 at 66), but the engine's frame was slower with 8: 3.717 against 3.668 ms, each against the
# same base at 3.85-3.87 (H100, 2026-12-06, stack_phases.py --knobs and offline.py --stack).
WARPS = 16
# Polls of a barrier before it gives up: seconds of waiting, never reached when all is well (a probe may set fewer
# through LEGATO_STACK_SPIN).
SPIN_LIMIT = int(os.environ.get("LEGATO_STACK_SPIN", 1 << 22))
# Norm + q/k/v, attention with o's partial per kv head, norm + gate/up, down; 5 with `run(split_o=False)`, where the o
# projection is a phase of its own.
PHASES_PER_LAYER = 4
# A weight chunk's width in the spread form (`_spread`): a warp's 32 threads of 8 (16-byte) values, so no warp
# shares a weight row with another and a row's sum needs no shared memory.
SPREAD_WIDTH = 256


@dataclass
class StackWeights:
    """The layers' weights stacked per kind ([layers, ...], contiguous), as the kernel indexes them."""

    qkv: torch.Tensor  # [L, (H + 2 Hkv) D, hidden]
    o: torch.Tensor  # [L, hidden, H D]
    gate_up: torch.Tensor  # [L, 2 I, hidden]
    down: torch.Tensor  # [L, hidden, I]
    ln1: torch.Tensor  # [L, hidden]
    ln2: torch.Tensor
    q_norm: torch.Tensor  # [L, D]
    k_norm: torch.Tensor
    final_norm: torch.Tensor  # [hidden]
    eps: float
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def layers(self) -> int:
        return self.qkv.shape[0]

    @property
    def hidden(self) -> int:
        return self.qkv.shape[2]

    @property
    def inter(self) -> int:
        return self.down.shape[2]


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Shapes the kernel takes: the attention's head counts and width are powers of two (its register tiles)."""
    return _pow2(heads) and _pow2(kv_heads) and _pow2(head_dim) and heads % kv_heads == 0


def stack(layers, final_norm) -> StackWeights:
    """Stacked copies of a `build_layers` ModuleList's weights. The packed q/k/v and gate/up serving copies of each
    layer (`pack_projections`) become views of the stack, so only o and down are held twice."""
    att = [layer.self_attn for layer in layers]
    mlp = [layer.mlp for layer in layers]
    for a, m in zip(att, mlp, strict=True):
        a.pack()
        m.pack()
    qkv = torch.stack([a.qkv_weight for a in att]).contiguous()
    gate_up = torch.stack([m.gate_up_weight for m in mlp]).contiguous()
    for i, (a, m) in enumerate(zip(att, mlp, strict=True)):
        a.qkv_weight, m.gate_up_weight = qkv[i], gate_up[i]
    first = att[0]
    weights = StackWeights(
        qkv=qkv, o=torch.stack([a.o_proj.weight.detach() for a in att]).contiguous(), gate_up=gate_up,
        down=torch.stack([m.down_proj.weight.detach() for m in mlp]).contiguous(),
        ln1=torch.stack([layer.input_layernorm.weight.detach() for layer in layers]),
        ln2=torch.stack([layer.post_attention_layernorm.weight.detach() for layer in layers]),
        q_norm=torch.stack([a.q_norm.weight.detach() for a in att]),
        k_norm=torch.stack([a.k_norm.weight.detach() for a in att]),
        final_norm=final_norm.weight.detach(), eps=final_norm.eps, heads=first.heads, kv_heads=first.kv_heads,
        head_dim=first.head_dim)
    if max(w.numel() for w in (weights.qkv, weights.o, weights.gate_up, weights.down)) >= 2**31:
        raise ValueError("decoder_stack indexes each stacked weight with 32-bit offsets")
    if qkv.is_cuda:
        reserve_barriers(qkv.device)
    return weights


def takes(x: torch.Tensor) -> bool:
    """Whether rows x [B, hidden] go through the kernel (CUDA, few rows)."""
    return triton is not None and x.is_cuda and x.shape[0] <= MAX_ROWS


# Barriers: [count, exited, error, spare] per stream, since a launch's programs count on theirs alone; each is back
# at zero after every launch (the last program out resets it). They are rows of one zeroed pool per device, made
# before any capture (`reserve_barriers`): a barrier first made inside a CUDA graph capture came from the graph's
# pool with its zeroing captured, not run, so until a replay it held whatever that memory held before, and the
# give-up count (`gave_up`), which reads every barrier, read that as give-ups (the async GPU test failed on the
# H200 on 2026-12-04 with every request of its second stack engine failed at its first step).
POOL_ROWS = 256
_pools: dict[int, torch.Tensor] = {}  # device index -> [POOL_ROWS, 4] int32
_rows: dict[tuple[int, int], int] = {}  # (device index, stream) -> pool row


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def reserve_barriers(device: torch.device) -> None:
    """Makes `device`'s barrier pool (zeroed) if it has none; call it outside any graph capture."""
    index = _index(device)
    if index not in _pools:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decoder_stack's barriers must be reserved before a CUDA graph capture")
        _pools[index] = torch.zeros(POOL_ROWS, 4, dtype=torch.int32, device=torch.device("cuda", index))


def _barrier(device: torch.device) -> torch.Tensor:
    index = _index(device)
    reserve_barriers(device)
    key = (index, torch.cuda.current_stream(device).cuda_stream)
    if key not in _rows:
        if len(_rows) >= POOL_ROWS:
            raise RuntimeError(f"decoder_stack: more than {POOL_ROWS} streams have run the stack")
        _rows[key] = len(_rows)
    return _pools[index][_rows[key]]


def barrier_errors() -> int:
    """Barrier waits that gave up since the pools were made (0 unless a launch could not keep its programs
    resident); tests and benchmarks read it."""
    return sum(int(pool[:, 2].sum().item()) for pool in _pools.values())


def gave_up(device: torch.device) -> torch.Tensor:
    """The barrier waits on `device` that gave up so far, as a 0-dim int64 tensor computed on the current stream
    (no host sync: the engine copies it to the host with a step's results)."""
    pool = _pools.get(_index(device))
    if pool is None:
        return torch.zeros((), dtype=torch.int64, device=device)
    return pool[:, 2].sum(dtype=torch.int64)


def _chunk(k: int, widest: int = 1024) -> tuple[int, int, int]:
    # A length-k vector as [chunks, width]: the largest power-of-two width up to `widest` that divides k.
    width = k & -k
    while width > widest:
        width //= 2
    chunks = k // width
    return width, chunks, triton.next_power_of_2(chunks)


def _block(n: int, programs: int) -> int:
    return triton.next_power_of_2(max(1, -(-n // programs)))


def default_programs(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def run(w: StackWeights, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, position: int,
        cos: torch.Tensor, sin: torch.Tensor, head: torch.Tensor, *, code: torch.Tensor | None = None,
        programs: int | None = None, sync: bool | None = None, phases: tuple[int, int] | None = None,
        early_tiles: bool = True, spread: bool = True, split_o: bool = True,
        qkv_parts: int | None = None) -> torch.Tensor:
    """T tokens per row through every layer, the final norm and `head` [V, hidden] -> the last token's logits
    [B, V] (fp32).

    x [B T, hidden] (read only): row b's tokens at positions `position` .. `position` + T - 1, T = x rows / B.
    k_cache/v_cache [L, B, kv_heads, capacity, D] hold the positions before `position` and get the tokens' keys and
    values; cos/sin [T, D] (or [D] for one token, fp32) of those positions. `code` int64 [B]: x is an embedding
    table instead, and row b's one token is its row `code[b]` (the lookup is the first phase's load: no gather
    kernel before the launch). `sync` False runs each phase as its own launch (the interpreter's way; the default
    on CPU tensors). `early_tiles` False loads each phase's weights after its barrier (the kernel before
    2026-12-06: the same arithmetic, kept to compare against). `spread` False keeps each activation row once per
    program, in a layout of its own, the form before 2026-12-06 (session 52), kept to compare against: its sums
    and layout changes went through shared memory (see `_spread`). `split_o` False runs the o projection as a phase
    of its own (5 a layer, the form before session 53), kept to compare against. `qkv_parts` (1 or 2): passes over a
    program's q/k/v columns; by default 2 where a program has 32 or more (1 was the form before session 53)."""
    layers, rows, kv_heads, capacity, head_dim = k_cache.shape
    hidden = x.shape[1]
    if code is not None:
        if code.shape != (rows,) or code.dtype != torch.int64:
            raise ValueError("decoder_stack.run: `code` must be int64 [B], one code per cache row")
        code = code.contiguous()  # a column of a codes tensor: the kernel reads code[b] at b
        tokens = 1
    elif x.shape[0] % rows:
        raise ValueError(f"decoder_stack.run: {x.shape[0]} input rows are not a whole number of tokens per each of "
                         f"{rows} cache rows")
    else:
        tokens = x.shape[0] // rows
    cos, sin = cos.reshape(-1, head_dim), sin.reshape(-1, head_dim)
    if cos.shape[0] != tokens or sin.shape[0] != tokens:
        raise ValueError(f"decoder_stack.run: cos/sin hold {cos.shape[0]} positions for {tokens} tokens a row")
    if not 0 <= position <= capacity - tokens:
        raise RuntimeError(f"KV cache full: positions {position}..{position + tokens - 1}, capacity {capacity}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and x.is_contiguous() and cos.is_contiguous()
            and sin.is_contiguous()):
        raise ValueError("decoder_stack.run needs contiguous rows, caches and rotary tables")
    if sync is None:
        sync = x.is_cuda
    if programs is None:
        programs = default_programs(x.device) if x.is_cuda else 4
    heads, inter = w.heads, w.inter
    n_qkv = (heads + 2 * kv_heads) * head_dim
    vocab = head.shape[0]
    acts = rows * tokens  # activation rows: each row's tokens in turn
    x_work = torch.empty(acts, hidden, dtype=x.dtype, device=x.device)
    qkv = torch.empty(acts, n_qkv, dtype=x.dtype, device=x.device)
    attn = torch.empty(acts, heads * head_dim, dtype=x.dtype, device=x.device)
    g = torch.empty(acts, inter, dtype=x.dtype, device=x.device)
    # split_o: o's partial sums per kv head (fp32), the residual row after attention, and each program's copy of it
    o_parts = torch.empty(acts, kv_heads, hidden, dtype=torch.float32, device=x.device)
    mid = torch.empty(acts, hidden, dtype=x.dtype, device=x.device)
    scratch = torch.empty(programs, acts, hidden, dtype=x.dtype, device=x.device)
    o_tiles = max(1, programs // kv_heads)
    logits = torch.empty(rows, vocab, dtype=torch.float32, device=x.device)
    bar = _barrier(x.device) if sync else torch.zeros(4, dtype=torch.int32, device=x.device)
    widest = SPREAD_WIDTH if spread else 1024
    kc_h, c_h, cp_h = _chunk(hidden, widest)
    kc_a, c_a, cp_a = _chunk(heads * head_dim, widest)
    kc_i, c_i, cp_i = _chunk(inter, widest)
    kc_g, c_g, cp_g = _chunk(heads // kv_heads * head_dim, widest)
    per_layer = PHASES_PER_LAYER if split_o else PHASES_PER_LAYER + 1
    if qkv_parts is None:
        qkv_parts = 2 if _block(n_qkv, programs) >= 32 else 1
    if qkv_parts not in (1, 2):
        raise ValueError("decoder_stack.run: qkv_parts is 1 or 2")
    meta = dict(
        LAYERS=layers, HIDDEN=hidden, HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, INTER=inter,
        VOCAB=vocab, CAP=capacity, CAP_P2=triton.next_power_of_2(capacity),
        KC_H=kc_h, C_H=c_h, CP_H=cp_h, KC_A=kc_a, C_A=c_a, KC_I=kc_i, C_I=c_i, CP_I=cp_i,
        BN_QKV=_block(n_qkv, programs), BN_O=_block(hidden, programs), BN_GU=_block(inter, programs),
        BN_V=_block(vocab, programs), SPIN=SPIN_LIMIT, PHASES_PER_LAYER=per_layer,
        GU_PARTS=2 if _block(inter, programs) > 1 else 1, QKV_PARTS=qkv_parts, EARLY=early_tiles, TOKENS=tokens,
        GATHER=code is not None, SPREAD=spread, SPLIT_O=split_o, O_TILES=o_tiles,
        O_EARLY=early_tiles and kv_heads * o_tiles <= programs, BN_OS=_block(hidden, o_tiles), KC_G=kc_g, C_G=c_g,
        CP_G=cp_g,
    )
    if cp_a != c_a:
        raise ValueError("the attention width must be a power-of-two multiple of its chunk")
    args = (x, x_work, qkv, attn, g, o_parts, mid, scratch, logits, w.qkv, w.o, w.gate_up, w.down, w.ln1, w.ln2,
            w.q_norm, w.k_norm, w.final_norm, head, k_cache, v_cache, cos, sin, bar, x if code is None else code, rows,
            position, w.eps, head_dim**-0.5)
    last = per_layer * layers  # the head's phase
    if sync:
        on = pdl.launch(x)
        _stack_kernel[(programs,)](*args, 0, last, **meta, SYNC=True, PDL=on, num_warps=WARPS, **pdl.launch_options(on))
    else:  # `phases` (first, last): only those (benchmarks/stack_phases.py times them one by one)
        first, last = phases if phases is not None else (0, last)
        for phase in range(first, last + 1):
            _stack_kernel[(programs,)](*args, phase, phase, **meta, SYNC=False, num_warps=WARPS)
    return logits


if triton is not None:
    from legato.layers.stack_parts import (
        _activation,
        _after_attention,
        _arrive,
        _attention,
        _dot,
        _input_row,
        _part,
        _rms,
        _round,
        _span,
        _strided_tile,
        _tile,
        _wait,
        _when,
    )

    @triton.jit
    def _stack_kernel(
        x_in_ptr, x_ptr, qkv_ptr, attn_ptr, g_ptr, op_ptr, mid_ptr, scratch_ptr, logits_ptr, wqkv_ptr, wo_ptr,
        wgu_ptr, wd_ptr, ln1_ptr, ln2_ptr, qn_ptr, kn_ptr, fn_ptr, head_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, bar_ptr,
        code_ptr, rows, position, eps, scale, first, last,
        LAYERS: tl.constexpr, HIDDEN: tl.constexpr, HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, INTER: tl.constexpr, VOCAB: tl.constexpr,
        CAP: tl.constexpr, CAP_P2: tl.constexpr, KC_H: tl.constexpr, C_H: tl.constexpr, CP_H: tl.constexpr,
        KC_A: tl.constexpr, C_A: tl.constexpr, KC_I: tl.constexpr, C_I: tl.constexpr, CP_I: tl.constexpr,
        BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_V: tl.constexpr, SPIN: tl.constexpr,
        PHASES_PER_LAYER: tl.constexpr, GU_PARTS: tl.constexpr, QKV_PARTS: tl.constexpr, EARLY: tl.constexpr,
        TOKENS: tl.constexpr, GATHER: tl.constexpr, SPREAD: tl.constexpr, SPLIT_O: tl.constexpr, O_TILES: tl.constexpr,
        O_EARLY: tl.constexpr, BN_OS: tl.constexpr, KC_G: tl.constexpr, C_G: tl.constexpr, CP_G: tl.constexpr,
        SYNC: tl.constexpr, PDL: tl.constexpr = False,
    ):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        acts = rows * TOKENS  # activation rows, row r's tokens at r * TOKENS + t
        N_QKV: tl.constexpr = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        WIDTH: tl.constexpr = HEADS * HEAD_DIM
        GROUP: tl.constexpr = HEADS // KV_HEADS
        BN_PART: tl.constexpr = BN_GU // GU_PARTS
        BN_QP: tl.constexpr = BN_QKV // QKV_PARTS
        BN_OP: tl.constexpr = BN_OS // 2 if BN_OS > 1 else 1
        lo_q, hi_q = _span(pid, programs, N_QKV)
        lo_h, hi_h = _span(pid, programs, HIDDEN)  # the o and down projections' columns
        lo_i, hi_i = _span(pid, programs, INTER)
        GW: tl.constexpr = GROUP * HEAD_DIM  # a kv head's group of attention outputs: o's columns for it
        # EARLY: a phase's weight tile is requested between the barrier's arrive and its wait (`_arrive`, `_wait`),
        # so it streams in while the slowest program finishes the phase before. The barrier that ends a layer opens
        # the next one's iteration: a q/k/v tile carried from one iteration to the next spilled (ptxas: 1,592 bytes
        # of stack a thread against 488).
        for layer in range(LAYERS):
            s = PHASES_PER_LAYER * layer
            # The phases' numbers: with SPLIT_O the o projection runs inside the attention's phase, so the MLP's
            # two phases come one earlier.
            s_gu = s + PHASES_PER_LAYER - 2
            s_down = s + PHASES_PER_LAYER - 1
            if SYNC:
                if layer > 0:
                    _arrive(bar_ptr)
            wqkv_layer = wqkv_ptr + layer * (N_QKV * HIDDEN)
            if EARLY:  # both halves of the tile (see QKV_PARTS below)
                hi_run = _when(hi_q, lo_q, s, first, last)
                lo0, hi0 = _part(lo_q, hi_run, 0, BN_QP)
                w_qkv0 = _tile(wqkv_layer, lo0, hi0, C_H, CP_H, KC_H, BN_QP)
                if QKV_PARTS == 2:
                    lo1, hi1 = _part(lo_q, hi_run, 1, BN_QP)
                    w_qkv1 = _tile(wqkv_layer, lo1, hi1, C_H, CP_H, KC_H, BN_QP)
            if layer == 0:  # with PDL the first layer's q/k/v tile was requested before the kernel before ended
                pdl.wait(PDL)
                pdl.release(PDL)
            if SYNC:
                if layer > 0:
                    _wait(bar_ptr, s * programs, SPIN)
            # 1. norm, then q/k/v. The program's columns in QKV_PARTS passes: the activation row spread over a
            # whole tile's rows, and its norm, took as many registers as the tile itself, and spilled.
            if (s >= first) & (s <= last):
                for part in tl.static_range(QKV_PARTS):
                    part_lo, part_hi = _part(lo_q, hi_q, part, BN_QP)
                    if EARLY and part == 0:
                        w = w_qkv0
                    elif EARLY:
                        w = w_qkv1
                    else:
                        w = _tile(wqkv_layer, part_lo, part_hi, C_H, CP_H, KC_H, BN_QP)
                    n = part_lo + tl.arange(0, BN_QP)
                    for i in range(acts):
                        if layer == 0:  # the input stays as given; a later phase starts the working copy x
                            xv = _activation(_input_row(x_in_ptr, code_ptr, i, HIDDEN, GATHER), BN_QP, C_H, CP_H,
                                             KC_H, SPREAD)
                        else:
                            xv = _activation(x_ptr + i * HIDDEN, BN_QP, C_H, CP_H, KC_H, SPREAD)
                        h = _rms(xv, ln1_ptr + layer * HIDDEN, eps, HIDDEN, x_ptr, BN_QP, C_H, CP_H, KC_H, SPREAD)
                        tl.store(qkv_ptr + i * N_QKV + n, _dot(w, h, SPREAD), mask=n < part_hi)
            wo_layer = wo_ptr + layer * (HIDDEN * WIDTH)
            if SYNC:
                _arrive(bar_ptr)
            if SPLIT_O and O_EARLY:  # this program's one (kv head, rows of o) item of the attention's phase
                lo_os, hi_os = _span(pid % O_TILES, O_TILES, HIDDEN)
                hi_os = tl.where(pid < KV_HEADS * O_TILES, _when(hi_os, lo_os, s + 1, first, last), lo_os)
                wo_group = wo_layer + (pid // O_TILES) * GW
                lo0, hi0 = _part(lo_os, hi_os, 0, BN_OP)
                lo1, hi1 = _part(lo_os, hi_os, 1, BN_OP)
                w_os0 = _strided_tile(wo_group, lo0, hi0, WIDTH, C_G, CP_G, KC_G, BN_OP)
                w_os1 = _strided_tile(wo_group, lo1, hi1, WIDTH, C_G, CP_G, KC_G, BN_OP)
            if SYNC:
                _wait(bar_ptr, (s + 1) * programs, SPIN)
            # 2. attention for a (row, kv head): its group of query heads over the row's positions. With SPLIT_O each
            # program also multiplies the group's output by its tile of o's columns for that group: a partial o
            # per kv head, summed in a fixed order by the phases after (`_after_attention`).
            if (s + 1 >= first) & (s + 1 <= last):
                d = tl.arange(0, HEAD_DIM)
                half: tl.constexpr = HEAD_DIM // 2
                dp = (d + half) % HEAD_DIM
                is_low = d < half
                qw = tl.load(qn_ptr + layer * HEAD_DIM + d).to(tl.float32)
                qwp = tl.load(qn_ptr + layer * HEAD_DIM + dp).to(tl.float32)
                kw = tl.load(kn_ptr + layer * HEAD_DIM + d).to(tl.float32)
                kwp = tl.load(kn_ptr + layer * HEAD_DIM + dp).to(tl.float32)
                if SPLIT_O:
                    # O_TILES programs share each kv head, each with its own rows of o: all compute the same
                    # attention (a few positions: cheaper than a barrier), and one of them writes the cache.
                    for item in range(pid, KV_HEADS * O_TILES, programs):
                        kvh = item // O_TILES
                        lo_o, hi_o = _span(item % O_TILES, O_TILES, HIDDEN)
                        for r in range(rows):
                            _attention(qkv_ptr, attn_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, x_ptr, layer, r, kvh, rows,
                                       position, eps, scale, qw, qwp, kw, kwp, d, dp, is_low,
                                       (item % O_TILES == 0) | (TOKENS > 1), KV_HEADS, HEAD_DIM, GROUP, CAP, CAP_P2,
                                       N_QKV, WIDTH, TOKENS)
                            tl.debug_barrier()  # the group's output, stored by this program's threads, read back
                            # o's rows in two halves, each with its own copy of the group's output (registers)
                            for part in tl.static_range(2):
                                part_lo, part_hi = _part(lo_o, hi_o, part, BN_OP)
                                if O_EARLY and part == 0:
                                    w = w_os0
                                elif O_EARLY:
                                    w = w_os1
                                else:
                                    w = _strided_tile(wo_layer + kvh * GW, part_lo, part_hi, WIDTH, C_G, CP_G, KC_G,
                                                      BN_OP)
                                n = part_lo + tl.arange(0, BN_OP)
                                for t in tl.static_range(TOKENS):
                                    i = r * TOKENS + t
                                    a = _activation(attn_ptr + i * WIDTH + kvh * GW, BN_OP, C_G, CP_G, KC_G, SPREAD)
                                    tl.store(op_ptr + (i * KV_HEADS + kvh) * HIDDEN + n, _dot(w, a, SPREAD),
                                             mask=n < part_hi)
                else:
                    for item in range(pid, rows * KV_HEADS, programs):
                        _attention(qkv_ptr, attn_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, x_ptr, layer, item // KV_HEADS,
                                   item % KV_HEADS, rows, position, eps, scale, qw, qwp, kw, kwp, d, dp, is_low,
                                   item >= 0, KV_HEADS, HEAD_DIM, GROUP, CAP, CAP_P2, N_QKV, WIDTH, TOKENS)
            if not SPLIT_O:
                if SYNC:
                    _arrive(bar_ptr)
                if EARLY:
                    w_o = _tile(wo_layer, lo_h, _when(hi_h, lo_h, s + 2, first, last), C_A, C_A, KC_A, BN_O)
                if SYNC:
                    _wait(bar_ptr, (s + 2) * programs, SPIN)
                # 3. o projection, residual add.
                if (s + 2 >= first) & (s + 2 <= last):
                    if EARLY:
                        w = w_o
                    else:
                        w = _tile(wo_layer, lo_h, hi_h, C_A, C_A, KC_A, BN_O)
                    n = lo_h + tl.arange(0, BN_O)
                    for i in range(acts):
                        o = _round(_dot(w, _activation(attn_ptr + i * WIDTH, BN_O, C_A, C_A, KC_A, SPREAD), SPREAD),
                                   x_ptr)
                        if layer == 0:
                            res = tl.load(_input_row(x_in_ptr, code_ptr, i, HIDDEN, GATHER) + n, mask=n < hi_h,
                                          other=0.0)
                            res = res.to(tl.float32)
                        else:
                            res = tl.load(x_ptr + i * HIDDEN + n, mask=n < hi_h, other=0.0, cache_modifier=".cg")
                            res = res.to(tl.float32)
                        tl.store(x_ptr + i * HIDDEN + n, res + o, mask=n < hi_h)
            base_gu = wgu_ptr + layer * (2 * INTER * HIDDEN)
            if SYNC:
                _arrive(bar_ptr)
            if EARLY:  # the first of the gate/up parts
                hi_part = _when(hi_i, lo_i, s_gu, first, last)
                wg_first = _tile(base_gu, lo_i, hi_part, C_H, CP_H, KC_H, BN_PART)
                wu_first = _tile(base_gu + INTER * HIDDEN, lo_i, hi_part, C_H, CP_H, KC_H, BN_PART)
            if SYNC:
                _wait(bar_ptr, s_gu * programs, SPIN)
            # 4. norm, then gate/up with SiLU.
            if (s_gu >= first) & (s_gu <= last):
                if SPLIT_O:
                    # Each program sums the o partials into the whole row (the residual after attention) and keeps
                    # it in its own scratch row, read back below in the weight tile's layout; its columns of the
                    # row also go to `mid`, the down phase's residual.
                    c = tl.arange(0, CP_H)[:, None]
                    k = tl.arange(0, KC_H)[None, :]
                    col = c * KC_H + k
                    for i in range(acts):
                        if layer == 0:
                            res_row = _input_row(x_in_ptr, code_ptr, i, HIDDEN, GATHER)
                        else:
                            res_row = x_ptr + i * HIDDEN
                        mid = _after_attention(res_row, op_ptr + i * (KV_HEADS * HIDDEN), col, c < C_H, x_ptr,
                                               HIDDEN, KV_HEADS)
                        tl.store(scratch_ptr + (pid * acts + i) * HIDDEN + col, mid, mask=c < C_H)
                        tl.store(mid_ptr + i * HIDDEN + col, mid, mask=(c < C_H) & (col >= lo_h) & (col < hi_h))
                    tl.debug_barrier()
                # The program's columns in two passes: the gate and up tiles of all of them at once held twice the
                # q/k/v phase's registers and spilled (ptxas: 444 bytes of spills, 60 without the second tile).
                for part in tl.static_range(GU_PARTS):
                    part_lo = tl.minimum(lo_i + part * BN_PART, hi_i)
                    if EARLY and part == 0:
                        wg = wg_first
                        wu = wu_first
                    else:
                        wg = _tile(base_gu, part_lo, hi_i, C_H, CP_H, KC_H, BN_PART)
                        wu = _tile(base_gu + INTER * HIDDEN, part_lo, hi_i, C_H, CP_H, KC_H, BN_PART)
                    n = part_lo + tl.arange(0, BN_PART)
                    for i in range(acts):
                        if SPLIT_O:
                            xv = _activation(scratch_ptr + (pid * acts + i) * HIDDEN, BN_PART, C_H, CP_H, KC_H, SPREAD)
                        else:
                            xv = _activation(x_ptr + i * HIDDEN, BN_PART, C_H, CP_H, KC_H, SPREAD)
                        h = _rms(xv, ln2_ptr + layer * HIDDEN, eps, HIDDEN, x_ptr, BN_PART, C_H, CP_H, KC_H, SPREAD)
                        gate = _round(_dot(wg, h, SPREAD), x_ptr)
                        up = _round(_dot(wu, h, SPREAD), x_ptr)
                        tl.store(g_ptr + i * INTER + n, gate / (1.0 + tl.exp(-gate)) * up, mask=n < hi_i)
            if SYNC:
                _arrive(bar_ptr)
            if EARLY:
                w_down = _tile(wd_ptr + layer * (HIDDEN * INTER), lo_h, _when(hi_h, lo_h, s_down, first, last), C_I,
                               CP_I, KC_I, BN_O)
            if SYNC:
                _wait(bar_ptr, s_down * programs, SPIN)
            # 5. down, residual add.
            if (s_down >= first) & (s_down <= last):
                if EARLY:
                    w = w_down
                else:
                    w = _tile(wd_ptr + layer * (HIDDEN * INTER), lo_h, hi_h, C_I, CP_I, KC_I, BN_O)
                n = lo_h + tl.arange(0, BN_O)
                for i in range(acts):
                    a = _activation(g_ptr + i * INTER, BN_O, C_I, CP_I, KC_I, SPREAD)
                    delta = _round(_dot(w, a, SPREAD), x_ptr)
                    if SPLIT_O:
                        res = tl.load(mid_ptr + i * HIDDEN + n, mask=n < hi_h, other=0.0, cache_modifier=".cg")
                    else:
                        res = tl.load(x_ptr + i * HIDDEN + n, mask=n < hi_h, other=0.0, cache_modifier=".cg")
                    tl.store(x_ptr + i * HIDDEN + n, res.to(tl.float32) + delta, mask=n < hi_h)
        # 6. final norm and the head, for each row's last token.
        s = PHASES_PER_LAYER * LAYERS
        lo, hi = _span(pid, programs, VOCAB)
        if SYNC:
            _arrive(bar_ptr)
        if EARLY:
            w_head = _tile(head_ptr, lo, _when(hi, lo, s, first, last), C_H, CP_H, KC_H, BN_V)
        if SYNC:
            _wait(bar_ptr, s * programs, SPIN)
        if (s >= first) & (s <= last):
            if EARLY:
                w = w_head
            else:
                w = _tile(head_ptr, lo, hi, C_H, CP_H, KC_H, BN_V)
            n = lo + tl.arange(0, BN_V)
            for r in range(rows):
                xv = _activation(x_ptr + (r * TOKENS + TOKENS - 1) * HIDDEN, BN_V, C_H, CP_H, KC_H, SPREAD)
                h = _rms(xv, fn_ptr, eps, HIDDEN, x_ptr, BN_V, C_H, CP_H, KC_H, SPREAD)
                tl.store(logits_ptr + r * VOCAB + n, _round(_dot(w, h, SPREAD), x_ptr), mask=n < hi)
        if SYNC:
            # The last program out resets the counters for the next launch on this stream.
            done = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
            if done == programs - 1:
                tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(bar_ptr + 1, 0, sem="relaxed", scope="gpu")
