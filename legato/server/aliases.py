"""Names a request may use for another model or voice: OpenAI's, by default (no heavy imports: the CLI reads it)."""

from __future__ import annotations

from collections.abc import Collection, Mapping

# OpenAI's speech model names, taken as this server's model: code written for OpenAI's API runs unchanged. The
# speech route accepts them and /v1/models lists them, both from `model_ids`, so the two never disagree.
OPENAI_TTS_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


def model_ids(served: str) -> list[str]:
    """Every model id a request may name: the served model first (clients read the first card as it), then
    OpenAI's names for it (one the operator took as the served name is not listed twice)."""
    return [served, *(name for name in OPENAI_TTS_MODELS if name != served)]

# OpenAI's voice names (every voice of its speech API) -> presets of the released CustomVoice models, most
# alike first: a male or female voice for a male or female one (a Base model looks the first target up among
# its saved voices). The first entry is the alias; the others stand in on a model without it (the embedded
# tiny model has four of the nine presets), so every OpenAI name works on every CustomVoice model.
_MALE = ("aiden", "ryan", "eric", "dylan", "uncle_fu")
_FEMALE = ("vivian", "serena", "sohee", "ono_anna")
OPENAI_VOICE_PREFERENCES: dict[str, tuple[str, ...]] = {
    "alloy": ("serena", *_FEMALE), "ash": _MALE, "ballad": ("ryan", *_MALE), "coral": _FEMALE,
    "echo": ("ryan", *_MALE), "fable": _MALE, "nova": ("serena", *_FEMALE), "onyx": ("ryan", *_MALE),
    "sage": _FEMALE, "shimmer": ("serena", *_FEMALE), "verse": _MALE, "marin": _FEMALE,
    "cedar": ("ryan", *_MALE),
}
OPENAI_VOICE_ALIASES = {name: targets[0] for name, targets in OPENAI_VOICE_PREFERENCES.items()}


def is_openai_voice(name: str | None) -> bool:
    """Whether `name` is one of OpenAI's voice names (any case)."""
    return name is not None and name.lower() in OPENAI_VOICE_ALIASES


def resolve_alias(name: str, aliases: Mapping[str, str], available: Collection[str]) -> str | None:
    """The voice of `available` (lower-case names) that alias `name` stands for, or None. An OpenAI name whose
    target the model lacks takes the next alike preset it has, and at last the model's first voice in name
    order: a stand-in, chosen the same way on every call. An alias the operator set to another target keeps
    it (None when the model lacks it), and a name the operator dropped (`--voice-alias NAME=`) maps to nothing."""
    target = aliases.get(name)
    if target is None:
        return None
    if target in available:
        return target
    preferences = OPENAI_VOICE_PREFERENCES.get(name)
    if preferences is None or target != preferences[0]:
        return None
    stand_in = next((v for v in preferences if v in available), None)
    return stand_in or min(available, default=None)


def preset_of(name: str, aliases: Mapping[str, str], speakers: Collection[str]) -> str | None:
    """The preset of `speakers` that `name` asks for, spelled as the model spells it: the preset itself (any
    case) or the voice an alias stands for; None when it names neither."""
    by_lower = {s.lower(): s for s in speakers}
    key = name.lower()
    if key not in by_lower:
        key = resolve_alias(key, aliases, by_lower) or key
    return by_lower.get(key)
