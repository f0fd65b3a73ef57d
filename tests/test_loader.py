"""Loading: a tiny checkpoint written to a temp dir loads through the real path; bad files give clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from legato.models.qwen3_tts.config import ConfigError, SpeechTokenizerConfig, preset
from legato.models.qwen3_tts.loader import load_model, resolve_model_dir
from legato.models.qwen3_tts.model import Qwen3TTSModel, SpeechTokenizer


def test_tiny_checkpoint_round_trips(tiny_checkpoint):
    loaded = load_model(tiny_checkpoint)
    stored = load_file(str(tiny_checkpoint / "model.safetensors"))
    ours = loaded.model.state_dict()
    assert set(stored) == set(ours)
    for k, v in stored.items():
        assert torch.equal(v, ours[k]), k
    codec = load_file(str(tiny_checkpoint / "speech_tokenizer" / "model.safetensors"))
    assert set(codec) == set(loaded.speech_tokenizer.state_dict())
    assert loaded.config.tts_model_type == "base"
    assert loaded.model.speaker_encoder is not None
    assert loaded.generation_defaults["temperature"] == 0.9


def test_official_package_reads_our_checkpoint(tiny_checkpoint):
    """The files we write are a real HF-format checkpoint: the official classes load them strictly."""
    import oracle

    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    official = oracle.official_model(cfg)
    official.load_state_dict(load_file(str(tiny_checkpoint / "model.safetensors")), strict=True)
    scfg = json.loads((tiny_checkpoint / "speech_tokenizer" / "config.json").read_text())
    tok = oracle.official_speech_tokenizer(scfg)
    tok.load_state_dict(load_file(str(tiny_checkpoint / "speech_tokenizer" / "model.safetensors")), strict=True)


@pytest.fixture
def broken(tmp_path, tiny_checkpoint):
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, target)
    return target


@pytest.mark.parametrize(
    "relpath",
    ["config.json", "model.safetensors", "speech_tokenizer/config.json", "speech_tokenizer/model.safetensors",
     "vocab.json", "merges.txt", "tokenizer_config.json"],
)
def test_missing_file_is_named(broken, relpath):
    (broken / relpath).unlink()
    with pytest.raises(ConfigError, match=relpath.split("/")[-1]):
        load_model(broken)


def test_a_directory_that_is_no_checkpoint_is_named_so(tmp_path):
    """Not "missing tokenizer file" (what the first reader of an unrelated directory found before)."""
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ConfigError, match="is not a Qwen3-TTS checkpoint directory: it has no config.json"):
        load_model(tmp_path)


def test_corrupt_weights_are_named(broken):
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="model.safetensors"):
        load_model(broken)


def test_malformed_config_is_named(broken):
    (broken / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="config.json"):
        load_model(broken)


def test_invalid_config_value_is_explained(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["tts_model_type"] = "karaoke"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="tts_model_type"):
        load_model(broken)


def test_shape_mismatch_names_the_tensor(broken):
    path = broken / "model.safetensors"
    tensors = load_file(str(path))
    key = "talker.codec_head.weight"
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, str(path))
    with pytest.raises(ConfigError, match="codec_head"):
        load_model(broken)


def test_missing_tensor_is_reported(broken):
    path = broken / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["talker.model.norm.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ConfigError, match="missing 1"):
        load_model(broken)


def test_sharded_weights_load(broken):
    path = broken / "model.safetensors"
    tensors = load_file(str(path))
    keys = sorted(tensors)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for name, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, str(broken / name))
    index = {"weight_map": {k: name for name, ks in shards.items() for k in ks}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    path.unlink()
    loaded = load_model(broken)
    assert torch.equal(loaded.model.state_dict()["talker.codec_head.weight"], tensors["talker.codec_head.weight"])


def test_unknown_local_path_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        resolve_model_dir(tmp_path / "nope")


def test_hub_id_without_network_fails_clearly(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="Qwen/Qwen3-TTS-does-not-exist"):
        resolve_model_dir("Qwen/Qwen3-TTS-does-not-exist")


@pytest.mark.parametrize(
    ("size", "params", "tensors"), [("0.6B", 914_643_008, 478), ("1.7B", 1_928_677_440, 480)]
)
def test_released_configs_have_the_released_parameter_counts(size, params, tensors):
    with torch.device("meta"):
        model = Qwen3TTSModel(preset(size, "base"))
    sd = model.state_dict()
    assert len(sd) == tensors
    assert sum(v.numel() for v in sd.values()) == params


def test_released_codec_decoder_size():
    with torch.device("meta"):
        codec = SpeechTokenizer(SpeechTokenizerConfig())
    assert sum(p.numel() for p in codec.decoder.state_dict().values()) == 114_323_137
