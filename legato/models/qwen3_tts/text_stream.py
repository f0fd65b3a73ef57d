"""Text that arrives in pieces (an LLM writing it), cut where tokenising the pieces one by one gives exactly the
token ids of the whole text tokenised at once.

The Qwen2 tokenizer is a byte-level BPE behind a regex pre-tokeniser (`text_tokenizer.QWEN2_SPLIT_PATTERN`):
BPE merges never cross a pre-token boundary, the pattern has no look-behind, and its only look-ahead
(`\\s+(?!\\S)`) sits in whitespace runs. So a position between two known characters where every possible
continuation still ends a pre-token is safe: the pre-tokens before it are those of the prefix alone, and
those after it are those of the rest alone. `safe_cut` finds the last such position; `TextStream` holds back
what follows it (a possibly incomplete word) until more text, a flush or the close decides it.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field

from .prompt import ROLE_LEN, TARGET_TAIL, TextTokenizer, target_text_ids


def _kind(ch: str) -> str:
    """The pre-tokeniser's view of a character: letter, number, mark, newline, space or punctuation."""
    cat = unicodedata.category(ch)
    if cat[0] == "L":
        return "L"
    if cat[0] == "N":
        return "N"
    if cat[0] == "M":
        return "M"
    if ch in "\r\n":
        return "nl"
    if ch.isspace():
        return "sp"
    return "P"


def is_safe_boundary(before: str, after: str) -> bool:
    """Whether a pre-token always ends between `before` and `after`, whatever text follows.

    - after a letter, unless a letter follows (a letter run goes on) or a combining mark (NFC may fold it);
    - after a digit (digits are single pre-tokens), unless a mark follows;
    - after punctuation, only before a space or a digit: punctuation runs absorb more punctuation and
      newlines, and one punctuation character opens the next letter run (`[^\\r\\n\\p{L}\\p{N}]?\\p{L}+`);
    - never after whitespace (whitespace runs are split by a look-ahead on what follows them).
    """
    a, b = _kind(before), _kind(after)
    if b == "M" or a in ("sp", "nl", "M"):
        return False
    if a == "L":
        return b != "L"
    if a == "N":
        return True
    return b in ("sp", "N")  # a == "P"


def safe_cut(text: str) -> int:
    """The last index i (0 if none) where `text[:i]` can be tokenised apart from whatever comes after it."""
    for i in range(len(text) - 1, 0, -1):
        if is_safe_boundary(text[i - 1], text[i]):
            return i
    return 0


@dataclass
class TextStream:
    """The text of one streaming request as it arrives: `append` returns what may be spoken now (the text up to
    the last safe cut), `flush` and `close` return everything held back. The pieces returned, tokenised with
    `segment_ids`, concatenate to the ids of the whole text (when no flush cut a word)."""

    pending: str = ""
    committed_chars: int = 0
    closed: bool = False
    pieces: list[str] = field(default_factory=list)

    def append(self, text: str) -> str:
        if self.closed:
            raise ValueError("the text is closed")
        self.pending += text
        cut = safe_cut(self.pending)
        return self._take(cut)

    def flush(self) -> str:
        """Everything held back, even mid-word (the next piece then tokenises on its own)."""
        if self.closed:
            raise ValueError("the text is closed")
        return self._take(len(self.pending))

    def close(self) -> str:
        piece = self._take(len(self.pending))
        self.closed = True
        return piece

    def _take(self, cut: int) -> str:
        piece, self.pending = self.pending[:cut], self.pending[cut:]
        self.committed_chars += len(piece)
        if piece:
            self.pieces.append(piece)
        return piece


def segment_ids(tokenizer: TextTokenizer, piece: str, first: bool) -> list[int]:
    """Token ids of one piece of a streamed text. The first piece is tokenised inside the assistant template,
    exactly as `target_text_ids` tokenises a whole text; later ones start at a safe cut and stand alone."""
    if first:
        return target_text_ids(tokenizer, piece)[ROLE_LEN:-TARGET_TAIL]
    return list(tokenizer.encode(piece))
