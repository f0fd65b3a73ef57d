"""Counter-based RNG: Philox known answers, the documented counter layout, determinism, uniformity, independence."""

from __future__ import annotations

import math

import pytest
import torch

from legato.engine.rng import exponential, philox4x32_10, random_bits, uniform

# Random123's kat_vectors for philox4x32 with 10 rounds: counter[4], key[2] -> output[4].
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def scalar_philox(ctr: tuple[int, ...], key: tuple[int, ...]) -> tuple[int, ...]:
    """Plain big-int Philox-4x32-10, written independently of the tensor version (no 16-bit splitting)."""
    m = 0xFFFFFFFF
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & m, (p0 >> 32) ^ c3 ^ k1, p0 & m
    return c0, c1, c2, c3


def rows(batch: int, base_seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    seed = torch.arange(batch, dtype=torch.int64) * 1_000_003 + base_seed
    frame = torch.arange(batch, dtype=torch.int64) % 17
    return seed, frame


@pytest.mark.parametrize("ctr,key,expected", KNOWN_ANSWERS)
def test_philox_known_answers(ctr, key, expected):
    as_t = [torch.tensor([v], dtype=torch.int64) for v in ctr + key]
    got = tuple(int(w) for w in philox4x32_10(*as_t))
    assert got == expected
    assert scalar_philox(ctr, key) == expected


def test_bits_follow_documented_layout():
    seed = torch.tensor([0, 1, 2**32 + 5, 2**63 - 1, 123456789012345], dtype=torch.int64)
    frame = torch.tensor([0, 3, 2**32 - 1, 7, 100], dtype=torch.int64)
    codebook = torch.tensor([0, 15, 2, 9, 1], dtype=torch.int64)
    n = 10  # not a multiple of 4: the last block is cut
    bits = random_bits(seed, frame, codebook, n)
    assert bits.shape == (5, n) and bits.dtype == torch.int64
    for b in range(5):
        s, f, c = int(seed[b]), int(frame[b]), int(codebook[b])
        for v in range(n):
            want = scalar_philox((v // 4, f, c, 0), (s & 0xFFFFFFFF, s >> 32))[v % 4]
            assert int(bits[b, v]) == want


def test_deterministic_prefix_stable_and_placement_invariant():
    seed, frame = rows(12)
    codebook = torch.arange(12, dtype=torch.int64) % 16
    u = uniform(seed, frame, codebook, 3072)
    assert torch.equal(u, uniform(seed, frame, codebook, 3072))
    assert torch.equal(u[:, :2047], uniform(seed, frame, codebook, 2047))
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(uniform(seed[perm], frame[perm], codebook[perm], 3072), u[perm])
    # A single row alone gives the same numbers as inside the batch.
    assert torch.equal(uniform(seed[5:6], frame[5:6], codebook[5:6], 3072), u[5:6])


def test_int_codebook_equals_tensor_codebook():
    seed, frame = rows(4)
    assert torch.equal(uniform(seed, frame, 3, 100), uniform(seed, frame, torch.full((4,), 3), 100))


def test_open_interval_dtype_and_shape():
    seed, frame = rows(64)
    u = uniform(seed, frame, 0, 4096)
    assert u.dtype == torch.float32 and u.shape == (64, 4096)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0


def test_rough_uniformity():
    seed, frame = rows(64)
    u = uniform(seed, frame, 1, 4096).flatten().double()
    n = u.numel()
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(u.var()) - 1 / 12) < 5 * math.sqrt(1 / 180 / n)  # var of (u - 1/2)^2 is 1/180
    buckets = 128
    counts = torch.bincount((u * buckets).long(), minlength=buckets).double()
    chi2 = float(((counts - n / buckets) ** 2 / (n / buckets)).sum())
    dof = buckets - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof)
    # Kolmogorov-Smirnov distance against U(0, 1); 1.95 / sqrt(n) is the 0.1% critical value.
    srt = u.sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    d = float(torch.maximum((grid - srt).abs(), (srt - (grid - 1 / n)).abs()).max())
    assert d < 1.95 / math.sqrt(n)


def corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


def test_independence_across_seed_frame_codebook():
    seed, frame = rows(32)
    n = 2048
    frame = frame + 2  # never 1, so swapping frame and codebook 1 always changes the counter
    base = uniform(seed, frame, 1, n)
    variants = {
        "codebook": uniform(seed, frame, 2, n),
        "frame": uniform(seed, frame + 1, 1, n),
        "seed low bit": uniform(seed ^ 1, frame, 1, n),
        "seed high word": uniform(seed + (1 << 40), frame, 1, n),
        "frame/codebook swapped": uniform(seed, torch.ones_like(frame), frame, n),
    }
    bound = 5 / math.sqrt(base.numel())
    for name, other in variants.items():
        assert not torch.equal(other, base), name
        assert abs(corr(base, other)) < bound, name
    assert abs(corr(base[:, :-1], base[:, 1:])) < bound  # neighbouring vocabulary indices
    assert abs(corr(base[:-1], base[1:])) < bound  # neighbouring rows


def test_exponential_is_positive_finite_unit_mean():
    seed, frame = rows(32)
    e = exponential(seed, frame, 4, 2048).double()
    assert bool(torch.isfinite(e).all()) and float(e.min()) > 0
    assert abs(float(e.mean()) - 1.0) < 5 / math.sqrt(e.numel())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_and_cuda_bits_identical():
    seed = torch.randint(0, 2**62, (256,), dtype=torch.int64, generator=torch.Generator().manual_seed(3))
    frame = torch.randint(0, 5000, (256,), dtype=torch.int64, generator=torch.Generator().manual_seed(4))
    cpu = uniform(seed, frame, 7, 3072)
    gpu = uniform(seed.cuda(), frame.cuda(), 7, 3072).cpu()
    assert torch.equal(cpu, gpu)
