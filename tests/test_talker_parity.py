"""Parity of our talker, code predictor, prompt builder and reference loop with the official
`Qwen3TTSForConditionalGeneration.generate`, on tiny random-weight configs in fp32.

Each mode runs once through both implementations with the same weights: the official prompt and
trailing text are recorded from the kwargs `generate` hands to `talker.generate`, the official logits
from forward hooks on `codec_head` and the code predictor's `lm_head`s.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE), str(_HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import oracle  # noqa: E402

from legato.models.qwen3_tts.prompt import PromptSpec  # noqa: E402
from legato.models.qwen3_tts.prompt_build import build_prompt  # noqa: E402
from legato.models.qwen3_tts.reference_loop import GenerationTrace, generate_codes  # noqa: E402
from legato.models.qwen3_tts.sampling import SamplingParams  # noqa: E402
from legato.models.qwen3_tts.talker import Talker  # noqa: E402
from legato.models.qwen3_tts.tiny import tiny_config  # noqa: E402

IM_START, IM_END, ASSISTANT, USER, NEWLINE = 151644, 151645, 77091, 872, 198
EOS = 2150
MAX_NEW_TOKENS = 21  # -> 20 frames
TOL = 1e-4


def _words(n: int, seed: int) -> list[int]:
    return torch.randint(0, 150000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def target_ids(n: int, seed: int = 1) -> list[int]:
    return [IM_START, ASSISTANT, NEWLINE, *_words(n, seed), IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE]


def ref_ids(n: int, seed: int = 2) -> list[int]:
    return [IM_START, ASSISTANT, NEWLINE, *_words(n, seed), IM_END, NEWLINE]


def instruct_ids(n: int, seed: int = 3) -> list[int]:
    return [IM_START, USER, NEWLINE, *_words(n, seed), IM_END, NEWLINE]


def ref_code(frames: int, seed: int = 4) -> torch.Tensor:
    return torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(seed))


def xvector(seed: int = 5) -> torch.Tensor:
    return torch.randn(64, generator=torch.Generator().manual_seed(seed))


@dataclass
class Case:
    model_type: str
    spec: PromptSpec
    size: str = "0b6"
    official_instruct: bool = True  # False: the official wrapper drops the instruct before generate
    eos_scale: float | None = None
    max_new_tokens: int = MAX_NEW_TOKENS


CASES = {
    "base_xvector_streaming": Case("base", PromptSpec(target_ids(9), "english", speaker_embedding=xvector(),
                                                      x_vector_only=True)),
    "base_xvector_non_streaming": Case("base", PromptSpec(target_ids(9), "auto", speaker_embedding=xvector(),
                                                          x_vector_only=True, non_streaming_mode=True)),
    # ICL streaming, text longer than the reference codec track: the excess trails.
    "base_icl_streaming_text_longer": Case("base", PromptSpec(target_ids(12), "english", ref_ids=ref_ids(4),
                                                              ref_code=ref_code(5), speaker_embedding=xvector())),
    # ICL streaming, reference codec track longer than the text: text padded with tts_pad.
    "base_icl_streaming_codes_longer": Case("base", PromptSpec(target_ids(5), "german", ref_ids=ref_ids(3),
                                                               ref_code=ref_code(14), speaker_embedding=xvector())),
    "base_icl_non_streaming": Case("base", PromptSpec(target_ids(7), "auto", ref_ids=ref_ids(4), ref_code=ref_code(6),
                                                      speaker_embedding=xvector(), non_streaming_mode=True)),
    # Dialect speakers override the language id when it is Chinese or auto.
    "custom_voice_dialect_chinese": Case("custom_voice", PromptSpec(target_ids(8), "chinese", speaker="Eric",
                                                                    non_streaming_mode=True)),
    "custom_voice_dialect_auto_streaming": Case("custom_voice", PromptSpec(target_ids(8), "auto", speaker="dylan")),
    "custom_voice_english": Case("custom_voice", PromptSpec(target_ids(8), "english", speaker="serena")),
    "custom_voice_instruct_1b7": Case("custom_voice", PromptSpec(target_ids(8, seed=2), "english", speaker="ryan",
                                                                 instruct_ids=instruct_ids(6),
                                                                 non_streaming_mode=True), size="1b7"),
    "custom_voice_instruct_dropped_0b6": Case("custom_voice", PromptSpec(target_ids(8, seed=2), "english",
                                                                         speaker="ryan", instruct_ids=instruct_ids(6),
                                                                         non_streaming_mode=True),
                                              official_instruct=False),
    "voice_design_non_streaming": Case("voice_design", PromptSpec(target_ids(8), "auto", instruct_ids=instruct_ids(7),
                                                                  non_streaming_mode=True)),
    "voice_design_streaming": Case("voice_design", PromptSpec(target_ids(10), "english", instruct_ids=instruct_ids(5))),
    # The EOS row of codec_head scaled up so that greedy decoding stops early (reference doc §9 item 10).
    "forced_eos": Case("base", PromptSpec(target_ids(9), "english", speaker_embedding=xvector(), x_vector_only=True),
                       eos_scale=3.0),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls on a shared 2-core box: thread hand-offs cost far more than they save.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def models(model_type: str, size: str, eos_scale: float | None):
    """(config, official model, our talker) sharing one set of random weights."""
    cfg = tiny_config(model_type, size)
    torch.manual_seed(0)
    official = oracle.official_model(cfg.to_dict())
    if eos_scale is not None:
        with torch.no_grad():
            official.talker.codec_head.weight[EOS] *= eos_scale
    state = {k[len("talker."):]: v for k, v in official.state_dict().items() if k.startswith("talker.")}
    ours = Talker(cfg.talker_config).eval()
    ours.load_state_dict(state, strict=True)
    return cfg, official, ours


@dataclass
class Run:
    prompt: torch.Tensor
    trailing: torch.Tensor
    tts_pad: torch.Tensor
    codes: torch.Tensor
    talker_logits: list[torch.Tensor] = field(default_factory=list)
    predictor_logits: list[torch.Tensor] = field(default_factory=list)


def run_official(official, case: Case) -> Run:
    spec = case.spec
    captured: dict = {}
    talker_logits: list[torch.Tensor] = []
    predictor_logits: list[torch.Tensor] = []
    original = official.talker.generate

    def recorder(*args, **kwargs):
        captured.update(kwargs)
        return original(*args, **kwargs)

    hooks = [official.talker.codec_head.register_forward_hook(lambda m, i, o: talker_logits.append(o[0, -1]))]
    for head in official.talker.code_predictor.lm_head:
        hooks.append(head.register_forward_hook(lambda m, i, o: predictor_logits.append(o[0, -1])))
    kwargs = dict(
        input_ids=[torch.tensor([spec.text_ids])],
        languages=[spec.language],
        non_streaming_mode=spec.non_streaming_mode,
        do_sample=False,
        subtalker_dosample=False,
        max_new_tokens=case.max_new_tokens,
    )
    if spec.instruct_ids is not None:
        kwargs["instruct_ids"] = [torch.tensor([spec.instruct_ids]) if case.official_instruct else None]
    if spec.speaker is not None:
        kwargs["speakers"] = [spec.speaker]
    if spec.speaker_embedding is not None:
        icl = not spec.x_vector_only
        kwargs["voice_clone_prompt"] = dict(
            ref_code=[spec.ref_code if icl else None],
            ref_spk_embedding=[spec.speaker_embedding],
            x_vector_only_mode=[spec.x_vector_only],
            icl_mode=[icl],
        )
        kwargs["ref_ids"] = [torch.tensor([spec.ref_ids]) if icl else None]
    official.talker.generate = recorder
    try:
        codes, _ = official.generate(**kwargs)
    finally:
        del official.talker.generate
        for h in hooks:
            h.remove()
    groups = official.talker.config.num_code_groups - 1
    frames = [torch.stack(predictor_logits[i:i + groups]) for i in range(0, len(predictor_logits), groups)]
    return Run(captured["inputs_embeds"][0], captured["trailing_text_hidden"][0], captured["tts_pad_embed"].reshape(-1),
               codes[0], talker_logits, frames)


def run_ours(cfg, talker: Talker, case: Case) -> Run:
    prompt = build_prompt(case.spec, talker, cfg)
    params = SamplingParams(do_sample=False, subtalker_do_sample=False, max_new_tokens=case.max_new_tokens)
    trace = GenerationTrace()
    codes = generate_codes(talker, prompt, params, trace=trace)
    return Run(prompt.embeds, prompt.trailing_text, prompt.tts_pad, codes, trace.talker_logits,
               trace.predictor_logits)


@functools.cache
def runs(name: str) -> tuple[Run, Run]:
    case = CASES[name]
    cfg, official, ours = models(case.model_type, case.size, case.eos_scale)
    with torch.no_grad():
        return run_official(official, case), run_ours(cfg, ours, case)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", list(CASES))
def test_prompt_matches_official(name):
    theirs, ours = runs(name)
    assert _max_diff(ours.prompt, theirs.prompt) <= 1e-6
    assert _max_diff(ours.trailing, theirs.trailing) <= 1e-6
    assert _max_diff(ours.tts_pad, theirs.tts_pad) <= 1e-6


def _frames(name: str) -> int:
    return 10 if name == "forced_eos" else CASES[name].max_new_tokens - 1


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_official(name):
    theirs, ours = runs(name)
    frames = _frames(name)
    assert len(ours.talker_logits) == len(theirs.talker_logits) == frames + 1
    assert len(ours.predictor_logits) == len(theirs.predictor_logits) == frames
    assert max(_max_diff(a, b) for a, b in zip(ours.talker_logits, theirs.talker_logits, strict=True)) <= TOL
    assert max(_max_diff(a, b) for a, b in zip(ours.predictor_logits, theirs.predictor_logits, strict=True)) <= TOL


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_codes_match_official(name):
    theirs, ours = runs(name)
    assert ours.codes.shape == (_frames(name), 16)
    assert torch.equal(ours.codes, theirs.codes)
    assert int(ours.codes[:, 0].max()) < 2048  # control ids suppressed, EOS never emitted


def test_forced_eos_stops_where_official_stops():
    theirs, ours = runs("forced_eos")
    assert 2 <= ours.codes.shape[0] == theirs.codes.shape[0] < MAX_NEW_TOKENS - 1
    # the logits after the last frame chose EOS on both sides
    assert int(ours.talker_logits[-1].argmax()) == EOS


def test_instruct_kept_on_1b7_and_dropped_on_0b6():
    kept, _ = runs("custom_voice_instruct_1b7")
    dropped, _ = runs("custom_voice_instruct_dropped_0b6")
    assert kept.prompt.shape[0] == dropped.prompt.shape[0] + len(CASES["custom_voice_instruct_1b7"].spec.instruct_ids)


def test_code_predictor_batch_equals_single_rows():
    _, _, talker = models("base", "0b6", None)
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, 64, generator=gen)
    first = talker.embed_codec(torch.randint(0, 2048, (3,), generator=gen))
    greedy = lambda logits, group: logits.argmax(-1)  # noqa: E731
    with torch.no_grad():
        batched = talker.code_predictor.predict_residuals(hidden, first, greedy)
        rows = [talker.code_predictor.predict_residuals(hidden[i:i + 1], first[i:i + 1], greedy) for i in range(3)]
    assert batched.shape == (3, 15)
    assert torch.equal(batched, torch.cat(rows))


def test_chunked_prefill_equals_whole_prefill():
    from legato.models.qwen3_tts.decoder_layer import ContiguousKVCache

    _, _, talker = models("base", "0b6", None)
    c = talker.config
    x = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(8))
    pos = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        whole = talker(x, pos, ContiguousKVCache(c.num_hidden_layers, 1, c.num_key_value_heads, c.head_dim, 12))
        cache = ContiguousKVCache(c.num_hidden_layers, 1, c.num_key_value_heads, c.head_dim, 12)
        first = talker(x[:, :7], pos[:, :7], cache)
        cache.advance(7)
        second = talker(x[:, 7:], pos[:, 7:], cache)
    assert _max_diff(torch.cat([first, second], dim=1), whole) <= 1e-5


def test_the_packed_frame_table_embeds_frames_as_the_sixteen_tables_do():
    """`pack_frame_table` (which every engine calls): a frame's embedding is one gather from the concatenated
    tables, bit for bit the sum of the sixteen lookups. The tables become views of it (held once), so an in-place
    change of a table reaches the gather; a module moved to another dtype afterwards takes its tables again."""
    c = tiny_config().talker_config
    talker = Talker(c).eval()
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in talker.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    vocabs = [c.vocab_size] + [c.code_predictor_config.vocab_size] * 15
    codes = torch.stack([torch.randint(0, v, (4, 3), generator=gen) for v in vocabs], dim=-1)
    codes[0, 0] = torch.tensor(vocabs) - 1  # each table's last row: an offset off by one would show
    with torch.no_grad():
        separate = talker.embed_frame(codes)
        talker.pack_frame_table()
        talker.pack_frame_table()  # idempotent
        assert torch.equal(talker.embed_frame(codes), separate)
        table = talker.code_predictor.model.codec_embedding[4].weight
        assert table.untyped_storage().data_ptr() == talker.frame_table.untyped_storage().data_ptr()
        assert sum(t.weight.numel() for t in talker._frame_tables()) == talker.frame_table.numel()
        table[codes[1, 2, 5]] += 1.0  # codebook 5's row of frame [1, 2]
        changed = talker.embed_frame(codes)
        assert not torch.equal(changed[1, 2], separate[1, 2]) and torch.equal(changed[0], separate[0])
        talker.to(torch.float64)  # the float32 table is stale now: the tables' own lookups, summed in float64
        moved = talker.embed_frame(codes)
        assert moved.dtype == torch.float64 and torch.allclose(moved, changed.double(), atol=1e-5)
