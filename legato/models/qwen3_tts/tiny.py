"""Tiny configurations of the Qwen3-TTS family for tests and the embedded default model.

They keep every id and layout fact of the released models (token ids, 16 codebooks of 2048 codes, 1920
samples per frame, 72-frame decoder window) and shrink only the widths and depths.
"""

from __future__ import annotations

from .config import (
    CUSTOM_VOICE_DIALECTS,
    DIALECT_LANGUAGE_IDS,
    LANGUAGE_IDS,
    CodecDecoderConfig,
    CodecEncoderConfig,
    CodePredictorConfig,
    Qwen3TTSConfig,
    SpeakerEncoderConfig,
    SpeechTokenizerConfig,
    TalkerConfig,
)

TINY_SPEAKERS = {"serena": 3066, "ryan": 3061, "eric": 2875, "dylan": 2878}


def tiny_config(model_type: str = "base", size: str = "0b6") -> Qwen3TTSConfig:
    """A talker of 2 layers at width 64 and a code predictor of 2 layers at width 48 (so the
    small-to-MTP projection is a real Linear, as in the 1.7B models)."""
    languages = dict(LANGUAGE_IDS)
    speakers: dict[str, int] = {}
    dialects: dict[str, str] = {}
    if model_type == "custom_voice":
        languages.update(DIALECT_LANGUAGE_IDS)
        speakers = dict(TINY_SPEAKERS)
        dialects = {k: v for k, v in CUSTOM_VOICE_DIALECTS.items() if k in speakers}
    talker = TalkerConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        text_hidden_size=32,
        rope_scaling={"interleaved": True, "mrope_section": [2, 3, 3], "rope_type": "default"},
        codec_language_id=languages,
        spk_id=speakers,
        spk_is_dialect=dialects,
        code_predictor_config=CodePredictorConfig(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
        ),
    )
    speaker = SpeakerEncoderConfig(
        enc_dim=64,
        enc_channels=[32, 32, 32, 32, 96],
        enc_attention_channels=16,
        enc_res2net_scale=4,
        enc_se_channels=16,
    )
    return Qwen3TTSConfig(
        talker_config=talker,
        speaker_encoder_config=speaker,
        tts_model_size=size,
        tts_model_type=model_type,
    )


def tiny_speech_tokenizer_config() -> SpeechTokenizerConfig:
    decoder = CodecDecoderConfig(
        codebook_dim=64,
        hidden_size=32,
        latent_dim=64,
        decoder_dim=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    encoder = CodecEncoderConfig(
        hidden_size=64,
        num_filters=8,
        codebook_dim=32,
        vector_quantization_hidden_dimension=32,
        upsample_groups=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
    )
    return SpeechTokenizerConfig(encoder_config=encoder, decoder_config=decoder)
