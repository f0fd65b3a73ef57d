"""Our tokenizers-based Qwen2 BPE equals transformers' Qwen2 tokenizers on the same files."""

from __future__ import annotations

import json

import pytest

from legato.models.qwen3_tts.config import ConfigError
from legato.models.qwen3_tts.prompt import target_text_ids
from legato.models.qwen3_tts.testing import SPECIAL_TOKENS, write_text_tokenizer
from legato.models.qwen3_tts.text_tokenizer import TextTokenizer

SAMPLES = [
    "Hello world, 你好!",
    "I'm fine, it's 12:30  and   we'll\n\nmeet at 7 p.m.",
    "camelCaseWordsHERE and ÄÖÜ, naïve café",
    "  leading and trailing spaces  ",
    "emoji 🎉 and tabs\tand\r\nwindows lines",
    "今天天气很好，我们一起去公园散步吧。",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_text_tokenizer(d)
    return d


@pytest.mark.parametrize("text", SAMPLES)
def test_matches_transformers(tok_dir, text):
    from transformers import Qwen2Tokenizer, Qwen2TokenizerFast

    ours = TextTokenizer.from_dir(tok_dir)
    fast = Qwen2TokenizerFast(vocab_file=str(tok_dir / "vocab.json"), merges_file=str(tok_dir / "merges.txt"))
    slow = Qwen2Tokenizer(vocab_file=str(tok_dir / "vocab.json"), merges_file=str(tok_dir / "merges.txt"))
    ids = ours.encode(text)
    assert ids == fast.encode(text, add_special_tokens=False)
    assert ids == slow.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text


def test_special_tokens_keep_their_ids(tok_dir):
    tok = TextTokenizer.from_dir(tok_dir)
    for tok_id, content in SPECIAL_TOKENS.items():
        assert tok.token_to_id(content) == tok_id
        assert tok.encode(f"a{content}b")[1] == tok_id


def test_template_has_the_positional_layout(tok_dir):
    tok = TextTokenizer.from_dir(tok_dir)
    ids = target_text_ids(tok, "Hi there")
    assert ids[0] == 151644 and ids[-5] == 151645 and ids[-3] == 151644
    assert ids[1] == ids[-2] == tok.token_to_id("assistant")
    assert tok.decode(ids[3:-5]) == "Hi there"


def test_bad_tokenizer_config_is_named(tmp_path):
    write_text_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"]["5"] = {"content": "<clash>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "vocab.json").write_text(json.dumps({**json.loads((tmp_path / "vocab.json").read_text())}))
    with pytest.raises(ConfigError, match="tokenizer_config.json"):
        TextTokenizer.from_dir(tmp_path)
    (tmp_path / "merges.txt").write_text("#version: 0.2\nbroken-line-without-space-pair x y\n")
    with pytest.raises(ConfigError, match="tokenizer"):
        TextTokenizer.from_dir(tmp_path)
