"""Shared pieces of the server tests: tiny models, engine clients, a live uvicorn server in a thread, and a
scriptable fake `EngineClient` for failure paths the real engine cannot be made to hit on demand."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import torch
import uvicorn

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.loader import LoadedModel, load_model
from legato.models.qwen3_tts.testing import write_checkpoint
from legato.models.qwen3_tts.tiny import tiny_config
from legato.pipeline.client import (
    EngineClient,
    EngineStats,
    ModelInfo,
    RequestRejected,
    StreamChunk,
    SynthesisRequest,
)
from legato.pipeline.local import LocalEngineClient
from legato.server.settings import ServerSettings

SAMPLES_PER_FRAME = 1920
SAMPLE_RATE = 24000
_MODELS: dict[str, LoadedModel] = {}


def tiny_loaded(root: Path, model_type: str) -> LoadedModel:
    """A tiny random model of `model_type`, loaded once per test session (engines share it read-only)."""
    torch.set_num_threads(1)
    if model_type not in _MODELS:
        d = root / f"tiny-{model_type}"
        if not (d / "model.safetensors").is_file():
            write_checkpoint(d, tiny_config(model_type))
        _MODELS[model_type] = load_model(d)
    return _MODELS[model_type]


def engine_config(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", max_num_seqs=8, num_kv_blocks=512, max_model_len=1024,
                max_num_batched_tokens=512, block_size=16, first_chunk_frames=1, chunk_frames=4)
    base.update(kw)
    return EngineConfig(**base)


def local_client(loaded: LoadedModel, name: str = "tiny", **engine_kw) -> LocalEngineClient:
    """A fresh client (its engine thread can start only once, so every app gets its own)."""
    return LocalEngineClient(loaded, engine_config(**engine_kw), name=name)


def server_settings(loaded: LoadedModel | None = None, **kw) -> ServerSettings:
    base = dict(default_max_new_tokens=12, max_new_tokens_limit=64, request_timeout_s=60.0, shutdown_grace_s=5.0)
    if loaded is not None:
        base["generation_defaults"] = dict(loaded.generation_defaults)
    base.update(kw)
    return ServerSettings(**base)


class LiveServer:
    """A real uvicorn server on 127.0.0.1 (a free port picked by the OS) in a daemon thread."""

    def __init__(self, app, start_timeout: float = 60.0, **config) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on", timeout_graceful_shutdown=5,
                                                    **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.start_timeout = start_timeout

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        assert not self.thread.is_alive(), "the test server did not stop"


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def pcm_samples(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2")


# --- a scriptable fake engine client -------------------------------------------------------------------


class FakeClient(EngineClient):
    """Plays a script per request: `script(req)` returns a list of steps, each a StreamChunk to yield, a
    float (seconds to sleep), or an exception to raise. Records which requests were closed early."""

    def __init__(self, script: Callable[[SynthesisRequest], list], model_type: str = "custom_voice") -> None:
        self.info = ModelInfo(name="fake", model_type=model_type, model_size="0b6", sample_rate=SAMPLE_RATE,
                              languages=["auto", "english"], speakers=["ryan"] if model_type == "custom_voice" else [],
                              hidden_size=64)
        self.script = script
        self.closed_early: list[str] = []
        self.finished: list[str] = []
        self.alive = True
        self.started = self.stopped = False

    async def start(self) -> None:
        self.started = True

    async def stop(self, grace_s: float = 10.0) -> None:
        self.stopped = True

    def is_alive(self) -> bool:
        return self.alive

    async def generate(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        done = False
        try:
            for step in self.script(req):
                if isinstance(step, BaseException):
                    raise step
                if isinstance(step, (int, float)):
                    await asyncio.sleep(step)
                    continue
                done = step.finished
                yield step
            done = True
        finally:
            (self.finished if done else self.closed_early).append(req.request_id)

    async def abort(self, request_id: str, reason: str = "aborted") -> None:
        pass

    async def extract_voice(self, samples, sample_rate):
        raise RequestRejected(400, "no voices in the fake")

    def stats(self) -> EngineStats:
        return EngineStats(num_kv_blocks=8, free_kv_blocks=8)


def frames_chunk(n_new: int, total: int, finished: bool = False, reason: str | None = None,
                 error: str | None = None) -> StreamChunk:
    audio = np.full(n_new * SAMPLES_PER_FRAME, 0.25, dtype=np.float32)
    return StreamChunk(audio=audio, num_frames=total, num_prompt_tokens=7, finished=finished,
                       finish_reason=reason, error=error, seed=11)


def rejected(status: int, message: str, retry_after: float | None = None, code: str | None = None) -> RequestRejected:
    return RequestRejected(status, message, retry_after, code)
