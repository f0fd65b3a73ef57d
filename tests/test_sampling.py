"""Batched logits processors against transformers' own processors, parameter validation, and seeded
sampling through the reference loop."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from legato.models.qwen3_tts.prompt import PromptSpec  # noqa: E402
from legato.models.qwen3_tts.prompt_build import build_prompt  # noqa: E402
from legato.models.qwen3_tts.reference_loop import generate_codes  # noqa: E402
from legato.models.qwen3_tts.sampling import (  # noqa: E402
    SamplingParams,
    SamplingParamsError,
    TalkerRules,
    WarpTensors,
    apply_talker_rules,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    choose_tokens,
    multinomial_draw,
)
from legato.models.qwen3_tts.talker import Talker  # noqa: E402
from legato.models.qwen3_tts.tiny import tiny_config  # noqa: E402

V, EOS = 3072, 2150


def _hf_chain(params: SamplingParams, history: torch.Tensor):
    lp = pytest.importorskip("transformers.generation.logits_process")
    suppress = [i for i in range(V - 1024, V) if i != EOS]
    chain = [
        lp.RepetitionPenaltyLogitsProcessor(params.repetition_penalty),
        lp.MinNewTokensLengthLogitsProcessor(0, params.min_new_tokens, EOS),
        lp.SuppressTokensLogitsProcessor(suppress),
    ]
    if params.temperature != 1.0:
        chain.append(lp.TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        chain.append(lp.TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        chain.append(lp.TopPLogitsWarper(params.top_p))
    return lp.LogitsProcessorList(chain)


ROWS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.6, repetition_penalty=1.3),
    SamplingParams(temperature=1.3, top_k=0, top_p=0.9, repetition_penalty=1.0, min_new_tokens=5),
    SamplingParams(temperature=1.0, top_k=3000, top_p=1.0, repetition_penalty=0.8),
]


@pytest.mark.parametrize("generated", [0, 1, 2, 6])
def test_processors_match_transformers_per_row(generated):
    gen = torch.Generator().manual_seed(generated)
    logits = torch.randn(len(ROWS), V, generator=gen) * 3
    logits[:, EOS] = 10.0  # make the EOS mask matter
    history = torch.randint(0, 2048, (len(ROWS), generated), generator=gen)
    if generated:
        history[:, -1] = history[:, 0]  # repeats are penalised once

    seen = torch.zeros(len(ROWS), V, dtype=torch.bool).scatter_(1, history, True)
    count = torch.full((len(ROWS),), generated)
    rules = TalkerRules.build(ROWS, V, EOS)
    warp = WarpTensors.build(ROWS, subtalker=False)
    ours = apply_talker_rules(logits.clone(), seen, count, rules)
    ours = apply_top_p(apply_top_k(apply_temperature(ours, warp.temperature), warp.top_k), warp.top_p)

    for row, params in enumerate(ROWS):
        expected = _hf_chain(params, history[row:row + 1])(history[row:row + 1], logits[row:row + 1].clone())
        assert torch.equal(ours[row:row + 1], expected), row


def test_greedy_rows_take_argmax_and_sampled_rows_stay_in_top_k():
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(do_sample=False), SamplingParams(top_k=3)]
    warp = WarpTensors.build(params, subtalker=False)
    top3 = set(logits[1].topk(3).indices.tolist())
    draw = multinomial_draw(torch.Generator().manual_seed(0))
    for _ in range(20):
        ids = choose_tokens(logits, warp, draw)
        assert int(ids[0]) == int(logits[0].argmax())
        assert int(ids[1]) in top3


def test_all_greedy_batch_skips_the_draw():
    warp = WarpTensors.build([SamplingParams(do_sample=False, temperature=0.0)], subtalker=False)

    def no_draw(probs):
        raise AssertionError("greedy batches must not sample")

    logits = torch.randn(1, 10)
    assert int(choose_tokens(logits, warp, no_draw)[0]) == int(logits.argmax())


def test_defaults_are_the_official_ones():
    p = SamplingParams()
    assert (p.do_sample, p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (True, 0.9, 50, 1.0, 1.05)
    assert (p.subtalker_do_sample, p.subtalker_temperature, p.subtalker_top_k, p.subtalker_top_p) == (
        True, 0.9, 50, 1.0)
    assert p.min_new_tokens == 2


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_new_tokens=-1), "min_new_tokens"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(subtalker_temperature=-1.0), "subtalker_temperature"),
        (dict(subtalker_top_p=2.0), "subtalker_top_p"),
        (dict(do_sample="yes"), "do_sample"),
        (dict(seed=-3), "seed"),
    ],
)
def test_invalid_params_raise_naming_the_field(kwargs, word):
    with pytest.raises(SamplingParamsError, match=word):
        SamplingParams(**kwargs)
    assert issubclass(SamplingParamsError, ValueError)


def test_greedy_accepts_zero_temperature():
    assert SamplingParams(do_sample=False, temperature=0.0, subtalker_do_sample=False,
                          subtalker_temperature=0.0).temperature == 0.0


def test_seeded_sampling_is_reproducible():
    cfg = tiny_config("custom_voice")
    torch.manual_seed(0)
    talker = Talker(cfg.talker_config).eval()
    ids = [151644, 77091, 198, 11, 22, 33, 44, 151645, 198, 151644, 77091, 198]
    prompt = build_prompt(PromptSpec(ids, "english", speaker="ryan"), talker, cfg)
    params = SamplingParams(max_new_tokens=9, seed=1234)
    a = generate_codes(talker, prompt, params)
    b = generate_codes(talker, prompt, params)
    c = generate_codes(talker, prompt, SamplingParams(max_new_tokens=9, seed=99))
    assert a.shape == (8, 16) and a.dtype == torch.long
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert 0 <= int(a.min()) and int(a.max()) < 2048
