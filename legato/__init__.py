"""legato: a serving engine for Qwen3-TTS codec text-to-speech models."""

__version__ = "0.1.0"
