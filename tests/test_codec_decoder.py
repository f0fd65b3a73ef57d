"""Parity of our codec decoder with the official `Qwen3TTSTokenizerV2Model` decoder (fp32, CPU)."""

from __future__ import annotations

import oracle
import pytest
import torch
from codec_helpers import randomize_codec_weights_

from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.models.qwen3_tts.config import CodecDecoderConfig, SpeechTokenizerConfig
from legato.models.qwen3_tts.tiny import tiny_speech_tokenizer_config

# Same weights and the same op order on both sides give ~0 difference on CPU; 1e-5 still catches e.g. a
# 73-frame attention window (2e-4 at 80 frames).
TOL = 1e-5
FULL_SIZE_TOL = 1e-4


def _decoder_state(official) -> dict[str, torch.Tensor]:
    return {k.removeprefix("decoder."): v for k, v in official.state_dict().items() if k.startswith("decoder.")}


@pytest.fixture(scope="module")
def pair():
    """(official tokenizer, our decoder) holding the same random weights, every parameter perturbed."""
    torch.manual_seed(0)
    cfg = tiny_speech_tokenizer_config()
    official = oracle.official_speech_tokenizer(cfg.to_dict())
    randomize_codec_weights_(official.decoder, seed=1)
    ours = CodecDecoder(cfg.decoder_config).eval()
    ours.load_state_dict(_decoder_state(official), strict=True)
    return official, ours


def _codes(batch: int, frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (batch, frames, 16), generator=torch.Generator().manual_seed(seed))


def _official_decode(official, codes: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return official.decode(codes).audio_values


def test_state_dict_keys_and_shapes_match_official(pair):
    official, ours = pair
    theirs = {k: tuple(v.shape) for k, v in _decoder_state(official).items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs
    assert ours.samples_per_frame == 1920


@pytest.mark.parametrize(("batch", "frames"), [(1, 1), (2, 7), (2, 80), (1, 300)])
def test_decode_matches_official(pair, batch, frames):
    official, ours = pair
    codes = _codes(batch, frames, seed=frames)
    want = _official_decode(official, codes)
    got = ours.decode(codes)
    assert len(got) == batch
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape == (frames * 1920,)
        assert w.std() > 0.01  # a real signal, not a constant or silence
        assert (g - w).abs().max().item() < TOL
    # Within one 300-frame window `decode` is the plain whole-sequence forward; both take [B, T, 16].
    with torch.no_grad():
        wav = ours(codes)
    assert wav.shape == (batch, 1, frames * 1920)
    assert torch.equal(wav[:, 0], torch.stack(got))


def test_decode_padding_and_lengths_match_official(pair):
    official, ours = pair
    codes = _codes(3, 20, seed=5)
    codes[0, :, 0] = 0  # code 0 in codebook 0 is a real frame (0.1.1 counts `> -1`)
    codes[1, 12:] = -1
    codes[2, 3:] = -1
    want = _official_decode(official, codes)
    got = ours.decode(codes)
    assert [g.shape[0] for g in got] == [w.shape[0] for w in want] == [20 * 1920, 12 * 1920, 3 * 1920]
    for w, g in zip(want, got, strict=True):
        assert (g - w).abs().max().item() < TOL


def test_decode_beyond_one_window_follows_official_chunking(pair):
    """Past 300 frames the reference decodes 300-frame windows with 25 frames of left context."""
    official, ours = pair
    codes = _codes(1, 310, seed=7)
    want = _official_decode(official, codes)[0]
    got = ours.decode(codes)[0]
    assert got.shape == want.shape == (310 * 1920,)
    assert (got - want).abs().max().item() < TOL
    # ... which differs from one whole-sequence window (the attention window and convs see further back).
    with torch.no_grad():
        whole = ours(codes)[0, 0]
    assert (whole[300 * 1920 :] - got[300 * 1920 :]).abs().max().item() > 1e-3


@pytest.mark.slow
def test_full_size_decoder_matches_official():
    """The released decoder config (114M parameters), random weights, 2 frames."""
    oracle.qwen_tts()
    from qwen_tts.core import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Decoder

    cfg = CodecDecoderConfig()
    official_cfg = Qwen3TTSTokenizerV2Config(**SpeechTokenizerConfig(decoder_config=cfg).to_dict()).decoder_config
    official = Qwen3TTSTokenizerV2Decoder._from_config(official_cfg).eval()
    ours = randomize_codec_weights_(CodecDecoder(cfg).eval(), seed=2)
    official.load_state_dict(ours.state_dict(), strict=True)
    codes = torch.randint(0, 2048, (1, 2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = official(codes.transpose(1, 2))  # the official module's forward takes [B, 16, T]
        got = ours(codes)
    assert got.shape == want.shape == (1, 1, 2 * 1920)
    assert want.std() > 0.01
    assert (got - want).abs().max().item() < FULL_SIZE_TOL
