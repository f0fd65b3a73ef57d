"""The rules every client text obeys, in a request or in stored data (saved voices): valid Unicode, and
text to speak holds something speakable.

JSON escapes and form charsets can both produce lone surrogates ("\\ud800"). No tokenizer, log line or JSON
response can encode them, so text holding one fails wherever it goes next; it is refused where it enters.
"""

from __future__ import annotations

from legato.models.qwen3_tts.blank import is_blank

__all__ = ["check_unicode", "is_blank"]  # is_blank: the models' rule, which the offline API holds too


def check_unicode(text: str) -> str:
    """`text` unchanged, or ValueError when it cannot be encoded as UTF-8 (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError("must be valid Unicode text (no lone surrogates)") from e
    return text

