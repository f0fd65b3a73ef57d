"""Shared by the voice-store and voices-API tests: a fake engine client and the reference clip."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import torch

from legato.models.qwen3_tts.inputs import VoiceFeatures
from legato.pipeline.client import EngineClient, EngineStats, ModelInfo

CLIP = Path(__file__).parent / "data" / "voice01.wav"
HIDDEN = 64  # the tiny model's talker hidden size


class FakeClient(EngineClient):
    """Just enough engine for the voice store: model info and a counted, deterministic `extract_voice`
    (7 reference frames per clip)."""

    def __init__(self, model_type: str = "base", hidden: int = HIDDEN, delay_s: float = 0.0,
                 speakers: list[str] | None = None) -> None:
        self.info = ModelInfo("fake", model_type, "0b6", 24000, ["auto"], list(speakers or []), hidden)
        self.calls = 0
        self.delay_s = delay_s

    async def start(self) -> None: ...

    async def stop(self, grace_s: float = 10.0) -> None: ...

    async def generate(self, req):
        raise AssertionError("the voice store never synthesises")
        yield

    async def abort(self, request_id: str, reason: str = "aborted") -> None: ...

    async def extract_voice(self, samples: np.ndarray, sample_rate: int) -> VoiceFeatures:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        g = torch.Generator().manual_seed(len(samples))
        return VoiceFeatures(torch.randn(self.info.hidden_size, generator=g),
                             torch.randint(0, 2048, (7, 16), generator=g))

    def is_alive(self) -> bool:
        return True

    def stats(self) -> EngineStats:
        return EngineStats()
