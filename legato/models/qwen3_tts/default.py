"""The embedded default model: a tiny random-weight CustomVoice checkpoint written on first use.

It lets `legato synth` and `legato serve` start on a machine with nothing downloaded, through the same
loading code a real checkpoint takes. Its audio is noise (random weights), but its length follows the text
as a real model's does (about 4 frames, 0.3 s, per text token): its EOS is wired to fire once the text is
spoken for (`testing.shape_eos_for_length_`), so a first request finishes by itself in seconds.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from .testing import write_checkpoint
from .tiny import tiny_config, tiny_speech_tokenizer_config

log = logging.getLogger(__name__)

# v2: the length-following EOS (v1, which never stopped, may still sit in old caches; it is not read).
DEFAULT_MODEL_NAME = "legato-tiny-random-customvoice-v2"
FRAMES_PER_TOKEN = 4.0
DEFAULT_SPEAKER = "ryan"


def cache_dir() -> Path:
    root = os.environ.get("LEGATO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "legato")
    return Path(root)


def default_model_dir() -> Path:
    """Path of the embedded default checkpoint, writing it first if needed (atomically: a crash or a
    concurrent writer never leaves a half-written directory behind)."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / "speech_tokenizer" / "model.safetensors").is_file() and (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        write_checkpoint(tmp, tiny_config("custom_voice"), tiny_speech_tokenizer_config(), seed=0,
                         frames_per_token=FRAMES_PER_TOKEN)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.warning(
        "wrote the embedded default model to %s: it has RANDOM weights, so its audio is noise; "
        "pass --model /path/to/Qwen3-TTS-12Hz-0.6B-CustomVoice (or a hub id) for real speech",
        target,
    )
    return target
