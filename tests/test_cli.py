"""`legato synth` writes a valid 24 kHz WAV on the embedded default model."""

from __future__ import annotations

import subprocess
import sys

import soundfile as sf


def test_synth_writes_a_wav_on_the_embedded_default(tmp_path):
    out = tmp_path / "out.wav"
    env_cache = tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, "-m", "legato.cli", "synth", "--text", "Hello there.", "--out", str(out),
         "--max-new-tokens", "12", "--seed", "3"],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "LEGATO_CACHE": str(env_cache)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM weights" in proc.stderr
    audio, sr = sf.read(out)
    assert sr == 24000
    assert 0 < len(audio) <= 11 * 1920 and len(audio) % 1920 == 0
    assert abs(audio).max() <= 1.0


def test_synth_rejects_bad_input_with_a_message(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "legato.cli", "synth", "--text", "Hi", "--out", str(tmp_path / "x.wav"),
         "--voice", "nobody", "--max-new-tokens", "4"],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "LEGATO_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 2
    assert "unknown speaker" in proc.stderr
    assert not (tmp_path / "x.wav").exists()
