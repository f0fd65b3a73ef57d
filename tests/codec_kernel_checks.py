"""Each Triton kernel of the streaming codec against its PyTorch twin, on fresh random inputs.

`run_checks(device, dtype)` is shared by the GPU tests (CUDA, bf16) and by a CPU test that runs this file in
a subprocess under Triton's interpreter (`TRITON_INTERPRET=1`, fp32: the interpreter mishandles bf16). Shapes
are small and deliberately ragged (channels not multiples of 16, odd lengths, several phases, dilations,
slots in any order with reused and fresh ones), and every output is poisoned first so an unwritten element
shows. `python tests/codec_kernel_checks.py [cuda|cpu]` prints one line per check.
"""

from __future__ import annotations

import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import patch_for_numpy

    patch_for_numpy()

from legato.layers import causal_conv as cc
from legato.layers import conv_kernels as ck
from legato.layers import rows as rw
from legato.layers import window_attention as wa


def _rand(*shape, gen, device, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def _bank(slots, h, c, gen, device, dtype):
    hist = _rand(slots, 2, h, c, gen=gen, device=device, dtype=dtype)
    calls = torch.randint(0, 5, (slots,), generator=gen).to(device)
    pos = torch.randint(0, 4, (slots,), generator=gen).to(device)
    pos[0] = 0  # a fresh slot: its history reads as zeros
    return hist, calls, pos


def _conv_inputs(streams, h, length, taps, phases, cin, cout, gen, device, dtype):
    """P [streams, h + length, cin], weight, bias, SnakeBeta parameters and a starting output of a random conv."""
    p = _rand(streams, h + length, cin, gen=gen, device=device, dtype=dtype)
    w = _rand(taps * cin, phases * cout, gen=gen, device=device, dtype=dtype, scale=cin ** -0.5)
    b = _rand(phases * cout, gen=gen, device=device, dtype=dtype, scale=0.1)
    e = (_rand(cout, gen=gen, device=device).exp(), _rand(cout, gen=gen, device=device).exp())
    base = _rand(streams * length * phases, cout, gen=gen, device=device, dtype=dtype)
    return p, w, b, e, base


def run_checks(device: str, dtype: torch.dtype) -> dict[str, float]:
    """Relative L2 error of every kernel against its twin (outputs and in-place state both)."""
    gen = torch.Generator().manual_seed(0)
    errors: dict[str, float] = {}
    slots = torch.tensor([3, 0, 2], device=device)

    # stage: history rows + SnakeBeta'd rows, and the next history
    for h, length, c, rate in ((18, 5, 12, 4), (6, 40, 24, 32), (1, 3, 40, 160)):
        x = _rand(3, length, c, gen=gen, device=device, dtype=dtype)
        hist, calls, pos = _bank(4, h, c, gen, device, dtype)
        snake = (_rand(c, gen=gen, device=device).exp(), _rand(c, gen=gen, device=device).exp())
        outs = []
        for kernel in (True, False):
            hh = hist.clone()
            outs.append((cc.stage(x, hh, calls, pos, slots, rate, snake, kernel=kernel), hh))
        errors[f"stage h={h} L={length} C={c}"] = max(_err(outs[0][0], outs[1][0]), _err(outs[0][1], outs[1][1]))

    # codebook lookup + history
    tables = _rand(16, 64, 8, gen=gen, device=device, dtype=dtype)
    codes = torch.randint(0, 64, (3, 5, 16), generator=gen).to(device)
    hist, calls, pos = _bank(4, 2, 16, gen, device, dtype)
    outs = []
    for kernel in (True, False):
        hh = hist.clone()
        outs.append((cc.codebook_stage(codes, tables, 1, hh, calls, pos, slots, kernel=kernel), hh))
    errors["codebook"] = max(_err(outs[0][0], outs[1][0]), _err(outs[0][1], outs[1][1]))

    # the conv GEMM: dense convs with dilation, a 1x1 with a residual, transposed convs as phases
    cases = [(7, 3, 1, 24, 20, 9, "snake"), (7, 1, 1, 48, 16, 4, "none"), (1, 1, 1, 32, 32, 11, "residual"),
             (2, 1, 5, 20, 12, 3, "none"), (1, 1, 2, 64, 64, 3, "gelu"), (7, 1, 1, 12, 1, 6, "clamp"),
             (3, 1, 1, 64, 96, 2, "none"),
             # one output channel: the dot-product kernel (channels over one and several blocks, each epilogue)
             (7, 2, 1, 40, 1, 9, "snake"), (1, 1, 1, 24, 1, 5, "residual"), (3, 1, 1, 96, 1, 4, "gelu"),
             (7, 1, 1, 96, 1, 7, "clamp")]
    for taps, dil, phases, cin, cout, length, epi in cases:
        h = (taps - 1) * dil + 2  # more history than needed: the conv must read only its last rows
        p, w, b, e, base = _conv_inputs(3, h, length, taps, phases, cin, cout, gen, device, dtype)
        outs = []
        for kernel in (True, False):
            out = base.clone() if epi == "residual" else torch.full_like(base, float("nan"))
            outs.append(cc.conv_gemm(p, w, b, length, taps, dil, phases, epi, e, out=out, kernel=kernel))
        errors[f"conv taps={taps} dil={dil} phases={phases} {cin}->{cout} {epi}"] = _err(outs[0], outs[1])

    # split-K: the same convs in K parts, partial sums reduced with the bias and the epilogue
    for taps, dil, phases, cin, cout, length, epi in cases[:5]:
        p, w, b, e, base = _conv_inputs(2, (taps - 1) * dil + 1, length, taps, phases, cin, cout, gen, device, dtype)
        ref = cc.conv_gemm(p, w, b, length, taps, dil, phases, epi, e, out=base.clone(), kernel=False)
        out = base.clone() if epi == "residual" else torch.full_like(base, float("nan"))
        ck.launch_conv(p, w, b, length, taps, dil, phases, epi, e, out, split=3)
        errors[f"split-K conv taps={taps} phases={phases} {cin}->{cout} {epi}"] = _err(out, ref)

    # K blocks over the flattened (tap, channel) index (channels not a multiple of BLOCK_K: a block spans two
    # taps), and a tile of two column blocks (64 + 32 wide: 96 channels with no padded column), with and
    # without split-K, against the twin
    for taps, dil, phases, cin, cout, length, epi, config in (
            (7, 3, 1, 24, 24, 9, "snake", (32, 16, 16, 4, 2, 16)),  # 24 = 16 + 8: blocks span taps
            (7, 1, 1, 96, 96, 5, "snake", (16, 64, 64, 4, 2, 32)),
            (2, 1, 3, 40, 48, 4, "none", (16, 32, 32, 4, 2, 16)),  # phases: the second block ends at Cout
            (1, 1, 1, 96, 96, 6, "residual", (32, 64, 64, 4, 2, 32))):
        p, w, b, e, base = _conv_inputs(2, (taps - 1) * dil + 1, length, taps, phases, cin, cout, gen, device, dtype)
        ref = cc.conv_gemm(p, w, b, length, taps, dil, phases, epi, e, out=base.clone(), kernel=False)
        for flat, split in ((True, 1), (False, 1), (True, 2)):
            out = base.clone() if epi == "residual" else torch.full_like(base, float("nan"))
            ck.launch_conv(p, w, b, length, taps, dil, phases, epi, e, out, config=config, split=split, flat=flat)
            errors[f"wide tile conv taps={taps} phases={phases} {cin}->{cout} flat={flat} split={split}"] = \
                _err(out, ref)

    # a conv whose epilogue also stages its output for the next conv (SnakeBeta or none; phases; split-K; a 1x1
    # over [1, B * L, C] feeding B streams), then `restage` adding the history rows and writing the next history
    # (histories longer and shorter than the call)
    for taps, phases, cin, cout, length, epi, snake_next, h_next, split, config in (
            (7, 1, 24, 20, 9, "snake", True, 6, 1, None), (2, 3, 16, 12, 4, "none", True, 18, 1, None),
            (1, 1, 32, 24, 5, "residual", True, 2, 1, None), (3, 1, 40, 16, 6, "none", False, 4, 2, None),
            (1, 1, 96, 96, 4, "residual", True, 6, 1, (16, 64, 32, 4, 2, 32))):  # the 64 + 32 tile
        h = taps
        p, w, b, e, base = _conv_inputs(3, h, length, taps, phases, cin, cout, gen, device, dtype)
        s_e = (_rand(cout, gen=gen, device=device).exp(), _rand(cout, gen=gen, device=device).exp())
        hist, calls, pos = _bank(4, h_next, cout, gen, device, dtype)
        outs = []
        for kernel in (True, False):
            out = base.clone() if epi == "residual" else torch.full_like(base, float("nan"))
            s_buf = torch.full((3, h_next + length * phases, cout), float("nan"), device=device, dtype=dtype)
            if taps == 1:  # a 1x1 conv over one long stream [1, 3 x length, C], feeding 3 streams
                pp, ln = p[:, h:].reshape(1, 3 * length, cin), 3 * length
            else:
                pp, ln = p, length
            staged = (s_buf, s_e if snake_next else None)
            if kernel:
                ck.launch_conv(pp, w, b, ln, taps, 1, phases, epi, e, out, config=config, split=split, staged=staged)
            else:
                cc.conv_gemm(pp, w, b, ln, taps, 1, phases, epi, e, out=out, kernel=False, staged=staged)
            hh = hist.clone()
            cc.restage(s_buf, hh, calls, pos, slots, 2, kernel=kernel)
            outs.append((out, s_buf, hh))
        errors[f"staged conv taps={taps} phases={phases} {cin}->{cout} {epi} H'={h_next} split={split}"] = max(
            _err(a, b) for a, b in zip(*outs, strict=True))

    # a staged conv that writes its output to the next conv's input only (keep_out=False): the output untouched
    p, w, b, e, base = _conv_inputs(3, 6, 5, 7, 1, 24, 20, gen, device, dtype)
    s_buf = _rand(3, 4 + 5, 20, gen=gen, device=device, dtype=dtype)
    outs = []
    for k, keep in ((True, False), (False, True)):
        out, s2 = base.clone(), s_buf.clone()
        cc.conv_gemm(p, w, b, 5, 7, 1, 1, "residual", out=out, kernel=k, staged=(s2, e), keep_out=keep)
        outs.append((out, s2))
    errors["staged conv, output kept out"] = max(_err(outs[0][0], base), _err(outs[0][1], outs[1][1]))

    # restage_group: up to four staged inputs of one shape family (histories of 2, 6, 18 and 0 rows, lengths
    # below and above them) in a launch to fill them and one to write their next histories, against `restage`
    for length in (3, 11):
        c, slots_n = 20, 5
        heights = (2, 6, 18, 0)
        calls = torch.randint(0, 5, (slots_n,), generator=gen).to(device)
        pos = torch.randint(0, 4, (slots_n,), generator=gen).to(device)
        pos[1] = 0
        hists = [_rand(slots_n, 2, h, c, gen=gen, device=device, dtype=dtype) for h in heights]
        ps = [_rand(len(slots), h + length, c, gen=gen, device=device, dtype=dtype) for h in heights]
        got_p, got_h = [p.clone() for p in ps], [h.clone() for h in hists]
        cc.restage_group(got_p, got_h, calls, pos, slots, 4, copy_in=True, copy_out=False, kernel=True)
        cc.restage_group(got_p, got_h, calls, pos, slots, 4, copy_in=False, copy_out=True, kernel=True)
        want_p, want_h = [p.clone() for p in ps], [h.clone() for h in hists]
        for p, h in zip(want_p, want_h, strict=True):
            cc.restage(p, h, calls, pos, slots, 4, kernel=False)
        errors[f"restage_group L={length}"] = max(_err(a, b) for a, b in zip(got_p + got_h, want_p + want_h,
                                                                            strict=True))

    # a residual unit as one kernel, against its two GEMMs (channels below and at a power of two)
    for c, taps, dil, length in ((12, 7, 3, 5), (32, 7, 1, 9), (40, 3, 2, 4)):
        h = (taps - 1) * dil
        p = _rand(3, h + length, c, gen=gen, device=device, dtype=dtype)
        w7 = _rand(taps * c, c, gen=gen, device=device, dtype=dtype, scale=(taps * c) ** -0.5)
        w1 = _rand(c, c, gen=gen, device=device, dtype=dtype, scale=c ** -0.5)
        b7, b1 = (_rand(c, gen=gen, device=device, dtype=dtype, scale=0.1) for _ in range(2))
        e = (_rand(c, gen=gen, device=device).exp(), _rand(c, gen=gen, device=device).exp())
        x = _rand(3 * length, c, gen=gen, device=device, dtype=dtype)
        outs = [cc.residual_unit(p, w7, b7, length, taps, dil, e, w1, b1, x.clone(), kernel=k) for k in (True, False)]
        errors[f"residual unit C={c} taps={taps} dil={dil}"] = _err(outs[0], outs[1])

    # depthwise conv + LayerNorm
    p = _rand(3, 6 + 7, 24, gen=gen, device=device, dtype=dtype)
    w, b = _rand(24, 7, gen=gen, device=device, dtype=dtype), _rand(24, gen=gen, device=device, dtype=dtype)
    errors["depthwise+layernorm"] = _err(cc.depthwise_layernorm(p, w, b, 7, 1e-6, kernel=True),
                                         cc.depthwise_layernorm(p, w, b, 7, 1e-6, kernel=False))

    # window attention over rings, frames 1 and 5, positions before and past the window
    heads, kv_heads, dim, window = 4, 2, 16, 8
    for frames in (1, 5):
        ring = window - 1 + frames + 2
        qkv = _rand(3 * frames, (heads + 2 * kv_heads) * dim, gen=gen, device=device, dtype=dtype)
        keys = _rand(4, ring, kv_heads, dim, gen=gen, device=device, dtype=dtype)
        values = _rand(4, ring, kv_heads, dim, gen=gen, device=device, dtype=dtype)
        pos = torch.tensor([0, 9, 3, 30], device=device)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))
        outs = []
        for kernel in (True, False):
            k2, v2 = keys.clone(), values.clone()
            o = wa.window_attention(qkv, k2, v2, pos, slots, frames, heads, window, inv_freq, kernel=kernel)
            outs.append((o, k2, v2))
        errors[f"window attention T={frames}"] = max(_err(a, b) for a, b in zip(*outs, strict=True))

    if device == "cpu":  # the whole decoder, kernels against twins, two calls (a fresh slot joins the second)
        from legato.models.qwen3_tts import codec_stages
        from legato.models.qwen3_tts.codec_decoder import CodecDecoder
        from legato.models.qwen3_tts.streaming_codec import StreamingCodecDecoder
        from legato.models.qwen3_tts.testing import randomize_codec_decoder_
        from legato.models.qwen3_tts.tiny import tiny_speech_tokenizer_config

        dec = randomize_codec_decoder_(CodecDecoder(tiny_speech_tokenizer_config().decoder_config).eval(), seed=3)
        # kernels, twins, and kernels with the transformer's fused few-row GEMMs (codec_stages.FUSED_TRANSFORMER)
        codecs = [StreamingCodecDecoder(dec, 4, kernels=k) for k in (True, False, True)]
        wavs: list[list[torch.Tensor]] = [[], [], []]
        for call, (order, frames) in enumerate((([2, 0], 1), ([0, 3], 2))):
            index = torch.tensor(order)
            codes = torch.randint(0, dec.config.codebook_size, (len(order), frames, dec.num_quantizers),
                                  generator=torch.Generator().manual_seed(call))
            knobs = ("FUSED_TRANSFORMER", "GROUP_RESTAGE", "SKIP_DEAD_OUTPUT")
            saved = {k: getattr(codec_stages, k) for k in knobs}
            for i, (codec, out) in enumerate(zip(codecs, wavs, strict=True)):
                if call == 0:
                    codec.reset(torch.arange(4))
                for k in knobs:
                    setattr(codec_stages, k, i == 2)
                try:
                    out.append(codec.step(index, codes))
                finally:
                    for k, v in saved.items():
                        setattr(codec_stages, k, v)
        errors["whole decoder, 2 calls"] = max(_err(a, b) for a, b in zip(wavs[0], wavs[1], strict=True))
        errors["whole decoder, fused transformer, grouped restage, no dead output"] = max(
            _err(a, b) for a, b in zip(wavs[2], wavs[1], strict=True))

    x = _rand(7, 40, gen=gen, device=device, dtype=dtype)
    errors["rms"] = _err(rw.rms_normalize(x, 1e-5, kernel=True), rw.rms_normalize(x, 1e-5, kernel=False))
    gu = _rand(7, 2 * 24, gen=gen, device=device, dtype=dtype)
    errors["silu*mul"] = _err(rw.silu_mul_packed(gu, kernel=True), rw.silu_mul_packed(gu, kernel=False))
    return errors


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    dt = torch.float32 if dev == "cpu" else torch.bfloat16
    errs = run_checks(dev, dt)
    for name, err in errs.items():
        print(f"{name}: {err:.3g}")
    bad = [n for n, e in errs.items() if not e <= tolerance(dt)]
    print("FAILED: " + ", ".join(bad) if bad else "ALL OK")
    sys.exit(1 if bad else 0)
