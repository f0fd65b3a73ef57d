"""Streaming text input: pieces cut at safe boundaries tokenise to the ids of the whole text at once."""

from __future__ import annotations

import random

import pytest

from legato.models.qwen3_tts.prompt import ROLE_LEN, TARGET_TAIL, target_text_ids
from legato.models.qwen3_tts.testing import write_text_tokenizer
from legato.models.qwen3_tts.text_stream import TextStream, is_safe_boundary, safe_cut, segment_ids
from legato.models.qwen3_tts.text_tokenizer import TextTokenizer

TEXTS = [
    "Hello world, this is a test.",
    "I'm fine, it's 12:30  and   we'll\n\nmeet at 7 p.m. -- okay?!\n",
    "camelCaseWordsHERE and ÄÖÜ, naïve café (really) \"quoted\".",
    "  leading and trailing spaces  ",
    "emoji 🎉 and tabs\tand\r\nwindows lines...\n\n  indented",
    "今天天气很好，我们一起去公园散步吧。明天呢？",
    "e\u0301 decomposed, 3.14159 and $100,000!",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_text_tokenizer(d)
    return TextTokenizer.from_dir(d)


def streamed_ids(tok, pieces: list[str]) -> list[int]:
    stream, ids = TextStream(), []
    for p in pieces:
        piece = stream.append(p)
        if piece:
            ids += segment_ids(tok, piece, first=len(stream.pieces) == 1)
    piece = stream.close()
    if piece:
        ids += segment_ids(tok, piece, first=len(stream.pieces) == 1)
    return ids


def split_randomly(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, len(text) // 2))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("text", TEXTS)
def test_any_arrival_pattern_gives_the_ids_of_the_whole_text(tok, text):
    whole = target_text_ids(tok, text)[ROLE_LEN:-TARGET_TAIL]
    rng = random.Random(hash(text) & 0xFFFF)
    patterns = [[text], list(text), text.split(" "), *[split_randomly(text, rng) for _ in range(30)]]
    patterns[2] = [w + " " for w in patterns[2][:-1]] + patterns[2][-1:]
    for pieces in patterns:
        assert streamed_ids(tok, pieces) == whole, pieces


def test_a_word_is_held_back_until_what_follows_decides_it(tok):
    s = TextStream()
    assert s.append("Hel") == ""
    assert s.append("lo") == ""
    assert s.append(" wor") == "Hello"
    assert s.append("ld,") == " world"
    assert s.flush() == ","
    assert s.append(" bye") == ""
    assert s.close() == " bye"
    with pytest.raises(ValueError):
        s.append("more")


def test_boundaries():
    assert is_safe_boundary("a", " ") and is_safe_boundary("a", ",") and is_safe_boundary("1", "2")
    assert not is_safe_boundary("a", "b") and not is_safe_boundary(" ", "a") and not is_safe_boundary(",", "a")
    assert not is_safe_boundary(".", "\n") and not is_safe_boundary("e", "\u0301")
    assert safe_cut("abc") == 0 and safe_cut("ab cd") == 2
