"""Shared helpers of the codec-decoder tests: well-conditioned random values for every parameter."""

from __future__ import annotations

from legato.models.qwen3_tts.testing import MATRIX_GAIN, randomize_codec_decoder_

randomize_codec_weights_ = randomize_codec_decoder_

__all__ = ["MATRIX_GAIN", "randomize_codec_weights_"]
