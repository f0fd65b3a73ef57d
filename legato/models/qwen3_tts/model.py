"""Top-level containers whose state-dict keys are exactly those of the released checkpoint files:
`model.safetensors` (talker.*, speaker_encoder.*) and `speech_tokenizer/model.safetensors` (encoder.*, decoder.*).
"""

from __future__ import annotations

from torch import nn

from .codec_decoder import CodecDecoder
from .codec_encoder import CodecEncoder
from .config import Qwen3TTSConfig, SpeechTokenizerConfig
from .speaker_encoder import SpeakerEncoder
from .talker import Talker


class Qwen3TTSModel(nn.Module):
    """Talker (with its code predictor) and, for Base models, the speaker encoder."""

    def __init__(self, config: Qwen3TTSConfig) -> None:
        super().__init__()
        self.config = config
        self.talker = Talker(config.talker_config)
        self.speaker_encoder = SpeakerEncoder(config.speaker_encoder_config) if config.has_speaker_encoder else None


class SpeechTokenizer(nn.Module):
    """The 12 Hz codec: the encoder turns reference audio into codes, the decoder codes into audio."""

    def __init__(self, config: SpeechTokenizerConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = CodecEncoder(config.encoder_config, config.encoder_valid_num_quantizers)
        self.decoder = CodecDecoder(config.decoder_config)
