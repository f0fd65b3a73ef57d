"""Shared helpers of the codec-decoder tests: well-conditioned random values for every parameter."""

from __future__ import annotations

import torch

from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.models.qwen3_tts.testing import MATRIX_GAIN, randomize_codec_decoder_
from legato.models.qwen3_tts.tiny import tiny_speech_tokenizer_config

randomize_codec_weights_ = randomize_codec_decoder_

__all__ = ["MATRIX_GAIN", "random_codes", "randomize_codec_weights_", "tiny_codec_decoder"]


def tiny_codec_decoder(seed: int) -> CodecDecoder:
    """The tiny config's codec decoder with every weight random (well-conditioned)."""
    return randomize_codec_weights_(CodecDecoder(tiny_speech_tokenizer_config().decoder_config).eval(), seed=seed)


def random_codes(batch: int, frames: int, seed: int) -> torch.Tensor:
    """Codes [batch, frames, 16] drawn from 2048 entries."""
    return torch.randint(0, 2048, (batch, frames, 16), generator=torch.Generator().manual_seed(seed))
