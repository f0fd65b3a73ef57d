"""Config files the way the official loader reads them: what it honours and these modules do not implement is
refused by name (never dropped and served as something else), a key the file leaves out means the official
default, and codebook counts must agree (found by an oracle probe on checkpoints of other shapes)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import oracle  # noqa: E402
import test_engine_shapes_parity as shapes  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from legato.engine.config import EngineConfig  # noqa: E402
from legato.engine.engine import Engine  # noqa: E402
from legato.models.qwen3_tts.config import ConfigError, SpeechTokenizerConfig  # noqa: E402
from legato.models.qwen3_tts.loader import load_model  # noqa: E402
from legato.models.qwen3_tts.prompt import PromptSpec  # noqa: E402
from legato.models.qwen3_tts.testing import write_checkpoint  # noqa: E402
from legato.models.qwen3_tts.tiny import tiny_config, tiny_speech_tokenizer_config  # noqa: E402


def _edited(tmp_path, edit, speech_edit=None) -> Path:
    path = write_checkpoint(tmp_path / "ckpt", tiny_config("base"))
    data = json.loads((path / "config.json").read_text())
    edit(data)
    (path / "config.json").write_text(json.dumps(data))
    if speech_edit is not None:
        sp = path / "speech_tokenizer" / "config.json"
        sdata = json.loads(sp.read_text())
        speech_edit(sdata)
        sp.write_text(json.dumps(sdata))
    return path


def _talker(**kv):
    return lambda d: d["talker_config"].update(kv)


def _predictor(**kv):
    return lambda d: d["talker_config"]["code_predictor_config"].update(kv)


@pytest.mark.parametrize("edit, field", [
    (_talker(rope_scaling={"interleaved": True, "mrope_section": [2, 3, 3], "rope_type": "linear", "factor": 4.0}),
     "talker_config: rope_scaling of type 'linear'"),
    (_talker(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling of type 'dynamic'"),
    (_talker(use_sliding_window=True, sliding_window=4), "talker_config: use_sliding_window"),
    (_talker(attention_bias=True), "talker_config: attention_bias"),
    (_predictor(use_sliding_window=True, sliding_window=2, max_window_layers=0),
     "code_predictor_config: use_sliding_window"),
    (_predictor(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "code_predictor_config: rope_scaling"),
    (_predictor(attention_bias=True), "code_predictor_config: attention_bias"),
])
def test_what_the_modules_do_not_implement_is_refused_by_name(tmp_path, edit, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        load_model(_edited(tmp_path, edit))


def test_the_codec_decoders_rope_scaling_is_refused_and_its_own_window_is_not():
    data = tiny_speech_tokenizer_config().to_dict()
    data["decoder_config"]["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ConfigError, match="decoder_config: rope_scaling of type 'linear'"):
        SpeechTokenizerConfig.from_dict(data)
    data["decoder_config"]["rope_scaling"] = {"rope_type": "default"}
    data["decoder_config"]["sliding_window"] = 5
    assert SpeechTokenizerConfig.from_dict(data).decoder_config.sliding_window == 5


def test_settings_that_change_nothing_still_load(tmp_path):
    path = _edited(tmp_path, lambda d: (_talker(use_sliding_window=False, sliding_window=4096, attention_bias=False)(d),
                                        _predictor(rope_scaling=None)(d)))
    assert load_model(path).config.talker_config.rope_theta == tiny_config("base").talker_config.rope_theta


def test_a_file_without_rope_theta_means_the_official_default_and_gives_the_official_codes(tmp_path,
                                                                                            one_torch_thread):
    def drop(d):
        del d["talker_config"]["rope_theta"], d["talker_config"]["code_predictor_config"]["rope_theta"]

    path = _edited(tmp_path, drop)
    data = json.loads((path / "config.json").read_text())
    loaded = load_model(path)
    assert loaded.config.talker_config.rope_theta == 10000.0
    assert loaded.config.talker_config.code_predictor_config.rope_theta == 10000.0
    official = oracle.official_model(copy.deepcopy(data))
    official.load_state_dict(load_file(path / "model.safetensors"), strict=False)
    spec = PromptSpec(shapes.TARGET, "english", x_vector_only=True,
                      speaker_embedding=torch.randn(64, generator=torch.Generator().manual_seed(5)))
    assert torch.equal(shapes.engine_codes(loaded, [spec])[0], shapes.official_codes(official, spec))


def test_codebook_counts_must_agree_and_the_engine_serves_sixteen(tmp_path):
    cfg = tiny_config("base")
    cfg.talker_config.num_code_groups = cfg.talker_config.code_predictor_config.num_code_groups = 8
    mismatched = write_checkpoint(tmp_path / "mismatched", cfg)  # a 16-codebook codec beside 8-codebook talker
    with pytest.raises(ConfigError, match="8 codebooks a frame.*decoder_config.num_quantizers is 16"):
        load_model(mismatched)
    speech = tiny_speech_tokenizer_config()
    speech.decoder_config.num_quantizers = speech.encoder_valid_num_quantizers = 8
    loaded = load_model(write_checkpoint(tmp_path / "eight", cfg, speech_config=speech))  # the model code runs it
    with pytest.raises(ValueError, match="16 codebooks a frame.*num_code_groups=8"):
        Engine(loaded, EngineConfig(max_num_seqs=2, num_kv_blocks=16, device="cpu", dtype="float32"))
