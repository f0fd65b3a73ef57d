"""Tile sizes of the codec's conv GEMM kernel (`causal_conv.py`): a table measured on the H200, and a fitting
rule for the shapes it does not cover (tiny test configs, other checkpoints)."""

from __future__ import annotations


def pow2_at_least(n: int, lo: int = 16) -> int:
    """The smallest power of two >= n, and >= lo (Triton's block dimensions)."""
    return max(lo, 1 << (max(1, n) - 1).bit_length())


# Tile configs (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, BLOCK_N2]) measured per conv of the full-size decoder in
# bf16 on an H200 (benchmarks/codec_tune.py; docs/benchmarks.md): rows are (taps > 1, lowest Cout, highest Cout,
# fewest rows m) -> config, the first match wins. Shapes they do not cover use `_fitted_blocks`. A sixth entry
# is a second column block: 64 + 32 columns cover the last block's 96 channels with none padded (0: none); a
# seventh the K parts (0: `conv_kernels.split_k` chooses).
Config = tuple[int, ...]
TUNED_CONFIGS: list[tuple[bool, int, int, int, Config]] = [
    (True, 65, 96, 0, (128, 64, 32, 4, 4, 32)),  # 96 channels (the last block, and the conv up into it)
    (True, 129, 256, 262144, (128, 256, 64, 8, 3)),
    (True, 129, 256, 0, (128, 64, 64, 4, 3)),  # 192 channels
    (True, 257, 512, 0, (256, 128, 64, 8, 3)),  # 384 channels
    (True, 513, 2048, 16384, (128, 256, 64, 8, 3)),  # 768-1536 channels
    (True, 513, 2048, 0, (128, 128, 64, 8, 4)),
    (False, 65, 96, 0, (128, 64, 32, 4, 4, 32)),  # the residual units' 1x1 convs
    (False, 129, 256, 0, (128, 64, 64, 4, 3)),
    (False, 257, 512, 0, (64, 128, 64, 4, 3)),
    (False, 513, 1024, 16384, (128, 256, 64, 8, 3)),
    (False, 513, 1024, 0, (128, 64, 64, 4, 3)),  # ConvNeXt's 4x projection back, one to a few frames per call
    (False, 2048, 8192, 2048, (128, 256, 64, 8, 3)),  # ConvNeXt's 4x expansion
    (False, 2048, 8192, 0, (128, 128, 64, 8, 4)),
]


def conv_blocks(m: int, cin: int, cout: int, taps: int = 1, phases: int = 1) -> Config:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, BLOCK_N2[, SPLIT]]) for a conv GEMM of m rows,
    cin -> cout."""
    if cin % 32 == 0:
        for wide, lo, hi, rows, config in TUNED_CONFIGS:
            if wide == (taps > 1) and lo <= cout <= hi and m >= rows:
                return config
    return _fitted_blocks(m, cin, cout, phases)


def _fitted_blocks(m: int, cin: int, cout: int, phases: int, programs: int = 132) -> tuple[int, int, int, int, int]:
    """The largest tiles that still give about `programs` (one per SM of an H100/H200) programs, down to 32 x 32."""
    block_n = min(pow2_at_least(cout), 128)
    block_k = 64 if cin % 64 == 0 else (32 if cin % 32 == 0 else min(pow2_at_least(cin), 64))
    block_m = 128 if m >= 4096 else 64

    def tiles() -> int:
        return -(-m // block_m) * -(-cout // block_n) * phases

    while tiles() < programs and block_n > 32:
        block_n //= 2
    while tiles() < programs and block_m > 32:
        block_m //= 2
    return block_m, block_n, block_k, 8 if block_m * block_n >= 128 * 128 else 4, 3
