"""The rules every client text obeys, in a request or in stored data (saved voices): valid Unicode, and
text to speak holds something speakable.

JSON escapes and form charsets can both produce lone surrogates ("\\ud800"). No tokenizer, log line or JSON
response can encode them, so text holding one fails wherever it goes next; it is refused where it enters.
"""

from __future__ import annotations

import unicodedata

# Unicode categories with nothing to say: separators (spaces, line and paragraph breaks), controls (0x00-0x1F,
# 0x7F-0x9F), format characters (zero-width space and joiners, bidi marks, the BOM, soft hyphen), surrogates,
# private-use and unassigned code points, and combining marks standing alone (a mark is spoken with its base
# letter, which is not of these categories).
_SILENT = frozenset({"Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co", "Cn", "Mn", "Me"})


def check_unicode(text: str) -> str:
    """`text` unchanged, or ValueError when it cannot be encoded as UTF-8 (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError("must be valid Unicode text (no lone surrogates)") from e
    return text


def is_blank(text: str) -> bool:
    """True when `text` holds no character that could be spoken or shown: only spaces and invisible or control
    characters (100 x U+200B, or 0x01-0x1F, is as blank as the empty string: the model would be asked to say
    nothing and would make noise instead)."""
    return all(unicodedata.category(c) in _SILENT for c in text)
