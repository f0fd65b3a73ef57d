"""A decode step's block tables as wide as its longest row (what the runner uploads on CUDA, where a full row of a
32k-token context is 2,048 entries): the same codes as full-width tables, and a graph's static table filled in its
first columns only. CPU, the tiny model; the CUDA graphs that take them run in test_gpu.py."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import engine_config, run_all, tiny_model

from legato.engine.engine import Engine, EngineRequest
from legato.engine.mtp_replicas import copy_inputs
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.sampling import SamplingParams


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def _requests(lm) -> list[EngineRequest]:
    emb = torch.randn(64, generator=torch.Generator().manual_seed(3))
    texts = ["Hello world, this is a test.", "Please call Stella and ask her to bring these things.", "Hi."]
    reqs = []
    for i, text in enumerate(texts * 2):
        spec = build_spec(lm, SpeechInput(text, language="english", speaker_embedding=emb, x_vector_only=True))
        params = SamplingParams(seed=7 + i, max_new_tokens=40) if i % 2 else SamplingParams(
            do_sample=False, subtalker_do_sample=False, max_new_tokens=40)
        reqs.append(EngineRequest(f"r{i}", spec, params, max_frames=20 + 7 * i, ignore_eos=True, stream_audio=False))
    return reqs


def test_narrow_block_tables_give_the_same_codes(tmp_path):
    lm = tiny_model(tmp_path, "base")
    full = Engine(lm, engine_config(block_size=4, max_num_seqs=4))
    narrow = Engine(lm, engine_config(block_size=4, max_num_seqs=4))
    narrow.runner.narrow_tables = True
    widths = []
    make_inputs = narrow.runner._decode_inputs

    def spy(slots, positions, tables, padded, rep):
        widths.append(tables.shape[1])
        return make_inputs(slots, positions, tables, padded, rep)

    narrow.runner._decode_inputs = spy
    want, got = run_all(full, _requests(lm)), run_all(narrow, _requests(lm))
    for r in _requests(lm):
        assert torch.equal(got.frames(r.request_id), want.frames(r.request_id)), r.request_id
    full_width = narrow.runner.max_blocks_per_seq
    assert widths and max(widths) < full_width and len(set(widths)) > 1  # narrow, and growing with the rows
    assert narrow.block_manager.num_free_blocks == narrow.config.num_kv_blocks


def test_a_narrow_table_fills_the_first_columns_of_a_static_one():
    statics = (torch.zeros(4, dtype=torch.long), torch.full((4, 8), -1, dtype=torch.int32))
    new = (torch.arange(4), torch.arange(12, dtype=torch.int32).view(4, 3))
    copy_inputs(statics, new)
    assert torch.equal(statics[0], torch.arange(4))
    assert torch.equal(statics[1][:, :3], new[1]) and bool((statics[1][:, 3:] == -1).all())
    full = torch.arange(32, dtype=torch.int32).view(4, 8)
    copy_inputs(statics, (torch.arange(4), full))
    assert torch.equal(statics[1], full)
