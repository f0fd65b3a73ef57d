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
    build_prompt,
    instruct_text_ids,
    ref_text_ids,
    supported_languages,
    target_text_ids,
)
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
