"""`sampler.draw` as one Triton program per row: argmax, temperature, top-k, top-p and the exponential race.

A frame draws 16 tokens one after another (codebook 0, then the code predictor's 15). Compiled by
`torch.compile`, each draw was still ~38 us of device time at batch 1 on the H200: a radix sort of the row
(~22 us) and five more kernels. Here a row's logits stay in one program's registers, Philox runs in the
kernel, and one argmax draws. The top-k value and the top-p cut are found by bisection over the values'
bit patterns (32 counting passes each, the top-p one skipped when the row's top_p is 1), not by sorting: an
in-register bitonic sort of 2,048 values took ~42 us per draw on the H200, the same at batch 1 and 64
(docs/benchmarks.md), most of a frame's sixteen draws. `RADIX_SELECT` finds the top-k value instead by four
256-bin histograms of the key's bytes: the same tokens, but about 4 us a draw slower on an H100 (session of
2026-12-07), so it stays off.

Same contract as `sampler.draw`, to the bit where the math library allows: the masses, thresholds, cut and
Philox words are computed exactly as there (integer cumulative masses, float64 comparisons); on CUDA the
exponential, logarithm and log1p are libdevice's, the functions torch's own CUDA kernels use. Under Triton's
interpreter (the CPU tests) they are numpy's, with log1p taken in float64: equal to the reference's except at
a one-ulp tie, which the tests' draws do not meet.
"""

from __future__ import annotations

import torch

from legato.layers import pdl

try:  # Triton ships with CUDA builds of torch; the CPU build has none.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# The sampler takes the kernel on CUDA when this is on (benchmarks switch it off to measure the compiled path).
ENABLED = True
# Top-k's threshold by a radix select (four 256-bin histograms of the key's bytes) instead of 32 counting passes.
# Equal by construction, under the interpreter (tests/draw_kernel_checks.py) and by the codes' digest on an H100;
# off: the 0.6B stack frame took 3.487 ms with it against 3.418 without (docs/benchmarks.md, 2026-12-07).
RADIX_SELECT = False
_MASS_SCALE = 2.0**36  # sampler._MASS_BITS


def available(logits: torch.Tensor) -> bool:
    return ENABLED and triton is not None and logits.is_cuda


def fused_draw(logits: torch.Tensor, do_sample: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, seed: torch.Tensor, frame: torch.Tensor, codebook: torch.Tensor | int,
               exact_math: bool | None = None, radix: bool | None = None) -> torch.Tensor:
    """Tokens int64 [B] from logits [B, V] (see `sampler.draw`; float32, or the head's bf16/fp16, widened to
    float32 as they load, exactly as `.float()` would; the head's knobs as [B] tensors,
    codebook an int64 [B] tensor or one int for every row: no tensor to fill before each draw).
    `exact_math`: libdevice functions (default on CUDA). `radix`: top-k by radix select (default
    `RADIX_SELECT`)."""
    b, vocab = logits.shape
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16) or logits.stride(-1) != 1:
        raise ValueError("fused_draw needs unit-stride float32, bfloat16 or float16 logits")
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    block = triton.next_power_of_2(vocab)
    fixed = isinstance(codebook, int)
    _draw_kernel[(b,)](
        logits, do_sample, temperature, top_k, top_p, seed, frame, out if fixed else codebook,
        codebook if fixed else 0, out, logits.stride(0), vocab, FIXED_CODEBOOK=fixed, BLOCK_V=block,
        EXACT=logits.is_cuda if exact_math is None else exact_math, MASS_SCALE=_MASS_SCALE,
        RADIX=RADIX_SELECT if radix is None else radix, PDL=pdl.launch(logits),
        num_warps=8 if block >= 4096 else 4, **pdl.launch_options(pdl.launch(logits)),
    )
    return out


if triton is not None:

    @triton.jit
    def _exp(x, EXACT: tl.constexpr):
        if EXACT:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _neg_log_log1p_neg(u, EXACT: tl.constexpr):
        # log(-log1p(-u)): the exponential variate E = -log1p(-u), then its log (the race subtracts it).
        if EXACT:
            e = -libdevice.log1p(-u)
            return libdevice.log(e)
        else:  # log1p in float64 without libdevice: log(1 + x) * x / ((1 + x) - 1) keeps full precision near 0
            x = -u.to(tl.float64)
            y = 1.0 + x
            e = -tl.where(y == 1.0, x, tl.log(y) * x / (y - 1.0)).to(tl.float32)
            return tl.log(e)

    @triton.jit
    def _philox_word(v, c1, c2, k0, k1):
        # Philox-4x32-10 at counter (v // 4, c1, c2, 0) under key (k0, k1), word v % 4 (rng.random_bits).
        mul0 = tl.full([], 0xD2511F53, tl.uint32)
        mul1 = tl.full([], 0xCD9E8D57, tl.uint32)
        bump0 = tl.full([], 0x9E3779B9, tl.uint32)
        bump1 = tl.full([], 0xBB67AE85, tl.uint32)
        x0 = (v // 4).to(tl.uint32)
        x1 = tl.zeros_like(x0) + c1
        x2 = tl.zeros_like(x0) + c2
        x3 = tl.zeros_like(x0)
        for _ in tl.static_range(10):
            hi0 = tl.umulhi(x0, mul0)
            lo0 = x0 * mul0
            hi1 = tl.umulhi(x2, mul1)
            lo1 = x2 * mul1
            x0, x1, x2, x3 = hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0
            k0 = k0 + bump0
            k1 = k1 + bump1
        w = v % 4
        return tl.where(w == 0, x0, tl.where(w == 1, x1, tl.where(w == 2, x2, x3)))

    @triton.jit
    def _order_key(x):
        # float32 -> an int64 holding an int32 of the same order (negative floats' magnitude bits flipped); -0.0
        # keyed as +0.0, as the float comparisons downstream treat them. int64, so the searches' bounds (one past
        # the int32 range) compare without a cast per pass.
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return tl.where(x == 0.0, 0, key).to(tl.int64)

    @triton.jit
    def _key_bounds(key, valid):
        # The smallest and the largest valid key: where the searches start.
        return tl.min(tl.where(valid, key, 2147483647), axis=0), tl.max(tl.where(valid, key, -2147483648), axis=0)

    @triton.jit
    def _kth_largest_key(key, valid, k, lowest, highest):
        # The largest t with count(key >= t) >= k: the k-th largest key, counting ties (k <= the valid count).
        # 32 halvings cover the int32 range; once converged an iteration changes nothing.
        lo = lowest  # count = all >= k
        hi = highest + 1  # count = 0 < k
        for _ in tl.static_range(32):
            mid = lo + (hi - lo) // 2
            enough = tl.sum((valid & (key >= mid)).to(tl.int32), axis=0) >= k
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
        return lo

    @triton.jit
    def _kth_largest_key_radix(key, valid, k):
        # `_kth_largest_key` by a radix select: the key's four bytes from the top, each pass a 256-bin histogram of
        # the byte among the keys that share the bytes chosen so far. Counting down from the top bin, the bin
        # where k is reached holds the k-th largest; the keys above it are k's head start for the next byte.
        u = key + 2147483648  # [0, 2**32): the int32 order as unsigned, so bytes compare as the keys do
        bins = tl.arange(0, 256)
        found = tl.zeros_like(k)
        in_play = valid
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            digit = ((u >> shift) & 255).to(tl.int32)
            hist = tl.histogram(digit, 256, mask=in_play)
            at_or_above = tl.cumsum(hist, 0, reverse=True)
            b = tl.sum((at_or_above >= k).to(tl.int32), axis=0) - 1  # at_or_above only falls as the bin rises
            k = k - tl.sum(tl.where(bins == b, at_or_above - hist, 0), axis=0)
            found = found | (b.to(tl.int64) << shift)
            in_play = in_play & (digit == b)
        return found - 2147483648

    @triton.jit
    def _value_of_key(key):
        # `_order_key` undone: the float32 of an int32 order key (0 gives +0.0, which compares as -0.0 does).
        bits = key.to(tl.int32)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)

    @triton.jit
    def _top_p_key(key, mass, threshold, lo, hi):
        # The smallest key t with float64(sum of mass over key <= t) > threshold, searched in (lo, hi] where lo
        # fails and hi holds.
        for _ in tl.static_range(32):
            mid = lo + (hi - lo) // 2
            holds = tl.sum(tl.where(key <= mid, mass, 0), axis=0).to(tl.float64) > threshold
            hi = tl.where(holds, mid, hi)
            lo = tl.where(holds, lo, mid)
        return hi

    @triton.jit
    def _value_at_key(values, key, valid, at):
        # The value whose key is `at` (the smallest value keyed at or above it).
        return tl.min(tl.where(valid & (key >= at), values, float("inf")), axis=0)

    # The codebook's value is not specialised: Triton makes a 1 a compile-time constant (another kernel variant,
    # and no tensor methods on it).
    @triton.jit(do_not_specialize=["codebook_value"])
    def _draw_kernel(logits_ptr, do_ptr, temp_ptr, topk_ptr, topp_ptr, seed_ptr, frame_ptr, codebook_ptr,
                     codebook_value, out_ptr, stride_row, V, FIXED_CODEBOOK: tl.constexpr, BLOCK_V: tl.constexpr,
                     EXACT: tl.constexpr, MASS_SCALE: tl.constexpr, RADIX: tl.constexpr = False,
                     PDL: tl.constexpr = False):
        pdl.wait(PDL)  # the logits and the knobs come from the kernels before
        pdl.release(PDL)
        row = tl.program_id(0)
        v = tl.arange(0, BLOCK_V)
        valid = v < V
        x = tl.load(logits_ptr + row * stride_row + v, mask=valid, other=float("-inf")).to(tl.float32)
        token = tl.argmax(x, 0, tie_break_left=True).to(tl.int64)
        temp = tl.load(temp_ptr + row)
        if (tl.load(do_ptr + row) != 0) & (temp > 0):
            scaled = tl.where(valid, x / temp, float("-inf"))
            key = _order_key(scaled)
            # TopK: the k-th largest value (ties counted, as in a descending sort); top_k <= 0 is off (k = V).
            top_k = tl.load(topk_ptr + row)
            k = tl.where(top_k <= 0, V, tl.minimum(top_k, V))
            kth = tl.min(tl.where(valid, scaled, float("inf")), axis=0)
            if RADIX:  # the radix select needs no bounds: they are found for top-p's search alone
                if k < V:
                    kth = _value_of_key(_kth_largest_key_radix(key, valid, k))
            else:
                lowest, highest = _key_bounds(key, valid)
                if k < V:
                    kth = _value_at_key(scaled, key, valid, _kth_largest_key(key, valid, k, lowest, highest))
            cut = kth
            top_p = tl.load(topp_ptr + row)
            if top_p < 1.0:
                if RADIX:
                    lowest, highest = _key_bounds(key, valid)
                # TopP over the top-k survivors, as a descending walk would do it: integer masses, exact in any
                # order. Walking down, an id is dropped once the mass from it to the end is <= (1 - top_p) of
                # the total (the first never), so the last kept value is the smallest t whose mass at or below
                # it exceeds that: one search over values instead of a sort.
                top = tl.max(scaled, axis=0)
                kept = valid & (scaled >= kth)
                mass = tl.where(kept, (_exp(scaled - top, EXACT) * MASS_SCALE).to(tl.int64), 0)
                total = tl.sum(mass, axis=0)
                threshold = (1.0 - top_p.to(tl.float64)) * total.to(tl.float64)
                if total.to(tl.float64) > threshold:
                    last = _value_at_key(scaled, key, valid, _top_p_key(key, mass, threshold, lowest - 1, highest))
                    cut = tl.maximum(kth, last)
                else:
                    cut = top
            warped = tl.where(scaled < cut, float("-inf"), scaled)
            seed = tl.load(seed_ptr + row)
            k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
            k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
            c1 = (tl.load(frame_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
            if FIXED_CODEBOOK:
                c2 = (codebook_value.to(tl.int64) & 0xFFFFFFFF).to(tl.uint32)
            else:
                c2 = (tl.load(codebook_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
            bits = _philox_word(v, c1, c2, k0, k1)
            u = ((bits.to(tl.float64) + 0.5) * 2.3283064365386963e-10).to(tl.float32)  # * 2**-32
            u = tl.minimum(u, 0.99999994)  # the largest float32 below 1
            race = warped - _neg_log_log1p_neg(u, EXACT)
            token = tl.argmax(tl.where(valid, race, float("-inf")), 0, tie_break_left=True).to(tl.int64)
        tl.store(out_ptr + row, token)

