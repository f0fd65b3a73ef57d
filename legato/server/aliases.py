"""Voice names a request may use for another voice: OpenAI's, by default (no heavy imports: the CLI reads it)."""

# OpenAI's voice names -> presets of the released CustomVoice models (a Base model looks the target up among
# its saved voices). An alias whose target the served model lacks is simply not offered.
OPENAI_VOICE_ALIASES = {
    "alloy": "serena", "ash": "aiden", "ballad": "ryan", "coral": "vivian", "echo": "ryan", "fable": "aiden",
    "nova": "serena", "onyx": "ryan", "sage": "vivian", "shimmer": "serena", "verse": "aiden", "marin": "vivian",
    "cedar": "ryan",
}
