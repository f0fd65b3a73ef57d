"""Whether a text holds anything to speak. Every entry point (the server's routes and socket, the offline API,
`legato synth`) refuses a blank text by this one rule: the model asked to say nothing makes noise instead."""

from __future__ import annotations

import unicodedata

# Unicode categories with nothing to say: separators (spaces, line and paragraph breaks), controls (0x00-0x1F,
# 0x7F-0x9F), format characters (zero-width space and joiners, bidi marks, the BOM, soft hyphen), surrogates,
# private-use and unassigned code points, and combining marks standing alone (a mark is spoken with its base
# letter, which is not of these categories).
_SILENT = frozenset({"Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co", "Cn", "Mn", "Me"})


def is_blank(text: str) -> bool:
    """True when `text` holds no character that could be spoken or shown: only spaces and invisible or control
    characters (100 x U+200B, or 0x01-0x1F, is as blank as the empty string)."""
    return all(unicodedata.category(c) in _SILENT for c in text)
