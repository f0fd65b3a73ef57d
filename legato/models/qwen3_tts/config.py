"""Configs of the Qwen3-TTS 12 Hz family, parsed from HF-format `config.json` files.

Field names are exactly the HF config keys, so a checkpoint's `config.json` maps onto these dataclasses
one to one and `to_dict()` writes a file the official package can read too. Defaults are the values of
the *released* 0.6B-Base checkpoint (not the upstream class defaults, which differ: see
shared/reference/qwen3-tts-model.md §1.7); `preset()` gives the other released variants.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

LANGUAGE_IDS = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
}
DIALECT_LANGUAGE_IDS = {"beijing_dialect": 2074, "sichuan_dialect": 2062}
CUSTOM_VOICE_SPEAKERS = {
    "serena": 3066,
    "vivian": 3065,
    "uncle_fu": 3010,
    "ryan": 3061,
    "aiden": 2861,
    "ono_anna": 2873,
    "sohee": 2864,
    "eric": 2875,
    "dylan": 2878,
}
CUSTOM_VOICE_DIALECTS = {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}

MODEL_TYPES = ("base", "custom_voice", "voice_design")
MODEL_SIZES = {"0.6B": "0b6", "1.7B": "1b7"}


class ConfigError(ValueError):
    """A config file is missing, unreadable or holds an invalid value."""


T = TypeVar("T")


def _from_dict(cls: type[T], data: dict[str, Any], where: str) -> T:
    """Builds dataclass `cls` from `data`, ignoring unknown keys (HF files carry many) once `_refuse_unsupported`
    has looked at them. A key the file leaves out takes the official config class's default where that differs
    from the released value (`_OFFICIAL_DEFAULTS`): a file means what the official loader reads in it."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object, got {type(data).__name__}")
    _refuse_unsupported(cls, data, where)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in data.items() if k in names}
    for k, v in _OFFICIAL_DEFAULTS.get(cls.__name__, {}).items():
        kwargs.setdefault(k, v)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from e


# The official config classes' defaults where the released models differ (shared/reference/qwen3-tts-model.md
# §1.7). Only keys that change what a file computes; a released config.json gives them all.
_OFFICIAL_DEFAULTS: dict[str, dict[str, Any]] = {
    "TalkerConfig": {"num_hidden_layers": 20, "intermediate_size": 2048, "num_key_value_heads": 2,
                     "rope_theta": 10000.0, "rope_scaling": None, "num_code_groups": 32},
    "CodePredictorConfig": {"rope_theta": 10000.0, "num_code_groups": 32},
}


def _refuse_unsupported(cls: type, data: dict[str, Any], where: str) -> None:
    """Config values the official model honours and these modules do not implement: refused by name, rather
    than dropped with the unknown keys and served as something else."""
    if cls.__name__ not in ("TalkerConfig", "CodePredictorConfig", "CodecDecoderConfig"):
        return
    scaling = data.get("rope_scaling")
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in (None, "default"):
            raise ConfigError(f"{where}: rope_scaling of type {kind!r} is not supported (only the default rotary "
                              "embedding, as in the released models)")
    elif scaling is not None:
        raise ConfigError(f"{where}: rope_scaling must be an object or null, got {type(scaling).__name__}")
    if cls.__name__ == "CodecDecoderConfig":
        return  # its window attention is its own (`sliding_window`), and supported
    if data.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window is not supported (the released models attend to the "
                          "whole context)")
    if data.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias is not supported (the released models have no attention "
                          "biases)")


def _to_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        out[f.name] = _to_dict(v) if dataclasses.is_dataclass(v) else v
    return out


@dataclass
class CodePredictorConfig:
    hidden_size: int = 1024
    num_hidden_layers: int = 5
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    vocab_size: int = 2048
    num_code_groups: int = 16
    max_position_embeddings: int = 65536
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    model_type: str = "qwen3_tts_talker_code_predictor"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("code_predictor_config: num_attention_heads must be a multiple of num_key_value_heads")


@dataclass
class TalkerConfig:
    hidden_size: int = 1024
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    vocab_size: int = 3072
    text_vocab_size: int = 151936
    text_hidden_size: int = 2048
    num_code_groups: int = 16
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = field(
        default_factory=lambda: {"interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}
    )
    attention_bias: bool = False
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    codec_eos_token_id: int = 2150
    codec_think_id: int = 2154
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    codec_language_id: dict = field(default_factory=lambda: dict(LANGUAGE_IDS))
    spk_id: dict = field(default_factory=dict)
    spk_is_dialect: dict = field(default_factory=dict)
    code_predictor_config: CodePredictorConfig = field(default_factory=CodePredictorConfig)
    model_type: str = "qwen3_tts_talker"

    def __post_init__(self) -> None:
        if isinstance(self.code_predictor_config, dict):
            self.code_predictor_config = _from_dict(
                CodePredictorConfig, self.code_predictor_config, "talker_config.code_predictor_config"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("talker_config: num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_code_groups != self.code_predictor_config.num_code_groups:
            raise ConfigError("talker_config and code_predictor_config disagree on num_code_groups")
        if self.spk_is_dialect is None or self.spk_is_dialect is False:
            self.spk_is_dialect = {}


@dataclass
class SpeakerEncoderConfig:
    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: list = field(default_factory=lambda: [512, 512, 512, 512, 1536])
    enc_kernel_sizes: list = field(default_factory=lambda: [5, 3, 3, 3, 1])
    enc_dilations: list = field(default_factory=lambda: [1, 2, 3, 4, 1])
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000


@dataclass
class Qwen3TTSConfig:
    """Top-level `config.json` of a Qwen3-TTS model directory."""

    talker_config: TalkerConfig = field(default_factory=TalkerConfig)
    speaker_encoder_config: SpeakerEncoderConfig = field(default_factory=SpeakerEncoderConfig)
    tokenizer_type: str = "qwen3_tts_tokenizer_12hz"
    tts_model_size: str = "0b6"
    tts_model_type: str = "base"
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673
    assistant_token_id: int = 77091
    architectures: list = field(default_factory=lambda: ["Qwen3TTSForConditionalGeneration"])
    model_type: str = "qwen3_tts"

    def __post_init__(self) -> None:
        if isinstance(self.talker_config, dict):
            self.talker_config = _from_dict(TalkerConfig, self.talker_config, "talker_config")
        if isinstance(self.speaker_encoder_config, dict):
            self.speaker_encoder_config = _from_dict(
                SpeakerEncoderConfig, self.speaker_encoder_config, "speaker_encoder_config"
            )
        if self.tts_model_type not in MODEL_TYPES:
            raise ConfigError(f"tts_model_type must be one of {MODEL_TYPES}, got {self.tts_model_type!r}")
        if self.tts_model_type == "base" and self.speaker_encoder_config.enc_dim != self.talker_config.hidden_size:
            raise ConfigError("speaker_encoder_config.enc_dim must equal talker_config.hidden_size")
        top_id = max(self.tts_pad_token_id, self.tts_bos_token_id, self.tts_eos_token_id, self.im_end_token_id)
        if top_id >= self.talker_config.text_vocab_size:
            raise ConfigError("talker_config.text_vocab_size must exceed every special text token id")

    @property
    def has_speaker_encoder(self) -> bool:
        return self.tts_model_type == "base"

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Qwen3TTSConfig:
        return _from_dict(cls, data, "config.json")


@dataclass
class CodecDecoderConfig:
    """`decoder_config` of `speech_tokenizer/config.json` (released values)."""

    codebook_size: int = 2048
    codebook_dim: int = 512
    hidden_size: int = 512
    latent_dim: int = 1024
    decoder_dim: int = 1536
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    attention_bias: bool = False
    sliding_window: int = 72
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    layer_scale_initial_scale: float = 0.01
    max_position_embeddings: int = 8000
    hidden_act: str = "silu"
    num_quantizers: int = 16
    num_semantic_quantizers: int = 1
    semantic_codebook_size: int = 4096
    vector_quantization_hidden_dimension: int = 512
    upsample_rates: list = field(default_factory=lambda: [8, 5, 4, 3])
    upsampling_ratios: list = field(default_factory=lambda: [2, 2])

    @property
    def samples_per_frame(self) -> int:
        n = 1
        for r in list(self.upsample_rates) + list(self.upsampling_ratios):
            n *= r
        return n


@dataclass
class CodecEncoderConfig:
    """`encoder_config` of `speech_tokenizer/config.json`: a Mimi encoder (transformers `MimiConfig` keys)."""

    sampling_rate: int = 24000
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: list = field(default_factory=lambda: [8, 6, 5, 4])
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    use_causal_conv: bool = True
    pad_mode: str = "constant"
    compress: int = 2
    trim_right_ratio: float = 1.0
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_quantizers: int = 32
    use_conv_shortcut: bool = False
    vector_quantization_hidden_dimension: int = 256
    upsample_groups: int = 512
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 64
    hidden_act: str = "gelu"
    max_position_embeddings: int = 8000
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int = 250
    layer_scale_initial_scale: float = 0.01
    attention_bias: bool = False
    num_semantic_quantizers: int = 1
    _frame_rate: float = 12.5
    model_type: str = "mimi"


@dataclass
class SpeechTokenizerConfig:
    """`speech_tokenizer/config.json`: the 12 Hz codec (Mimi-style encoder + Qwen3-TTS decoder)."""

    encoder_config: CodecEncoderConfig = field(default_factory=CodecEncoderConfig)
    decoder_config: CodecDecoderConfig = field(default_factory=CodecDecoderConfig)
    encoder_valid_num_quantizers: int = 16
    input_sample_rate: int = 24000
    output_sample_rate: int = 24000
    decode_upsample_rate: int = 1920
    encode_downsample_rate: int = 1920
    architectures: list = field(default_factory=lambda: ["Qwen3TTSTokenizerV2Model"])
    model_type: str = "qwen3_tts_tokenizer_12hz"

    def __post_init__(self) -> None:
        if isinstance(self.encoder_config, dict):
            self.encoder_config = _from_dict(CodecEncoderConfig, self.encoder_config, "encoder_config")
        if isinstance(self.decoder_config, dict):
            self.decoder_config = _from_dict(CodecDecoderConfig, self.decoder_config, "decoder_config")
        if self.decoder_config.samples_per_frame != self.decode_upsample_rate:
            raise ConfigError(
                f"decoder upsampling gives {self.decoder_config.samples_per_frame} samples per frame, "
                f"decode_upsample_rate says {self.decode_upsample_rate}"
            )

    @property
    def frame_rate(self) -> float:
        return self.output_sample_rate / self.decode_upsample_rate

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeechTokenizerConfig:
        return _from_dict(cls, data, "speech_tokenizer/config.json")


def read_json(path: Path) -> dict[str, Any]:
    """Reads a JSON config file; a missing or malformed file is a ConfigError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"missing config file: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e


def load_model_config(model_dir: Path) -> Qwen3TTSConfig:
    path = Path(model_dir) / "config.json"
    data = read_json(path)
    try:
        return Qwen3TTSConfig.from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e


def load_speech_tokenizer_config(model_dir: Path) -> SpeechTokenizerConfig:
    path = Path(model_dir) / "speech_tokenizer" / "config.json"
    data = read_json(path)
    try:
        return SpeechTokenizerConfig.from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e


def preset(size: str = "0.6B", model_type: str = "base") -> Qwen3TTSConfig:
    """The released configuration of a Qwen3-TTS 12 Hz variant (e.g. `preset("1.7B", "custom_voice")`)."""
    if size not in MODEL_SIZES:
        raise ConfigError(f"unknown model size {size!r}; expected one of {sorted(MODEL_SIZES)}")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"unknown model type {model_type!r}; expected one of {MODEL_TYPES}")
    big = size == "1.7B"
    hidden = 2048 if big else 1024
    languages = dict(LANGUAGE_IDS)
    speakers: dict[str, int] = {}
    dialects: dict[str, str] = {}
    if model_type == "custom_voice":
        languages.update(DIALECT_LANGUAGE_IDS)
        speakers = dict(CUSTOM_VOICE_SPEAKERS)
        dialects = dict(CUSTOM_VOICE_DIALECTS)
    talker = TalkerConfig(
        hidden_size=hidden,
        intermediate_size=6144 if big else 3072,
        codec_language_id=languages,
        spk_id=speakers,
        spk_is_dialect=dialects,
    )
    return Qwen3TTSConfig(
        talker_config=talker,
        speaker_encoder_config=SpeakerEncoderConfig(enc_dim=hidden),
        tts_model_size=MODEL_SIZES[size],
        tts_model_type=model_type,
    )
