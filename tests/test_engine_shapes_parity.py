"""The serving engine against the official `generate` on checkpoints of other shapes than the tiny one the parity
suite uses: grouped-query ratios, no grouping, head widths apart from hidden/heads, a code predictor as wide as
the talker (no projection between them), odd depths and MLP widths. Each shape is written to disk and loaded as a
released checkpoint would be (`write_checkpoint` -> `load_model`), the official model gets the same weights from
that file, and both decode greedily: the codes must be identical.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import oracle  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from legato.engine.config import EngineConfig  # noqa: E402
from legato.engine.engine import Engine, EngineRequest  # noqa: E402
from legato.models.qwen3_tts.loader import load_model  # noqa: E402
from legato.models.qwen3_tts.prompt import PromptSpec  # noqa: E402
from legato.models.qwen3_tts.sampling import SamplingParams  # noqa: E402
from legato.models.qwen3_tts.testing import write_checkpoint  # noqa: E402
from legato.models.qwen3_tts.tiny import tiny_config  # noqa: E402

FRAMES = 12


def _rope(sections: list[int]) -> dict:
    return {"interleaved": True, "mrope_section": sections, "rope_type": "default"}


SHAPES = {
    "no_grouping": dict(num_key_value_heads=4, cp_num_key_value_heads=4),
    "four_heads_a_group": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, rope_scaling=_rope([1, 1, 2])),
    "heads_wider_than_hidden": dict(head_dim=32, rope_scaling=_rope([4, 6, 6]), cp_head_dim=32),
    "predictor_as_wide_as_talker": dict(cp_hidden_size=64, cp_intermediate_size=80),
    "odd_depths_and_widths": dict(num_hidden_layers=3, intermediate_size=100, cp_num_hidden_layers=1,
                                  cp_intermediate_size=70, cp_num_attention_heads=2, cp_num_key_value_heads=1,
                                  cp_head_dim=24),
}


def shaped_config(model_type: str, **changes):
    cfg = tiny_config(model_type)
    talker = cfg.talker_config
    cp = dataclasses.replace(talker.code_predictor_config,
                             **{k[3:]: v for k, v in changes.items() if k.startswith("cp_")})
    talker = dataclasses.replace(talker, code_predictor_config=cp,
                                 **{k: v for k, v in changes.items() if not k.startswith("cp_")})
    return dataclasses.replace(cfg, talker_config=talker)


def _ids(n: int, seed: int, head: list[int], tail: list[int]) -> list[int]:
    return [*head, *torch.randint(0, 150000, (n,), generator=torch.Generator().manual_seed(seed)).tolist(), *tail]


TARGET = _ids(9, 1, [151644, 77091, 198], [151645, 198, 151644, 77091, 198])
REF = _ids(4, 2, [151644, 77091, 198], [151645, 198])


def official_codes(official, spec: PromptSpec) -> torch.Tensor:
    kwargs = dict(input_ids=[torch.tensor([spec.text_ids])], languages=[spec.language],
                  non_streaming_mode=spec.non_streaming_mode, do_sample=False, subtalker_dosample=False,
                  max_new_tokens=FRAMES + 1)
    if spec.speaker is not None:
        kwargs["speakers"] = [spec.speaker]
    if spec.speaker_embedding is not None:
        icl = not spec.x_vector_only
        kwargs["voice_clone_prompt"] = dict(ref_code=[spec.ref_code if icl else None],
                                            ref_spk_embedding=[spec.speaker_embedding],
                                            x_vector_only_mode=[spec.x_vector_only], icl_mode=[icl])
        kwargs["ref_ids"] = [torch.tensor([spec.ref_ids]) if icl else None]
    with torch.no_grad():
        codes, _ = official.generate(**kwargs)
    return codes[0]


def engine_codes(lm, specs: list[PromptSpec]) -> list[torch.Tensor]:
    """All specs at once in one engine (a batch of rows of different prompt lengths), greedy."""
    engine = Engine(lm, EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=64))
    greedy = SamplingParams(do_sample=False, subtalker_do_sample=False, max_new_tokens=FRAMES + 1)
    for i, spec in enumerate(specs):
        engine.add_request(EngineRequest(str(i), spec, greedy))
    got: dict[str, list[torch.Tensor]] = {str(i): [] for i in range(len(specs))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append(out.codes)
    return [torch.cat(got[str(i)]) for i in range(len(specs))]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_engine_codes_equal_official_on_other_shapes(shape, tmp_path, one_torch_thread):
    cfg = shaped_config("base", **SHAPES[shape])
    path = write_checkpoint(tmp_path / shape, cfg)
    official = oracle.official_model(cfg.to_dict())
    missing, unexpected = official.load_state_dict(load_file(path / "model.safetensors"), strict=False)
    assert not [k for k in missing if k.startswith("talker.")] and not unexpected
    voice = torch.randn(cfg.talker_config.hidden_size, generator=torch.Generator().manual_seed(5))
    ref_code = torch.randint(0, 2048, (6, 16), generator=torch.Generator().manual_seed(4))
    specs = [PromptSpec(TARGET, "english", speaker_embedding=voice, x_vector_only=True),
             PromptSpec(TARGET, "auto", ref_ids=REF, ref_code=ref_code, speaker_embedding=voice)]
    ours = engine_codes(load_model(path), specs)
    for spec, got in zip(specs, ours, strict=True):
        want = official_codes(official, spec)
        assert got.shape == want.shape == (FRAMES, 16)
        assert torch.equal(got, want)


def test_custom_voice_engine_codes_equal_official_on_another_shape(tmp_path, one_torch_thread):
    cfg = shaped_config("custom_voice", **SHAPES["four_heads_a_group"])
    path = write_checkpoint(tmp_path / "cv", cfg)
    official = oracle.official_model(cfg.to_dict())
    official.load_state_dict(load_file(path / "model.safetensors"), strict=False)
    specs = [PromptSpec(TARGET, "english", speaker="serena"), PromptSpec(TARGET, "chinese", speaker="eric")]
    for spec, got in zip(specs, engine_codes(load_model(path), specs), strict=True):
        assert torch.equal(got, official_codes(official, spec))
