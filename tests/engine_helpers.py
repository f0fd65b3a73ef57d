"""Shared helpers for engine tests: tiny checkpoints per model type and a drive-to-completion loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from legato.engine.config import EngineConfig
from legato.engine.engine import Engine, EngineRequest
from legato.models.qwen3_tts.loader import LoadedModel, load_model
from legato.models.qwen3_tts.testing import write_checkpoint
from legato.models.qwen3_tts.tiny import tiny_config

_CACHE: dict[str, LoadedModel] = {}


def tiny_model(tmp_root: Path, model_type: str, eos_logit_scale: float | None = None) -> LoadedModel:
    key = f"{model_type}-{eos_logit_scale}"
    if key not in _CACHE:
        d = write_checkpoint(tmp_root / key, tiny_config(model_type), eos_logit_scale=eos_logit_scale)
        _CACHE[key] = load_model(d)
    return _CACHE[key]


def engine_config(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", max_num_seqs=8, num_kv_blocks=256, max_model_len=1024,
                max_num_batched_tokens=256, block_size=16)
    base.update(kw)
    return EngineConfig(**base)


@dataclass
class Collected:
    codes: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    audio: dict[str, list[np.ndarray]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)
    finish_count: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str | None] = field(default_factory=dict)
    error_codes: dict[str, str | None] = field(default_factory=dict)

    def frames(self, rid: str) -> torch.Tensor:
        parts = self.codes.get(rid, [])
        return torch.cat(parts) if parts else torch.zeros(0, 16, dtype=torch.long)

    def pcm(self, rid: str) -> np.ndarray:
        parts = self.audio.get(rid, [])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)

    def take(self, outputs) -> None:
        for o in outputs:
            self.codes.setdefault(o.request_id, []).append(o.codes)
            if o.audio is not None:
                self.audio.setdefault(o.request_id, []).append(o.audio)
            if o.finished:
                self.finished[o.request_id] = o.finish_reason
                self.finish_count[o.request_id] = self.finish_count.get(o.request_id, 0) + 1
                self.errors[o.request_id] = o.error
                self.error_codes[o.request_id] = o.error_code


def run_all(engine: Engine, requests: list[EngineRequest], join_at: dict[int, list[EngineRequest]] | None = None,
            max_steps: int = 10_000) -> Collected:
    """Adds `requests`, then steps until all finish; `join_at[step]` adds more requests mid-run."""
    out = Collected()
    for r in requests:
        engine.add_request(r)
    step = 0
    join_at = dict(join_at or {})
    while engine.has_unfinished() or join_at:
        for r in join_at.pop(step, []):
            engine.add_request(r)
        out.take(engine.step())
        step += 1
        assert step < max_steps, "engine did not finish"
    return out
