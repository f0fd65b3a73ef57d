"""The official `qwen-tts` package as a parity oracle (test-only).

`qwen_tts` imports `sox`, `onnxruntime` and `torchaudio` for its 25 Hz tokenizer, which the 12 Hz path
never uses; they are stubbed here, inside the test helper only, so the oracle imports on a CPU box
without a second torch build.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

_STUBS = ("sox", "onnxruntime", "torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi")


def _install_stubs() -> None:
    for name in _STUBS:
        if name in sys.modules:
            continue
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = mod
    sys.modules["torchaudio"].compliance = sys.modules["torchaudio.compliance"]
    sys.modules["torchaudio.compliance"].kaldi = sys.modules["torchaudio.compliance.kaldi"]


def qwen_tts():
    """Imports and returns the `qwen_tts` package (the `test` extra installs it)."""
    pytest.importorskip("transformers", reason="the parity oracle needs the test extra: pip install -e .[test]")
    import transformers  # noqa: F401  (must be imported before the stubs: it probes importlib specs)

    _install_stubs()
    return pytest.importorskip("qwen_tts", reason="the parity oracle needs the test extra: pip install -e .[test]")


def official_model(config_dict: dict):
    """`Qwen3TTSForConditionalGeneration` built from our config dict, eval mode, fp32, eager attention."""
    qwen_tts()
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    cfg = Qwen3TTSConfig(**config_dict)
    cfg._attn_implementation = "eager"
    cfg.talker_config._attn_implementation = "eager"
    cfg.talker_config.code_predictor_config._attn_implementation = "eager"
    return Qwen3TTSForConditionalGeneration(cfg).eval()


def official_speech_tokenizer(config_dict: dict):
    """`Qwen3TTSTokenizerV2Model` built from our speech-tokenizer config dict, eval mode, fp32."""
    qwen_tts()
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model

    cfg = Qwen3TTSTokenizerV2Config(**config_dict)
    return Qwen3TTSTokenizerV2Model(cfg).eval()
