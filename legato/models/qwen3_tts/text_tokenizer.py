"""The Qwen2 byte-level BPE text tokenizer, built on the `tokenizers` library from `vocab.json` + `merges.txt`
plus the added tokens listed in `tokenizer_config.json` (Qwen3-TTS model repos ship no `tokenizer.json`).

Pre-tokenisation uses the Qwen2 split pattern, i.e. what a Hub-id load gives. The official wrapper loads a
*local* directory with `fix_mistral_regex=True`, which under transformers 4.57.x swaps in a different regex
for vocabularies over 100k (shared/reference/qwen3-tts-model.md §8.4); we do not reproduce that accident.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .config import ConfigError

QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


class TextTokenizer:
    """Text -> token ids for prompts. Thread-safe for encoding (the Rust tokenizer is)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextTokenizer:
        model_dir = Path(model_dir)
        for name in TOKENIZER_FILES:
            if not (model_dir / name).is_file():
                raise ConfigError(f"missing tokenizer file: {model_dir / name}")
        try:
            vocab = json.loads((model_dir / "vocab.json").read_text(encoding="utf-8"))
            tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
            merges = _read_merges(model_dir / "merges.txt")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
            raise ConfigError(f"cannot read the tokenizer in {model_dir}: {e}") from e
        added = _added_tokens(tok_cfg)
        # Added tokens go into the BPE vocabulary at their declared ids, so `add_special_tokens` reuses
        # those ids instead of appending new ones after the last vocabulary id.
        taken = {i: t for t, i in vocab.items()}
        for tok_id, content, _special in added:
            if taken.get(tok_id, content) != content:
                raise ConfigError(
                    f"{model_dir / 'tokenizer_config.json'}: added token {content!r} takes id {tok_id}, "
                    f"which vocab.json gives to {taken[tok_id]!r}"
                )
            vocab.setdefault(content, tok_id)
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        tok = Tokenizer(bpe)
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [AddedToken(c, special=True, normalized=False) for _, c, special in added if special]
        )
        tok.add_tokens([AddedToken(c, special=False, normalized=False) for _, c, special in added if not special])
        for tok_id, content, _ in added:
            if tok.token_to_id(content) != tok_id:
                raise ConfigError(
                    f"{model_dir / 'tokenizer_config.json'}: added token {content!r} cannot take id {tok_id}"
                )
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def _read_merges(path: Path) -> list[tuple[str, str]]:
    merges = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line or line.startswith("#version"):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError(f"bad merges line {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


def _added_tokens(tok_cfg: dict) -> list[tuple[int, str, bool]]:
    decoder = tok_cfg.get("added_tokens_decoder", {})
    out = []
    for key, entry in decoder.items():
        out.append((int(key), entry["content"], bool(entry.get("special", True))))
    return sorted(out)
