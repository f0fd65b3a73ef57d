"""Qwen3-TTS 12 Hz: our own implementation of the talker, code predictor, speaker encoder and codec."""
