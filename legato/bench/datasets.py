"""Prompt sets in the Seed-TTS-eval `meta.lst` format, and the speech request bodies built from them.

A list file has one utterance per line, `utt_id|prompt_text|prompt_wav|target_text`, where `prompt_wav` is
relative to the folder holding the list. Blank lines and `#` comments are skipped; a line with fewer than
four fields or an empty target is skipped with a warning (kept in `Dataset.warnings`). A fifth field (the
design variant's voice description, or a ground-truth wav) is ignored. Sampling is deterministic:
`random.Random(seed).shuffle(rows)` then the first N, the same recipe that derived `meta_100.lst` from
`meta.lst` in our prompt corpus.

Modes: `clone` (ref audio as a base64 data URL + ref text), `xvec` (ref audio, `x_vector_only_mode`),
`voice` (a preset speaker), `design` (a VoiceDesign model: a fixed voice description as `instructions`).
`DEFAULT_DATASET`, shipped inside the package, is used when no list is given. The fixed-length mode is for
random-weight models that never emit EOS at a natural point: the server is asked to ignore EOS and generate
`clamp(round(chars × frames_per_char), min, max)` frames of 80 ms, so every topology does the same work for
the same prompt.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass, field
from pathlib import Path

# Locale folder → the language name sent in requests (the Qwen3-TTS language names).
LOCALE_LANGUAGE = {
    "en": "English", "zh": "Chinese", "ja": "Japanese", "ko": "Korean", "de": "German", "fr": "French",
    "ru": "Russian", "pt": "Portuguese", "es": "Spanish", "it": "Italian",
}
MODES = ("clone", "xvec", "voice", "design")
DEFAULT_DATASET = Path(__file__).parent / "data"  # 48 CMU ARCTIC prompts, 8 voices: data/README.md
DESIGN_INSTRUCTIONS = "A clear, calm adult voice reading at an even pace."


class DatasetError(ValueError):
    pass


@dataclass(frozen=True)
class Prompt:
    utt_id: str
    prompt_text: str
    prompt_wav: Path  # resolved against the list's folder
    text: str  # the text to synthesise


@dataclass
class Dataset:
    path: Path
    locale: str | None
    rows: list[Prompt]
    warnings: list[str] = field(default_factory=list)


def parse_meta_lst(path: str | Path) -> Dataset:
    """Read one list file (see the module doc for the format)."""
    path = Path(path)
    rows: list[Prompt] = []
    warnings: list[str] = []
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.rstrip("\r\n")
            if not line.strip() or line.startswith("#"):
                continue
            parts = line.split("|")
            if len(parts) < 4:
                warnings.append(f"{path}:{lineno}: {len(parts)} fields, expected 4; skipped")
                continue
            utt_id, prompt_text, wav, text = (p.strip() for p in parts[:4])
            if not text:
                warnings.append(f"{path}:{lineno}: empty target text; skipped")
                continue
            rows.append(Prompt(utt_id, prompt_text, path.parent / wav, text))
    locale = path.parent.name if path.parent.name in LOCALE_LANGUAGE else None
    return Dataset(path, locale, rows, warnings)


def resolve_list(root: str | Path, locale: str | None = "en", meta_name: str = "meta.lst") -> Path:
    """The list file for `root`: a list file itself, `<root>/<locale>/<meta_name>`, or `<root>/<meta_name>`."""
    root = Path(root)
    if root.is_file():
        return root
    candidates = ([root / locale / meta_name] if locale else []) + [root / meta_name]
    for c in candidates:
        if c.is_file():
            return c
    raise DatasetError(f"no prompt list found: tried {', '.join(str(c) for c in candidates)}")


def sample(rows: list, num: int | None, seed: int, flag: str | None = None, by_default: bool = False) -> list:
    """`random.Random(seed).shuffle(rows)` then the first `num` (all of them when None). `flag` names the option
    that asked for `num` (`by_default`: its default did) in the error when the list is shorter."""
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    if num is None:
        return rows
    if num < 1:
        raise DatasetError(f"asked for {num} prompts: give 1 or more")
    if num > len(rows):
        if flag is None:
            raise DatasetError(f"asked for {num} prompts but the list has {len(rows)}")
        source = f"{flag}, {num} by default" if by_default else flag
        raise DatasetError(f"asked for {num} prompts ({source}) but the list has {len(rows)}: give {flag} "
                           f"{len(rows)} or fewer")
    return rows[:num]


def load_prompts(root: str | Path, locale: str | None = "en", num_prompts: int | None = None, seed: int = 0,
                 meta_name: str = "meta.lst", flag: str | None = None, by_default: bool = False) -> Dataset:
    """Resolve, parse and sample a prompt list; `Dataset.rows` holds the sample in benchmark order (`flag`,
    `by_default`: see `sample`)."""
    ds = parse_meta_lst(resolve_list(root, locale, meta_name))
    if not ds.rows:
        raise DatasetError(f"{ds.path}: no usable rows")
    ds.rows = sample(ds.rows, num_prompts, seed, flag, by_default)
    return ds


@dataclass(frozen=True)
class FixedLength:
    """`num_frames = clamp(round(len(text) * frames_per_char), min_frames, max_frames)`, with EOS ignored."""

    frames_per_char: float = 0.8  # ≈ 15.6 chars/s of English at 12.5 frames/s
    min_frames: int = 4
    max_frames: int = 250

    def __post_init__(self) -> None:
        if self.frames_per_char <= 0 or not 1 <= self.min_frames <= self.max_frames:
            raise DatasetError(f"bad fixed-length settings {self}: need frames_per_char > 0, 1 <= min <= max")

    def frames(self, text: str) -> int:
        return max(self.min_frames, min(self.max_frames, round(len(text) * self.frames_per_char)))

    def describe(self) -> str:
        return (f"ignore_eos=true, num_frames = clamp(round(len(text) * {self.frames_per_char:g}), "
                f"{self.min_frames}, {self.max_frames}) frames of 80 ms")


@dataclass(frozen=True)
class RequestSpec:
    """How prompts become request bodies."""

    mode: str = "clone"
    voice: str | None = None  # preset speaker, for mode "voice"
    language: str | None = None  # None: from the locale folder, else not sent
    fixed_length: FixedLength | None = None
    max_new_tokens: int | None = None
    seed: int | None = None  # request i sends seed + i
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise DatasetError(f"unknown mode {self.mode!r}; choose from {MODES}")
        if self.mode == "voice" and not self.voice:
            raise DatasetError("mode 'voice' needs a preset voice name (--voice)")


@dataclass(frozen=True)
class BenchRequest:
    utt_id: str
    body: dict  # the JSON body minus the transport fields the client sets (model, stream, formats)
    text_chars: int
    num_frames: int | None


def data_url(path: Path) -> str:
    return "data:audio/wav;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def build_requests(ds: Dataset, spec: RequestSpec) -> list[BenchRequest]:
    """One body per sampled row. Missing reference clips are an error in the modes that send them."""
    language = spec.language or LOCALE_LANGUAGE.get(ds.locale or "")
    clips: dict[Path, str] = {}
    if spec.mode in ("clone", "xvec"):
        missing = sorted({str(p.prompt_wav) for p in ds.rows if not p.prompt_wav.is_file()})
        if missing:
            raise DatasetError(f"{len(missing)} reference clip(s) missing, e.g. {missing[:3]}")
    out = []
    for i, p in enumerate(ds.rows):
        body: dict = {"input": p.text}
        if language:
            body["language"] = language
        if spec.mode == "voice":
            body["voice"] = spec.voice
        elif spec.mode == "design":
            body["instructions"] = spec.voice or DESIGN_INSTRUCTIONS
        else:
            if p.prompt_wav not in clips:  # each clip is encoded once, however many rows share it
                clips[p.prompt_wav] = data_url(p.prompt_wav)
            body["ref_audio"] = clips[p.prompt_wav]
            if spec.mode == "clone":
                body["ref_text"] = p.prompt_text
            else:
                body["x_vector_only_mode"] = True
        frames = spec.fixed_length.frames(p.text) if spec.fixed_length else None
        if frames is not None:
            body["ignore_eos"] = True
            body["num_frames"] = frames
        if spec.max_new_tokens is not None:
            body["max_new_tokens"] = spec.max_new_tokens
        if spec.seed is not None:
            body["seed"] = spec.seed + i
        body.update(spec.extra_body)
        out.append(BenchRequest(p.utt_id, body, len(p.text), frames))
    return out
