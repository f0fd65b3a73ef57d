"""Prompt builder: templates, layout lengths (reference doc §3.4) and request validation."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from legato.models.qwen3_tts.prompt import (  # noqa: E402
    PromptError,
    PromptSpec,
    instruct_text_ids,
    ref_text_ids,
    supported_languages,
    target_text_ids,
)
from legato.models.qwen3_tts.prompt_build import build_prompt, build_prompts  # noqa: E402
from legato.models.qwen3_tts.talker import Talker  # noqa: E402
from legato.models.qwen3_tts.tiny import tiny_config  # noqa: E402

TEXT = [151644, 77091, 198, 11, 22, 33, 44, 151645, 198, 151644, 77091, 198]  # 4 text tokens
REF = [151644, 77091, 198, 55, 66, 151645, 198]


@functools.cache
def model(kind: str, size: str = "0b6"):
    cfg = tiny_config(kind, size)
    torch.manual_seed(0)
    return cfg, Talker(cfg.talker_config).eval()


def build(kind: str, size: str = "0b6", **kw):
    cfg, talker = model(kind, size)
    return build_prompt(PromptSpec(**kw), talker, cfg)


class EchoTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]


def test_templates_wrap_the_text():
    tok = EchoTokenizer()
    expected = "<|im_start|>assistant\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert "".join(map(chr, target_text_ids(tok, "hi"))) == expected
    assert "".join(map(chr, ref_text_ids(tok, "yo"))) == "<|im_start|>assistant\nyo<|im_end|>\n"
    assert "".join(map(chr, instruct_text_ids(tok, "calm"))) == "<|im_start|>user\ncalm<|im_end|>\n"
    assert instruct_text_ids(tok, "") is None and instruct_text_ids(tok, None) is None


def test_xvector_prompt_lengths():
    xv = torch.randn(64)
    p = build("base", text_ids=TEXT, language="english", speaker_embedding=xv, x_vector_only=True)
    assert p.length == 10 and p.trailing_text.shape == (4, 64)  # 3 remaining text tokens + tts_eos
    p = build("base", text_ids=TEXT, language="auto", speaker_embedding=xv, x_vector_only=True)
    assert p.length == 9
    p = build("base", text_ids=TEXT, language="auto", speaker_embedding=xv, x_vector_only=True,
              non_streaming_mode=True)
    assert p.length == 3 + 5 + 5 + 1 and p.trailing_text.shape == (1, 64)


def test_icl_prompt_lengths():
    xv = torch.randn(64)
    code = torch.randint(0, 2048, (20, 16))
    p = build("base", text_ids=TEXT, language="english", speaker_embedding=xv, ref_ids=REF, ref_code=code)
    assert p.length == 3 + 6 + 21
    p = build("base", text_ids=TEXT, language="english", speaker_embedding=xv, ref_ids=REF, ref_code=code,
              non_streaming_mode=True)
    assert p.length == 3 + 6 + (2 + 4 + 1) + 21


def test_text_for_step_falls_back_to_tts_pad():
    p = build("custom_voice", text_ids=TEXT, language="english", speaker="ryan")
    assert torch.equal(p.text_for_step(0), p.trailing_text[0])
    assert torch.equal(p.text_for_step(p.trailing_text.shape[0]), p.tts_pad)


def test_supported_languages_hide_dialects():
    cfg, _ = model("custom_voice")
    langs = supported_languages(cfg)
    assert "auto" in langs and "english" in langs
    assert not any("dialect" in x for x in langs)


XV = torch.randn(64)
CODE = torch.randint(0, 2048, (4, 16))


@pytest.mark.parametrize(
    "kind, kw, match",
    [
        ("custom_voice", dict(language="english", speaker="nobody"), "unknown speaker"),
        ("custom_voice", dict(language="english"), "needs a speaker"),
        ("custom_voice", dict(language="klingon", speaker="ryan"), "unsupported language"),
        ("custom_voice", dict(language="sichuan_dialect", speaker="ryan"), "unsupported language"),
        ("custom_voice", dict(language="english", speaker="ryan", speaker_embedding=XV), "reference voice"),
        ("voice_design", dict(language="english", speaker="ryan"), "no preset speakers"),
        ("voice_design", dict(language="english", ref_code=CODE), "reference voice"),
        ("base", dict(language="english"), "speaker embedding"),
        ("base", dict(language="english", speaker_embedding=torch.randn(32), x_vector_only=True), "64 values"),
        ("base", dict(language="english", speaker_embedding=torch.full((64,), float("nan")), x_vector_only=True),
         "non-finite"),
        ("base", dict(language="english", speaker_embedding=XV, ref_code=CODE), "ref_ids"),
        ("base", dict(language="english", speaker_embedding=XV, ref_ids=REF), "ref_code"),
        ("base", dict(language="english", speaker_embedding=XV, ref_ids=REF[:3] + REF[-2:], ref_code=CODE),
         "non-empty transcript"),
        ("base", dict(language="english", speaker_embedding=XV, ref_ids=REF, ref_code=CODE[:, :8]), "ref_code"),
        ("base", dict(language="english", speaker_embedding=XV, ref_ids=REF, ref_code=CODE + 5000), "ref_code"),
        ("base", dict(language="english", speaker_embedding=XV, x_vector_only=True, instruct_ids=[1, 2]),
         "instruction"),
        ("base", dict(language="english", speaker="ryan", speaker_embedding=XV, x_vector_only=True),
         "no preset speakers"),
    ],
)
def test_invalid_requests_raise_prompt_error(kind, kw, match):
    with pytest.raises(PromptError, match=match):
        build(kind, text_ids=TEXT, **kw)


def test_bad_text_ids_raise_prompt_error():
    with pytest.raises(PromptError, match="at least one text token"):
        build("voice_design", text_ids=TEXT[:3] + TEXT[-5:])
    with pytest.raises(PromptError, match="outside"):
        build("voice_design", text_ids=[*TEXT[:3], 10**7, *TEXT[-5:]])
    assert issubclass(PromptError, ValueError)


def test_instruct_only_reaches_1b7_custom_voice_and_voice_design():
    kw = dict(text_ids=TEXT, language="english", speaker="ryan", instruct_ids=[151644, 872, 198, 5, 6, 151645, 198])
    assert build("custom_voice", "1b7", **kw).length == build("custom_voice", "0b6", **kw).length + 7
    vd = build("voice_design", text_ids=TEXT, instruct_ids=kw["instruct_ids"])
    assert vd.length == build("voice_design", text_ids=TEXT, instruct_ids=[]).length + 7


def test_the_special_text_embeddings_follow_the_weights():
    """tts_bos/eos/pad's text embeddings are computed once per set of weights: the same prompt again reuses
    them, and weights changed in place (as loading a checkpoint does) are seen at the next prompt."""
    cfg = tiny_config("base", "0b6")
    torch.manual_seed(1)
    talker = Talker(cfg.talker_config).eval()
    spec = PromptSpec(text_ids=TEXT, speaker_embedding=torch.randn(cfg.talker_config.hidden_size),
                      x_vector_only=True)
    first = build_prompt(spec, talker, cfg)
    cached = talker._prompt_parts
    again = build_prompt(spec, talker, cfg)
    assert talker._prompt_parts is cached and torch.equal(first.embeds, again.embeds)
    specials = torch.tensor([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id])
    assert torch.equal(first.tts_pad, talker.embed_text(specials)[2])
    with torch.no_grad():
        next(talker.text_projection.parameters()).mul_(0.5)
    changed = build_prompt(spec, talker, cfg)
    assert talker._prompt_parts is not cached
    assert not torch.equal(changed.tts_pad, first.tts_pad)
    assert torch.equal(changed.tts_pad, talker.embed_text(specials)[2])


@pytest.mark.parametrize("kind,size", [("base", "0b6"), ("custom_voice", "1b7"), ("voice_design", "1b7")])
def test_prompts_built_from_the_shared_pieces_equal_prompts_built_cold(kind, size):
    """The role prefix, a first token, an instruction and the codec control ids, cached from earlier prompts, give
    each later prompt the bits it gets with nothing cached."""
    cfg = tiny_config(kind, size)
    torch.manual_seed(2)
    talker = Talker(cfg.talker_config).eval()
    extra = dict(speaker_embedding=torch.randn(cfg.talker_config.hidden_size), x_vector_only=True) \
        if kind == "base" else dict(speaker="ryan") if kind == "custom_voice" else {}
    instruct = [151644, 872, 198, 5, 6, 151645, 198] if kind != "base" else None
    body = TEXT[3:-5]
    texts = [TEXT, [*TEXT[:3], *body[:1], *body[::-1], *TEXT[-5:]], [*TEXT[:3], *body[1:], *TEXT[-5:]]]
    specs = [PromptSpec(text_ids=t, language=lang, instruct_ids=instruct, **extra)
             for t in texts for lang in ("english", "auto")]
    warm = [build_prompt(s, talker, cfg) for s in specs]
    for spec, got in zip(specs, warm, strict=True):
        talker._prompt_parts = None  # nothing cached
        cold = build_prompt(spec, talker, cfg)
        assert torch.equal(got.embeds, cold.embeds) and torch.equal(got.trailing_text, cold.trailing_text)
        assert torch.equal(got.tts_pad, cold.tts_pad)


def _mixed_specs(kind: str, cfg, seed: int) -> list[PromptSpec]:
    """Specs of every layout `kind` has: streaming and not, open and closed text, languages, short and long texts;
    Base with x-vectors and in-context references of several lengths; CustomVoice with dialect speakers."""
    g = torch.Generator().manual_seed(seed)
    hidden = cfg.talker_config.hidden_size
    codebook = cfg.talker_config.code_predictor_config.vocab_size
    specs = []
    for n in (1, 2, 5, 13, 30):
        text = [*TEXT[:3], *torch.randint(10, 1000, (n,), generator=g).tolist(), *TEXT[-5:]]
        for lang in ("auto", "english", "chinese"):
            for non_streaming, text_open in ((False, False), (False, True), (True, False)):
                kw = dict(text_ids=text, language=lang, non_streaming_mode=non_streaming, text_open=text_open)
                if kind == "base":
                    specs.append(PromptSpec(**kw, speaker_embedding=torch.randn(hidden, generator=g),
                                            x_vector_only=True))
                    for frames, ref in ((1, REF), (6, REF), (25, [*REF[:3], *range(40, 52), *REF[-2:]])):
                        if text_open and 1 + frames > len(ref) - 5 + n:
                            continue  # an open in-context text too short for its reference has no prompt yet
                        specs.append(PromptSpec(**kw, speaker_embedding=torch.randn(hidden, generator=g), ref_ids=ref,
                                                ref_code=torch.randint(0, codebook, (frames, 16), generator=g)))
                elif kind == "custom_voice":
                    for speaker in ("ryan", "eric", "dylan"):
                        specs.append(PromptSpec(**kw, speaker=speaker, instruct_ids=[151644, 872, 198, 5, 151645, 198]))
                else:
                    instruct = [151644, 872, 198, *range(5, 6 + n % 4), 151645, 198]
                    specs.append(PromptSpec(**kw, instruct_ids=instruct))
    order = torch.randperm(len(specs), generator=g).tolist()
    return [specs[i] for i in order]


@pytest.mark.parametrize("kind,size,dtype", [("base", "0b6", torch.float32), ("base", "0b6", torch.bfloat16),
                                             ("custom_voice", "1b7", torch.float32),
                                             ("voice_design", "1b7", torch.float32)])
def test_a_batch_of_prompts_equals_each_prompt_built_alone(kind, size, dtype):
    """Prompts built together (the admission thread's batches) have the bits each gets alone, whatever the batch
    holds: each text is projected at its own length, and the rest is lookups, gathers and one add per row. A bad
    request in the batch gets the error it gets alone, and fails alone."""
    cfg = tiny_config(kind, size)
    torch.manual_seed(3)
    talker = Talker(cfg.talker_config).eval().to(dtype)
    specs = _mixed_specs(kind, cfg, seed=4)
    bad = [PromptSpec(text_ids=TEXT, language="klingon"), PromptSpec(text_ids=[1, 2]),
           PromptSpec(text_ids=[*TEXT[:3], 10 ** 9, *TEXT[-5:]])]
    if kind == "base":
        nan = torch.full((cfg.talker_config.hidden_size,), float("nan"))
        bad.append(PromptSpec(text_ids=TEXT, speaker_embedding=nan, x_vector_only=True))
    batch = specs[:7] + bad + specs[7:]
    for start in range(0, len(batch), 23):  # batches of mixed layouts, the bad ones among them
        part = batch[start:start + 23]
        for spec, got in zip(part, build_prompts(part, talker, cfg), strict=True):
            try:
                alone = build_prompt(spec, talker, cfg)
            except PromptError as e:
                assert isinstance(got, PromptError) and str(got) == str(e)
                continue
            assert not isinstance(got, Exception), got
            for a, b in ((got.embeds, alone.embeds), (got.trailing_text, alone.trailing_text),
                         (got.tts_pad, alone.tts_pad)):
                assert a.dtype == b.dtype == dtype and torch.equal(a, b)
    assert all(isinstance(x, PromptError) for x in build_prompts(bad, talker, cfg))
