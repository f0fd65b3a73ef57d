"""Counter-based random numbers for placement-invariant sampling.

Every random number the sampler uses is a pure function of (request seed, frame index, codebook index,
vocabulary index), so a seeded request draws the same tokens whatever batch, worker or topology runs it.

Generator: Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; the
generator behind cuRAND's and PyTorch's CUDA RNG). It was chosen because it is a published, statistically
vetted (BigCrush-clean) bijection of a 128-bit counter under a 64-bit key, with official known-answer vectors
to test against, and because one call yields four 32-bit words, which cuts the work by four.

Everything is written with int64 torch tensor ops (and, xor, shift, add, multiply by constants < 2**32) on
values kept below 2**49, so nothing overflows or depends on sign extension: the results are bit-identical on
CPU and CUDA, need no torch.Generator, never synchronise with the host, and can be captured in a CUDA graph.

Layout of one draw:
  key     = (seed & 0xFFFFFFFF, seed >> 32)            the 63-bit non-negative seed, low word first
  counter = (vocab // 4, frame, codebook, stream)       each word taken mod 2**32
  bits[vocab] = philox(counter, key)[vocab % 4]
so the value for a vocabulary index never depends on how many values were asked for.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_MUL0, _MUL1 = 0xD2511F53, 0xCD9E8D57  # Philox-4x32 round multipliers
_BUMP0, _BUMP1 = 0x9E3779B9, 0xBB67AE85  # Weyl key-schedule increments (golden ratio, sqrt(3) - 1)
_ROUNDS = 10
# Largest float32 below 1; uniforms that round up to 1.0 are clamped here to keep the interval open.
_BELOW_ONE = 1.0 - 2.0**-24

Word = torch.Tensor | int  # a 32-bit value held in int64, or a Python int that broadcasts like one


def _mulhilo(a: Word, m: int) -> tuple[Word, Word]:
    """High and low 32-bit words of the 64-bit product a * m, for 0 <= a, m < 2**32.

    The product can reach 2**64, past int64, so `a` is split into 16-bit halves: every partial product
    stays below 2**49."""
    low = (a & 0xFFFF) * m
    mid = (a >> 16) * m + (low >> 16)
    return mid >> 16, ((mid & 0xFFFF) << 16) | (low & 0xFFFF)


def philox4x32_10(
    c0: Word, c1: Word, c2: Word, c3: Word, k0: Word, k1: Word
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox-4x32 with 10 rounds on broadcastable counter words (c0..c3) and key words (k0, k1).

    Inputs are 32-bit values in int64 tensors (or Python ints); outputs are int64 tensors in [0, 2**32).
    At least one input must be a tensor."""
    for r in range(_ROUNDS):
        if r:  # the key is bumped before every round but the first
            k0 = (k0 + _BUMP0) & MASK32
            k1 = (k1 + _BUMP1) & MASK32
        hi0, lo0 = _mulhilo(c0, _MUL0)
        hi1, lo1 = _mulhilo(c2, _MUL1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3  # type: ignore[return-value]


def random_bits(
    seed: torch.Tensor, frame: torch.Tensor, codebook: int | torch.Tensor, n: int, stream: int = 0
) -> torch.Tensor:
    """Uniform 32-bit words, int64 [B, n], for rows keyed by seed [B] and counted by frame [B], codebook.

    `seed` holds 63-bit non-negative ints; `frame` and `codebook` (an int or an int64 [B] tensor) are
    taken mod 2**32; `stream` separates independent uses of the same (seed, frame, codebook)."""
    blocks = torch.arange((n + 3) // 4, device=seed.device, dtype=torch.int64)[None, :]
    k0 = (seed & MASK32)[:, None]
    k1 = ((seed >> 32) & MASK32)[:, None]
    c1 = (frame & MASK32)[:, None]
    c2 = codebook & MASK32 if isinstance(codebook, int) else (codebook & MASK32)[:, None]
    words = philox4x32_10(blocks, c1, c2, stream & MASK32, k0, k1)
    # Round-one outputs that depend only on the row or only on the block broadcast to [B, blocks] here.
    out = torch.stack(torch.broadcast_tensors(*words), dim=-1)
    return out.reshape(seed.shape[0], -1)[:, :n]


def uniform(seed: torch.Tensor, frame: torch.Tensor, codebook: int | torch.Tensor, n: int) -> torch.Tensor:
    """float32 [B, n] uniforms in the open interval (0, 1); see `random_bits` for the arguments.

    u = (bits + 0.5) / 2**32, computed exactly in float64 and rounded once to float32, so resolution is full
    32-bit near 0 (where the exponential race needs it, see `exponential`) and the smallest value is 2**-33.
    The few values that round up to 1.0 are clamped to the largest float32 below 1."""
    bits = random_bits(seed, frame, codebook, n)
    u = ((bits.to(torch.float64) + 0.5) * 2.0**-32).to(torch.float32)
    return u.clamp_(max=_BELOW_ONE)


def exponential(seed: torch.Tensor, frame: torch.Tensor, codebook: int | torch.Tensor, n: int) -> torch.Tensor:
    """float32 [B, n] standard exponential variates, strictly positive and finite.

    E = -log1p(-u): small E, which decide the winner of an exponential race, come from small u and keep
    full precision; the upper tail is cut at about 16.6 (u clamped below 1), an effect below 1e-7."""
    return torch.log1p(-uniform(seed, frame, codebook, n)).neg_()
