"""`sampler.draw` as one Triton program per row: argmax, temperature, top-k, top-p and the exponential race.

A frame draws 16 tokens one after another (codebook 0, then the code predictor's 15). Compiled by
`torch.compile`, each draw was still ~38 us of device time at batch 1 on the H200: a radix sort of the row
(~22 us) and five more kernels. Here a row's logits stay in one program's registers, Philox runs in the
kernel, and one argmax draws. Nothing is sorted (an in-register bitonic sort of 2,048 values took ~42 us a draw on
the H200). The top-k value is found by a search over the values' bit patterns, each pass one block-wide sum: the
program's critical path is its chain of reductions, so the kernel spends as few as it can.
- Top-k (`PACKED_SEARCH`): each pass counts the keys at or above four thresholds at once, the four counts packed
  in 16-bit fields of one int64 sum, so a pass cuts the interval in five; it stops as soon as a threshold has
  exactly k keys at or above it (the k-th largest is then the least of them). At most 14 passes, not the 32
  halvings of a plain bisection (`PACKED_SEARCH = False`, the path before). A radix select (four 256-bin
  histograms) was measured slower than the bisection and removed (docs/benchmarks.md, 2026-12-07).
- Top-p, only when a row's top_p < 1: 32 halvings over the integer masses (their sums do not pack).
- The greedy argmax, the row's minimum and its key bounds are reduced only on the rows that need them.
- What is left of a sampled draw is mostly per-id math over the whole row (Philox, log1p, log), spread over 8 warps
  from 2,048 ids. `PHILOX_PER_BLOCK` computes each Philox block once for its four words instead of once per id; it
  is off: on an H100 it was no faster.

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
# Top-k's threshold by passes of four packed counts with an early stop, instead of 32 halvings (module docstring).
PACKED_SEARCH = True
_MASS_SCALE = 2.0**36  # sampler._MASS_BITS
# A packed count is a 16-bit field and the top field must leave the int64's sign alone.
_PACKED_MAX_VOCAB = 2**15 - 1
# Philox once per counter block (four words), the words then laid out in vocabulary order, instead of once per id
# with three of each block's four words thrown away: the same words (the interpreter's checks, tests/
# draw_kernel_checks.py, and on an H100 its CUDA checks). Off: on an H100 it timed 9.33 us a batch-1 draw of 2,048 ids
# against 9.12 without (docs/benchmarks.md, session of 2026-12-07 (3)).
PHILOX_PER_BLOCK = False
# Warps a row's program runs; None: 4 below a 2,048-wide block, else 8. 8 warps took the 0.6B's batch-1 frame from
# 3.517 to 3.446 ms on an H100 (the code predictor's 2,048-id draws; codes equal), the same session.
WARPS: int | None = None


def available(logits: torch.Tensor) -> bool:
    return ENABLED and triton is not None and logits.is_cuda


def fused_draw(logits: torch.Tensor, do_sample: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, seed: torch.Tensor, frame: torch.Tensor, codebook: torch.Tensor | int,
               exact_math: bool | None = None, packed: bool | None = None, per_block: bool | None = None,
               warps: int | None = None) -> torch.Tensor:
    """Tokens int64 [B] from logits [B, V] (see `sampler.draw`; float32, or the head's bf16/fp16, widened to
    float32 as they load, exactly as `.float()` would; the head's knobs as [B] tensors,
    codebook an int64 [B] tensor or one int for every row: no tensor to fill before each draw).
    `exact_math`: libdevice functions (default on CUDA). `packed`: top-k by the packed search (default
    `PACKED_SEARCH`; vocabularies of 2**15 and more always take the plain bisection). `per_block`: Philox once per
    four words (default `PHILOX_PER_BLOCK`). `warps`: the program's warps (default `WARPS`)."""
    b, vocab = logits.shape
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16) or logits.stride(-1) != 1:
        raise ValueError("fused_draw needs unit-stride float32, bfloat16 or float16 logits")
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    block = triton.next_power_of_2(vocab)
    fixed = isinstance(codebook, int)
    on = pdl.launch(logits)
    _draw_kernel[(b,)](
        logits, do_sample, temperature, top_k, top_p, seed, frame, out if fixed else codebook,
        codebook if fixed else 0, out, logits.stride(0), vocab, FIXED_CODEBOOK=fixed, BLOCK_V=block,
        EXACT=logits.is_cuda if exact_math is None else exact_math, MASS_SCALE=_MASS_SCALE,
        PACKED=(PACKED_SEARCH if packed is None else packed) and vocab <= _PACKED_MAX_VOCAB,
        PER_BLOCK=PHILOX_PER_BLOCK if per_block is None else per_block, PDL=on,
        num_warps=warps or WARPS or (8 if block >= 2048 else 4), **pdl.launch_options(on),
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
        x0, x1, x2, x3 = _philox_block(v // 4, c1, c2, k0, k1)
        w = v % 4
        return tl.where(w == 0, x0, tl.where(w == 1, x1, tl.where(w == 2, x2, x3)))

    @triton.jit
    def _philox_words(BLOCK_V: tl.constexpr, c1, c2, k0, k1):
        # Words 0 .. BLOCK_V - 1 of rng.random_bits: one Philox-4x32-10 per counter block, its four words then put
        # in order. join stacks on a new last axis, so (x0, x2) joined with (x1, x3) flattens to x0 x1 x2 x3.
        x0, x1, x2, x3 = _philox_block(tl.arange(0, BLOCK_V // 4), c1, c2, k0, k1)
        return tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), [BLOCK_V])

    @triton.jit
    def _philox_block(block, c1, c2, k0, k1):
        # Philox-4x32-10 at counter (block, c1, c2, 0) under key (k0, k1): its four words.
        mul0 = tl.full([], 0xD2511F53, tl.uint32)
        mul1 = tl.full([], 0xCD9E8D57, tl.uint32)
        bump0 = tl.full([], 0x9E3779B9, tl.uint32)
        bump1 = tl.full([], 0xBB67AE85, tl.uint32)
        x0 = block.to(tl.uint32)
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
        return x0, x1, x2, x3

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
    def _kth_largest_at(key, valid, k):
        # A threshold t whose keys at or above it are the k largest, ties counted (k < the valid count): the least
        # value keyed at or above t is then the k-th largest. Invariant: count(lo) >= k > count(hi), count(t) the
        # valid keys >= t. Each pass counts at four thresholds inside (lo, hi) in one sum (16-bit fields: counts
        # stay below 2**15) and keeps the fifth of the interval that holds the answer; it stops at a threshold
        # counting exactly k, or when hi = lo + 1 (lo is then the k-th largest key itself).
        lo = tl.full([], -2147483648, tl.int64)  # every key is >= it
        hi = tl.full([], 2147483648, tl.int64)  # no key is
        at = lo
        searching = lo < hi  # a tensor from the start: a loop-carried value keeps its type
        while searching:
            span = hi - lo
            t1 = lo + span // 5
            t2 = lo + span * 2 // 5
            t3 = lo + span * 3 // 5
            t4 = lo + span * 4 // 5
            above = (tl.where(key >= t1, 1, 0).to(tl.int64) + tl.where(key >= t2, 1 << 16, 0).to(tl.int64)
                     + tl.where(key >= t3, 1 << 32, 0).to(tl.int64) + tl.where(key >= t4, 1 << 48, 0).to(tl.int64))
            counts = tl.sum(tl.where(valid, above, 0), axis=0)
            n1 = counts & 0xFFFF
            n2 = (counts >> 16) & 0xFFFF
            n3 = (counts >> 32) & 0xFFFF
            n4 = (counts >> 48) & 0xFFFF
            # the counts fall as t rises: the thresholds with enough keys are a prefix of t1..t4
            lo = tl.where(n4 >= k, t4, tl.where(n3 >= k, t3, tl.where(n2 >= k, t2, tl.where(n1 >= k, t1, lo))))
            hi = tl.where(n1 < k, t1, tl.where(n2 < k, t2, tl.where(n3 < k, t3, tl.where(n4 < k, t4, hi))))
            exact = (n1 == k) | (n2 == k) | (n3 == k) | (n4 == k)
            at = tl.where(exact, tl.where(n1 == k, t1, tl.where(n2 == k, t2, tl.where(n3 == k, t3, t4))), lo)
            searching = (~exact) & (hi - lo > 1)
        return at

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
                     EXACT: tl.constexpr, MASS_SCALE: tl.constexpr, PACKED: tl.constexpr = True,
                     PER_BLOCK: tl.constexpr = False, PDL: tl.constexpr = False):
        pdl.wait(PDL)  # the logits and the knobs come from the kernels before
        pdl.release(PDL)
        row = tl.program_id(0)
        v = tl.arange(0, BLOCK_V)
        valid = v < V
        x = tl.load(logits_ptr + row * stride_row + v, mask=valid, other=float("-inf")).to(tl.float32)
        temp = tl.load(temp_ptr + row)
        if (tl.load(do_ptr + row) != 0) & (temp > 0):
            scaled = tl.where(valid, x / temp, float("-inf"))
            key = _order_key(scaled)
            # TopK: the k-th largest value (ties counted, as in a descending sort); top_k <= 0 is off (k = V), and
            # so is k = V: nothing lies below the least value, as nothing lies below -inf.
            top_k = tl.load(topk_ptr + row)
            k = tl.where(top_k <= 0, V, tl.minimum(top_k, V))
            kth = tl.full([], float("-inf"), tl.float32)
            if k < V:
                if PACKED:
                    at = _kth_largest_at(key, valid, k)
                else:
                    lowest, highest = _key_bounds(key, valid)
                    at = _kth_largest_key(key, valid, k, lowest, highest)
                kth = _value_at_key(scaled, key, valid, at)
            cut = kth
            top_p = tl.load(topp_ptr + row)
            if top_p < 1.0:
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
            if PER_BLOCK:
                bits = _philox_words(BLOCK_V, c1, c2, k0, k1)
            else:
                bits = _philox_word(v, c1, c2, k0, k1)
            u = ((bits.to(tl.float64) + 0.5) * 2.3283064365386963e-10).to(tl.float32)  # * 2**-32
            u = tl.minimum(u, 0.99999994)  # the largest float32 below 1
            race = warped - _neg_log_log1p_neg(u, EXACT)
            token = tl.argmax(tl.where(valid, race, float("-inf")), 0, tie_break_left=True).to(tl.int64)
        else:
            token = tl.argmax(x, 0, tie_break_left=True).to(tl.int64)
        tl.store(out_ptr + row, token)
