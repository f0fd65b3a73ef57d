"""Shared fixtures of the bench tests: a small prompt folder in the Seed-TTS-eval layout."""

from __future__ import annotations

import shutil
from pathlib import Path

DATA = Path(__file__).parent / "data"

SENTENCES = [
    "The kettle clicked off just as the rain began.",
    "Seven small boats waited in the harbour.",
    "Turn left at the bakery and keep walking.",
    "Nobody expected the old clock to chime again.",
    "A quiet evening is all she asked for.",
    "The map was folded wrong, so the river looked short.",
    "He counted the stairs twice on the way down.",
    "Bright lanterns hung above the market stalls.",
    "Our train leaves at a quarter past nine.",
    "The garden gate creaks whenever the wind turns.",
]
PROMPT_TEXT = "A short reference sentence spoken in a steady voice."


def write_prompt_dir(root: Path, n: int = 8, locale: str = "en") -> Path:
    """`root/<locale>/meta.lst` with n rows (utt000..), all sharing `prompt-wavs/voice01.wav`; returns root."""
    folder = root / locale
    (folder / "prompt-wavs").mkdir(parents=True, exist_ok=True)
    shutil.copy(DATA / "voice01.wav", folder / "prompt-wavs" / "voice01.wav")
    lines = [f"utt{i:03d}|{PROMPT_TEXT}|prompt-wavs/voice01.wav|{SENTENCES[i % len(SENTENCES)]}" for i in range(n)]
    (folder / "meta.lst").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root
