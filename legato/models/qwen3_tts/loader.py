"""Loading a Qwen3-TTS model directory (HF layout) or hub id into our modules.

Layout read: `config.json`, `model.safetensors` (or a sharded `model.safetensors.index.json`),
`generation_config.json` (optional), the text tokenizer files, and `speech_tokenizer/{config.json,
model.safetensors}`. Every missing or malformed file is a `ConfigError` that names the file.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from .config import (
    ConfigError,
    Qwen3TTSConfig,
    SpeechTokenizerConfig,
    load_model_config,
    load_speech_tokenizer_config,
    read_json,
)
from .model import Qwen3TTSModel, SpeechTokenizer
from .text_tokenizer import TextTokenizer

log = logging.getLogger(__name__)

# The released models' generation defaults (qwen_tts wrapper), used when generation_config.json is absent.
GENERATION_DEFAULTS: dict[str, Any] = {
    "do_sample": True,
    "temperature": 0.9,
    "top_k": 50,
    "top_p": 1.0,
    "repetition_penalty": 1.05,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_k": 50,
    "subtalker_top_p": 1.0,
    "max_new_tokens": 2048,
}


@dataclass
class LoadedModel:
    """Everything read from one model directory, on one device."""

    path: Path
    config: Qwen3TTSConfig
    speech_config: SpeechTokenizerConfig
    model: Qwen3TTSModel
    speech_tokenizer: SpeechTokenizer
    text_tokenizer: TextTokenizer
    generation_defaults: dict[str, Any] = field(default_factory=lambda: dict(GENERATION_DEFAULTS))

    @property
    def talker(self):
        return self.model.talker

    @property
    def sample_rate(self) -> int:
        return self.speech_config.output_sample_rate


def resolve_model_dir(model: str | Path) -> Path:
    """A local directory as is; otherwise a hub id, downloaded with `huggingface_hub` when it is installed
    and the network allows (never needed by tests or the embedded default)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():  # said first: a missing tokenizer or weight file would mislead
            raise ConfigError(f"{path} is not a Qwen3-TTS checkpoint directory: it has no config.json")
        return path
    text = str(model)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise ConfigError(f"model directory not found: {path}")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ConfigError(
            f"{text!r} is not a local directory; downloading a hub id needs `pip install huggingface_hub`"
        ) from e
    try:
        return Path(snapshot_download(text))
    except Exception as e:  # the hub client raises many types; all mean "could not fetch"
        raise ConfigError(f"cannot download {text!r} from the hub: {e}") from e


def read_safetensors(directory: Path, stem: str = "model") -> dict[str, torch.Tensor]:
    """Reads `stem.safetensors`, or every shard named in `stem.safetensors.index.json`."""
    single = directory / f"{stem}.safetensors"
    index = directory / f"{stem}.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index}: no weight_map")
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        raise ConfigError(f"missing weights file: {single}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise ConfigError(f"missing weights file: {f}")
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ConfigError(f"cannot read weights file {f}: {e}") from e
    return tensors


def load_into(module: nn.Module, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Strict load with errors that name the file and the first offending keys."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    if missing or unexpected:
        raise ConfigError(
            f"{source}: weights do not match the config "
            f"(missing {len(missing)}: {missing[:5]}, unexpected {len(unexpected)}: {unexpected[:5]})"
        )
    for k, t in tensors.items():
        if tuple(t.shape) != tuple(expected[k].shape):
            raise ConfigError(f"{source}: {k} has shape {tuple(t.shape)}, the config needs {tuple(expected[k].shape)}")
    module.load_state_dict(tensors, strict=True)


def load_generation_defaults(model_dir: Path) -> dict[str, Any]:
    out = dict(GENERATION_DEFAULTS)
    path = model_dir / "generation_config.json"
    if path.is_file():
        out.update({k: v for k, v in read_json(path).items() if k in GENERATION_DEFAULTS})
    return out


def load_model(
    model: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    codec_dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """Loads a Qwen3-TTS model directory (or hub id). The talker runs in `dtype`, the codec's encoder in
    `codec_dtype`; its decoder stays fp32, the source that the streaming decoder folds its serving copy from
    (in the engine's codec dtype)."""
    path = resolve_model_dir(model)
    config = load_model_config(path)
    speech_config = load_speech_tokenizer_config(path)
    text_tokenizer = TextTokenizer.from_dir(path)
    groups = config.talker_config.num_code_groups
    for name, count in (("decoder_config.num_quantizers", speech_config.decoder_config.num_quantizers),
                        ("encoder_valid_num_quantizers", speech_config.encoder_valid_num_quantizers)):
        if count != groups:
            raise ConfigError(f"{path}: the talker makes {groups} codebooks a frame (talker_config.num_code_groups) "
                              f"and the codec's {name} is {count}")

    # Built on the CPU with its throw-away init rather than on the meta device: derived, non-persistent
    # buffers (RoPE frequencies, STFT windows, filterbanks) are then right without a reset hook per module.
    tts = Qwen3TTSModel(config)
    codec = SpeechTokenizer(speech_config)
    load_into(tts, read_safetensors(path), path / "model.safetensors")
    load_into(codec, read_safetensors(path / "speech_tokenizer"), path / "speech_tokenizer" / "model.safetensors")
    tts = tts.to(device=device, dtype=dtype).eval()
    codec = codec.to(device=device, dtype=codec_dtype).eval()
    codec.decoder.float()
    log.info("loaded %s (%s, %s) on %s", path, config.tts_model_type, config.tts_model_size, device)
    return LoadedModel(
        path=path,
        config=config,
        speech_config=speech_config,
        model=tts,
        speech_tokenizer=codec,
        text_tokenizer=text_tokenizer,
        generation_defaults=load_generation_defaults(path),
    )


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
