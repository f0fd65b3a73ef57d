"""Codec encoder (Mimi path of the 12 Hz speech tokenizer): parity of codes and latents with the official
`Qwen3TTSTokenizerV2Model.encode`."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import dataclasses  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402

import oracle  # noqa: E402
import pytest  # noqa: E402
import soundfile as sf  # noqa: E402
import torch  # noqa: E402

from legato.layers.same_conv import valid_conv1d  # noqa: E402
from legato.models.qwen3_tts.codec_encoder import CodecEncoder  # noqa: E402
from legato.models.qwen3_tts.config import CodecEncoderConfig, SpeechTokenizerConfig  # noqa: E402
from legato.models.qwen3_tts.mimi_layers import CausalStridedConv  # noqa: E402
from legato.models.qwen3_tts.tiny import tiny_speech_tokenizer_config  # noqa: E402

PROMPT_WAV = Path(__file__).parent / "data" / "voice01.wav"  # from shared/data/prompts/en (synthetic voice)
SR = 24000
FRAME = 1920


def _official_latents(official, wav: torch.Tensor) -> torch.Tensor:
    """The official pre-quantisation latents of a [B, N] batch: the steps of `MimiModel._encode_frame`
    up to the downsample conv's output."""
    inner = official.encoder
    with torch.no_grad():
        h = inner.encoder(wav[:, None, :])
        h = inner.encoder_transformer(h.transpose(1, 2), return_dict=True).last_hidden_state.transpose(1, 2)
        return inner.downsample(h)


def _randomize_(official, wav: torch.Tensor, seed: int) -> None:
    """Make every encoder tensor matter: the default init leaves the codebooks at zero (all codes 0), the
    LayerNorms at identity and attention near-uniform. Codebooks are drawn at the scale of the projected
    latents they quantize, and a quarter of the usage counts are 0 so the 1e-5 floor is exercised."""
    gen = torch.Generator().manual_seed(seed)
    enc = official.encoder
    with torch.no_grad():
        for name, t in enc.named_parameters():
            if name.endswith("layernorm.weight"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
            elif name.endswith("layernorm.bias") or name.endswith("layer_scale.scale"):
                t.copy_(0.2 * torch.randn(t.shape, generator=gen))
            elif "encoder_transformer" in name and t.dim() == 2:
                t.copy_(torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[1]))
        latents = _official_latents(official, wav[None])
        for rvq in (enc.quantizer.semantic_residual_vector_quantizer, enc.quantizer.acoustic_residual_vector_quantizer):
            projected = rvq.input_proj(latents).transpose(1, 2).flatten(0, 1)
            mean, std = projected.mean(0), projected.std(0)
            for i, layer in enumerate(rvq.layers):
                cb = layer.codebook
                size, dim = cb.embed_sum.shape
                # The first book spreads around the latents, the later ones around 0 at shrinking scale.
                centroids = torch.randn(size, dim, generator=gen) * std / (1 + i) + (mean if i == 0 else 0)
                usage = 0.5 + 2 * torch.rand(size, generator=gen)
                usage[torch.rand(size, generator=gen) < 0.25] = 0.0
                cb.cluster_usage.copy_(usage)
                cb.embed_sum.copy_(centroids * usage.clamp(min=1e-5)[:, None])
                cb._embed = None  # Mimi caches the centroids on first use


def _build(cfg: SpeechTokenizerConfig, wav: torch.Tensor, seed: int = 0):
    torch.manual_seed(seed)
    official = oracle.official_speech_tokenizer(cfg.to_dict())
    _randomize_(official, wav, seed)
    ours = CodecEncoder(cfg.encoder_config, cfg.encoder_valid_num_quantizers).eval()
    ours.load_state_dict(official.encoder.state_dict(), strict=True)
    return official, ours


def _official_codes(official, wav: torch.Tensor) -> torch.Tensor:
    """[B, N] -> [B, T, 16] through `Qwen3TTSTokenizerV2Model.encode`, called as the official tokenizer does."""
    mask = torch.ones_like(wav, dtype=torch.long)
    with torch.inference_mode():
        out = official.encode(wav, mask, return_dict=True).audio_codes
    return torch.stack(list(out))


def _check_parity(official, ours: CodecEncoder, wav: torch.Tensor) -> torch.Tensor:
    """Asserts equal codes and latents within 1e-4 for a [B, N] batch; returns our codes."""
    expected = _official_codes(official, wav)
    codes = ours.encode(wav)
    frames = math.ceil(wav.shape[-1] / FRAME)
    assert codes.shape == (wav.shape[0], frames, 16) and codes.dtype == torch.int64
    assert expected.shape == codes.shape
    ref_latents = _official_latents(official, wav)
    with torch.no_grad():
        our_latents = ours.latents(wav)
    torch.testing.assert_close(our_latents, ref_latents, rtol=0, atol=1e-4)
    assert torch.equal(codes, expected)
    return codes


@pytest.fixture(scope="module")
def clip() -> torch.Tensor:
    data, sr = sf.read(PROMPT_WAV, dtype="float32", always_2d=False)
    assert sr == SR and data.ndim == 1
    return torch.from_numpy(data)


@pytest.fixture(scope="module")
def pair(clip):
    return _build(tiny_speech_tokenizer_config(), clip)


def test_state_dict_matches_official_keys_and_shapes(pair):
    official, ours = pair
    ref = official.encoder.state_dict()
    mine = ours.state_dict()
    assert sorted(mine) == sorted(ref)
    assert all(mine[k].shape == ref[k].shape and mine[k].dtype == ref[k].dtype for k in ref)
    buffers = {n for n, _ in ours.named_buffers() if n in mine}
    assert any(n.endswith("embed_sum") for n in buffers)  # codebooks are buffers, as in the checkpoint


def test_codes_match_official_on_real_clip(pair, clip):
    official, ours = pair
    assert clip.shape[0] % FRAME != 0  # the last frame covers zero padding
    codes = _check_parity(official, ours, clip[None])
    assert torch.equal(ours.encode(clip), codes[0])  # 1-D input gives the unbatched [T, 16]
    # Random codebooks that actually discriminate: many distinct codes in the semantic and an acoustic book.
    assert codes[0, :, 0].unique().numel() > 25 and codes[0, :, 15].unique().numel() > 25


@pytest.mark.parametrize("kernel,stride,dilation,length", [(7, 1, 1, 50), (3, 1, 3, 41), (8, 4, 1, 64), (10, 5, 1, 67),
                                                            (1, 1, 1, 9), (4, 2, 1, 4), (3, 2, 2, 30)])
def test_valid_conv1d_as_matrix_products_equals_conv1d(kernel, stride, dilation, length):
    """The codec encoder's CUDA path (a matrix product per tap, no plan per clip length) computes F.conv1d."""
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(2, 6, length, dtype=torch.float64, generator=gen)
    w = torch.randn(5, 6, kernel, dtype=torch.float64, generator=gen)
    b = torch.randn(5, dtype=torch.float64, generator=gen)
    want = torch.nn.functional.conv1d(x, w, b, stride, dilation=dilation)
    torch.testing.assert_close(valid_conv1d(x, w, b, stride, dilation), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(valid_conv1d(x, w, None, stride, dilation), want - b[:, None], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="shorter than the kernel"):
        valid_conv1d(x[:, :, : dilation * (kernel - 1)], w, b, stride, dilation)


def test_the_encoder_through_matrix_product_convs_gives_the_conv1d_latents_and_codes(pair, clip):
    """Every conv of the encoder forced onto the CUDA path's matrix products, on the CPU: the same latents (to fp32
    rounding) and codes as Conv1d; and the CPU default is Conv1d, the official op."""
    ours = pair[1]
    convs = [m for m in ours.modules() if isinstance(m, CausalStridedConv)]
    assert len(convs) >= 8 and all(m.gemm is None for m in convs)
    wav = clip[None, : 3 * FRAME + 123]
    with torch.no_grad():
        want, want_codes = ours.latents(wav), ours.encode(wav)
        try:
            for m in convs:
                m.gemm = True
            got, got_codes = ours.latents(wav), ours.encode(wav)
        finally:
            for m in convs:
                m.gemm = None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(got_codes, want_codes)


@pytest.mark.parametrize("num_samples", [FRAME * 3, FRAME * 5 + 7, 1000, SR + 1])
def test_codes_match_official_on_noise(pair, num_samples):
    official, ours = pair
    gen = torch.Generator().manual_seed(num_samples)
    wav = 0.3 * torch.randn(2, num_samples, generator=gen)
    _check_parity(official, ours, wav)


def test_attention_is_full_causal_not_sliding_window(clip):
    """Official eager/sdpa Mimi ignores `sliding_window`; a window of 8 frames over 100 frames would
    change the latents if it were applied."""
    cfg = tiny_speech_tokenizer_config()
    cfg.encoder_config = dataclasses.replace(cfg.encoder_config, sliding_window=8)
    official, ours = _build(cfg, clip, seed=1)
    assert official.encoder.config.sliding_window == 8
    _check_parity(official, ours, clip[None, : FRAME * 20 + 5])


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("LEGATO_SLOW_TESTS"),
    reason="full-size encoder parity takes ~17 s on a shared 2-core CPU (mostly building and randomising two "
    "39M-param models); set LEGATO_SLOW_TESTS=1 to run it",
)
def test_full_size_released_config_parity():
    """The released encoder config (39M params + 16.8M codebook entries) on 1 s of audio."""
    cfg = tiny_speech_tokenizer_config()
    cfg.encoder_config = CodecEncoderConfig()
    wav = 0.3 * torch.randn(SR, generator=torch.Generator().manual_seed(7))
    official, ours = _build(cfg, wav)
    _check_parity(official, ours, wav[None])


def test_rejects_bad_input(pair):
    _, ours = pair
    for bad in (
        torch.zeros(1, 1, 100),
        torch.zeros(0),
        torch.zeros(2, 0),
        torch.zeros(0, 100),
        torch.zeros(100).long(),
    ):
        with pytest.raises(ValueError):
            ours.encode(bad)


def test_rejects_bad_quantizer_count():
    with pytest.raises(ValueError):
        CodecEncoder(tiny_speech_tokenizer_config().encoder_config, valid_num_quantizers=33)
