"""Packed prefill: every prompt chunk of a step in one forward gives what prefilling each alone gives, for
the attention itself (against a dense causal attention) and for the engine's codes in every prompt mode."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import engine_config, run_all, tiny_model

from legato.engine.engine import Engine, EngineRequest
from legato.engine.model_runner import PrefillWork
from legato.layers.packed_prefill import BLOCK_M, PackedPrefill, packed_prefill_reference
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.prompt_build import build_prompt
from legato.models.qwen3_tts.sampling import SamplingParams


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def _dense_causal(q, keys, vals, start, scale):
    """q [L, H, D] at positions start.., keys/vals [start + L, KVH, D] of one request."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, 1).transpose(0, 1).double()
    v = vals.repeat_interleave(group, 1).transpose(0, 1).double()
    scores = torch.einsum("lhd,htd->hlt", q.double(), k) * scale
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[1])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hlt,htd->lhd", scores.softmax(-1), v)


def test_packed_attention_equals_a_dense_causal_attention_per_chunk():
    torch.manual_seed(0)
    blocks, bs, kvh, d, h = 96, 16, 2, 16, 4
    kc, vc = torch.randn(blocks, bs, kvh, d), torch.randn(blocks, bs, kvh, d)
    lengths, starts = [5, 2 * BLOCK_M + 3, 1, 33], [0, 10, 129, 16]  # fresh, chunked, one token, one block on
    free = list(range(blocks - 1))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(s + m) // bs))] for s, m in zip(starts, lengths, strict=True)]
    meta = PackedPrefill.build(lengths, starts, tables, bs, blocks - 1, torch.device("cpu"))
    assert meta.host_cu == [0, 5, 136, 137, 170] and meta.tiles.tolist() == [[0, 0], [1, 0], [1, 1], [1, 2],
                                                                             [2, 0], [3, 0]]
    assert meta.positions.tolist()[5:8] == [10, 11, 12]
    q = torch.randn(sum(lengths), h, d)
    got = packed_prefill_reference(q, kc, vc, meta, d**-0.5)
    for i, (s, m) in enumerate(zip(starts, lengths, strict=True)):
        flat = torch.tensor(tables[i])
        keys = kc[flat].flatten(0, 1)[: s + m]
        vals = vc[flat].flatten(0, 1)[: s + m]
        want = _dense_causal(q[meta.host_cu[i] : meta.host_cu[i + 1]], keys, vals, s, d**-0.5)
        assert (got[meta.host_cu[i] : meta.host_cu[i + 1]].double() - want).abs().max() < 1e-5
    # Every packed token's KV slot is its own request's block at its position.
    slots = meta.slot_mapping.tolist()
    assert slots[5] == tables[1][0] * bs + 10 and slots[136] == tables[2][129 // bs] * bs + 129 % bs


MODES = {
    "base": lambda emb, ref: [
        SpeechInput("Hello world, this is a test.", speaker_embedding=emb, x_vector_only=True),
        SpeechInput("Short.", speaker_embedding=emb, x_vector_only=True, non_streaming_mode=True),
        SpeechInput("A longer one, to make the prompt lengths differ a lot more.", speaker_embedding=emb,
                    ref_code=ref, ref_text="A reference transcript here."),
    ],
    "custom_voice": lambda emb, ref: [
        SpeechInput("Hello world, this is a test.", speaker="ryan"),
        SpeechInput("今天天气很好。", speaker="eric", non_streaming_mode=False),
        SpeechInput("Hi.", speaker="serena"),
    ],
    "voice_design": lambda emb, ref: [
        SpeechInput("Please call Stella.", instructions="A calm, deep narrator voice."),
        SpeechInput("Short.", instructions="Bright and fast.", non_streaming_mode=False),
    ],
}


@pytest.mark.parametrize("model_type", list(MODES))
@pytest.mark.parametrize("greedy", [True, False])
def test_packed_prefill_gives_the_codes_of_prefilling_each_prompt_alone(tmp_path_factory, model_type, greedy):
    """Mixed prompt lengths admitted in one step (one packed forward, chunked across steps by a small token
    budget) give the codes each request gets when it is prefilled alone."""
    lm = tiny_model(tmp_path_factory.getbasetemp() / "packed", model_type)
    g = torch.Generator().manual_seed(1)
    emb, ref = torch.randn(64, generator=g), torch.randint(0, 2048, (9, 16), generator=g)
    specs = [build_spec(lm, x) for x in MODES[model_type](emb, ref)]
    lengths = [build_prompt(s, lm.talker, lm.config).length for s in specs]
    assert len(set(lengths)) == len(lengths)

    def params(i: int) -> SamplingParams:
        if greedy:
            return SamplingParams(do_sample=False, subtalker_do_sample=False, max_new_tokens=9)
        return SamplingParams(seed=30 + i, max_new_tokens=9)

    reqs = lambda: [EngineRequest(f"p{i}", s, params(i)) for i, s in enumerate(specs)]  # noqa: E731
    together = run_all(Engine(lm, engine_config(max_num_batched_tokens=sum(lengths) + 8)), reqs())
    chunked = run_all(Engine(lm, engine_config(max_num_batched_tokens=24)), reqs())
    for i, r in enumerate(reqs()):
        alone = run_all(Engine(lm, engine_config()), [r])
        assert torch.equal(together.frames(f"p{i}"), alone.frames(f"p{i}")), (model_type, i)
        assert torch.equal(chunked.frames(f"p{i}"), alone.frames(f"p{i}")), (model_type, i)


def test_one_packed_forward_writes_the_cache_each_alone_writes(tmp_path_factory):
    """At the runner: three chunks packed vs the same chunks one forward each, on fresh caches: the same KV
    in every block, the same first tokens, the same hidden states (CPU float32)."""
    lm = tiny_model(tmp_path_factory.getbasetemp() / "packed", "custom_voice")
    specs = [build_spec(lm, SpeechInput(t, speaker="ryan")) for t in ("One.", "Two words here.", "Three, then.")]
    prompts = [build_prompt(s, lm.talker, lm.config) for s in specs]

    def run(groups: list[list[int]]):
        engine = Engine(lm, engine_config(num_kv_blocks=64))
        runner = engine.runner
        for slot in range(3):
            runner.slots.assign(slot, prompts[slot].trailing_text, SamplingParams(seed=slot), slot, False)
        first = {}
        for group in groups:
            slots, tokens = runner.prefill([PrefillWork(i, prompts[i].embeds, 0, [10 * i, 10 * i + 1, 10 * i + 2],
                                                        True) for i in group])
            first.update(zip(slots, tokens.tolist(), strict=True))
        return first, runner.kv.k.clone(), runner.kv.v.clone(), runner.slots.past_hidden[:3].clone()

    packed, alone = run([[0, 1, 2]]), run([[0], [1], [2]])
    assert packed[0] == alone[0]
    for a, b in zip(packed[1:], alone[1:], strict=True):
        assert (a - b).abs().max() < 1e-5


def _bucketed(engine: Engine, narrow: bool = False) -> Engine:
    """The engine's runner with the padded token-bucket prefill of the CUDA graphs, run eagerly; `narrow`: each step
    loads only its chunks' block-table rows, as wide as their longest (what CUDA does)."""
    engine.runner.prefill_buckets = engine.runner.make_prefill_buckets(graphs=False)
    for static in engine.runner.prefill_buckets.statics.values():
        static.narrow_tables = narrow
    return engine


@pytest.mark.parametrize("model_type", list(MODES))
@pytest.mark.parametrize("greedy", [True, False])
def test_token_bucket_prefill_gives_the_codes_of_the_unpadded_forward(tmp_path_factory, model_type, greedy):
    """The graph path's padded buffers (run eagerly here) change no real token: mixed prompt lengths packed in
    one step, and chunked across steps, give the codes of the unpadded packed forward."""
    lm = tiny_model(tmp_path_factory.getbasetemp() / "packed", model_type)
    g = torch.Generator().manual_seed(2)
    emb, ref = torch.randn(64, generator=g), torch.randint(0, 2048, (9, 16), generator=g)
    specs = [build_spec(lm, x) for x in MODES[model_type](emb, ref)]
    total = sum(build_prompt(s, lm.talker, lm.config).length for s in specs)

    def params(i: int) -> SamplingParams:
        if greedy:
            return SamplingParams(do_sample=False, subtalker_do_sample=False, max_new_tokens=9)
        return SamplingParams(seed=40 + i, max_new_tokens=9)

    reqs = lambda: [EngineRequest(f"p{i}", s, params(i)) for i, s in enumerate(specs)]  # noqa: E731
    for budget in (total + 8, 24):  # all in one step (one bucket, padded), and chunked over several
        plain = run_all(Engine(lm, engine_config(max_num_batched_tokens=budget)), reqs())
        for narrow in (False, True):
            padded = run_all(_bucketed(Engine(lm, engine_config(max_num_batched_tokens=budget)), narrow), reqs())
            for i in range(len(specs)):
                assert torch.equal(padded.frames(f"p{i}"), plain.frames(f"p{i}")), (model_type, budget, narrow, i)


def test_token_bucket_prefill_writes_only_real_blocks_and_the_scratch_block(tmp_path_factory):
    """Padded tokens land in the scratch block alone: every other block holds what the unpadded forward
    writes, and the first tokens and hidden states are the same (CPU float32)."""
    lm = tiny_model(tmp_path_factory.getbasetemp() / "packed", "custom_voice")
    specs = [build_spec(lm, SpeechInput(t, speaker="ryan")) for t in ("One.", "Two words here.", "Three, then.")]
    prompts = [build_prompt(s, lm.talker, lm.config) for s in specs]

    def run(bucketed: bool):
        engine = Engine(lm, engine_config(num_kv_blocks=64))
        if bucketed:
            _bucketed(engine)
        runner = engine.runner
        for slot in range(3):
            runner.slots.assign(slot, prompts[slot].trailing_text, SamplingParams(seed=slot), slot, False)
        slots, tokens = runner.prefill([PrefillWork(i, prompts[i].embeds, 0, [10 * i, 10 * i + 1, 10 * i + 2], True)
                                        for i in range(3)])
        real = [b for b in range(runner.kv.k.shape[1]) if b != runner.replicas[0].scratch_block]
        return (dict(zip(slots, tokens.tolist(), strict=True)), runner.kv.k[:, real].clone(),
                runner.kv.v[:, real].clone(), runner.slots.past_hidden[:3].clone())

    padded, plain = run(True), run(False)
    assert padded[0] == plain[0]
    for a, b in zip(padded[1:], plain[1:], strict=True):
        assert (a - b).abs().max() < 1e-5


def test_static_prefill_pads_tokens_to_the_scratch_block_and_tiles_to_an_empty_chunk():
    from legato.engine.prefill_graphs import StaticPrefill, token_buckets

    assert token_buckets(4096) == [32, 64, 128, 256, 512, 1024, 2048, 4096] and token_buckets(20) == [32]
    st = StaticPrefill(128, 4, 6, 8, 16, 99, torch.float32, torch.device("cpu"))
    embeds = [torch.ones(5, 8), 2 * torch.ones(70, 8)]
    st.load(embeds, [5, 70], [0, 16], [[1], [2, 3, 4, 5, 6, 7]])
    meta = st.meta
    assert meta.cu_seqlens.tolist() == [0, 5, 75, 75, 75, 75] and meta.host_cu == [0, 5, 75]
    assert meta.starts.tolist() == [0, 16, 0, 0, 0] and meta.block_tables[1].tolist() == [2, 3, 4, 5, 6, 7]
    assert meta.block_tables[0].tolist() == [1, 99, 99, 99, 99, 99]
    assert meta.tiles.shape[0] == 128 // BLOCK_M + 4
    assert meta.tiles.tolist()[:3] == [[0, 0], [1, 0], [1, 1]]
    assert all(t == [4, 0] for t in meta.tiles.tolist()[3:])  # chunk 4: always empty
    assert meta.slot_mapping[75:].eq(99 * 16).all() and meta.positions[75:].eq(0).all()
    assert meta.slot_mapping[5].item() == 3 * 16 + 0 and meta.slot_mapping[74].item() == 7 * 16 + (16 + 69) % 16
    assert torch.equal(st.embeds[:5], embeds[0]) and torch.equal(st.embeds[5:75], embeds[1])


def test_a_narrow_load_writes_its_chunks_rows_and_leaves_the_rest():
    """CUDA's load: the step's chunks' table rows as wide as their longest; rows and columns past them keep what
    an earlier step left (never read: a chunk's kernel tiles read only its own blocks), the rest is as a full load."""
    from legato.engine.prefill_graphs import StaticPrefill

    st = StaticPrefill(128, 4, 6, 8, 16, 99, torch.float32, torch.device("cpu"))
    st.narrow_tables = True
    st.load([torch.ones(5, 8), torch.ones(70, 8), torch.ones(3, 8)], [5, 70, 3], [0, 16, 0],
            [[1], [2, 3, 4, 5, 6, 7], [8]])
    st.load([2 * torch.ones(20, 8)], [20], [16], [[10, 11, 12]])
    meta = st.meta
    assert meta.block_tables[0].tolist() == [10, 11, 12, 99, 99, 99]  # cols 3+: the first load's padding
    assert meta.block_tables[1].tolist() == [2, 3, 4, 5, 6, 7] and meta.block_tables[2].tolist()[:1] == [8]
    assert meta.cu_seqlens.tolist() == [0, 20, 20, 20, 20, 20] and meta.host_cu == [0, 20]
    assert meta.starts.tolist() == [16, 0, 0, 0, 0]
    assert meta.tiles.tolist()[0] == [0, 0] and all(t == [4, 0] for t in meta.tiles.tolist()[1:])
    assert meta.slot_mapping[:20].tolist() == [(10 + p // 16) * 16 + p % 16 for p in range(16, 36)]
    assert meta.slot_mapping[20:].eq(99 * 16).all() and torch.equal(st.embeds[:20], 2 * torch.ones(20, 8))
