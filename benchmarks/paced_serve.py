"""`legato serve` with a paced stand-in for the engine: every front-side piece is the real one (LocalEngineClient's
engine thread, admission thread and hand-over to the event loop, the FastAPI app, the encoders, uvicorn), but
the engine makes one frame of noise per running request every `--step-ms`, with no model, and split's codec worker
decodes nothing (`PacedCodec`): so on a CPU the server's host path can be loaded at 256 streams and profiled, which
the tiny model's real engine (or its codec) cannot feed.

    python3 benchmarks/paced_serve.py --step-ms 40 -- --port 8000 --max-num-seqs 256

Arguments after `--` go to `legato serve`; with `--workers process` the workers build the stand-in too
(`paced/sitecustomize.py`, which Python imports at start-up from PYTHONPATH).
The tree on PYTHONPATH is the one served, so the same script serves an older tree for a before/after.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch


class PacedEngine:
    """What LocalEngineClient uses of `Engine`, paced: a step every `step_s`, one frame per running request,
    audio out on the engine's chunk schedule (first chunk, then the ramp up to `chunk_frames`)."""

    step_s = 0.04
    real_prompts = False  # build each request's prompt with the model's weights, as the engine does
    # Small torch ops a step (each releases the GIL and must win it back, as the real engine's launches do), so
    # that the engine thread's step time shows what the threads beside it cost it (`--host-ops`).
    host_ops = 0

    def __init__(self, loaded, config) -> None:
        from legato.engine.codec_schedule import next_chunk_frames

        self._next = next_chunk_frames
        self.config = config
        self.loaded = loaded
        self.runner = SimpleNamespace(device=torch.device("cpu"))  # no warm-up: nothing compiles
        self.codec = None
        self.live: dict[str, list] = {}  # id -> [request, frames made, frames sent, next chunk's end]
        self.done: list = []  # aborted: their last output goes out with the next step
        self.scheduler = SimpleNamespace(num_waiting=0, num_running=0)
        self.block_manager = SimpleNamespace(usage=0.0, num_blocks=1024, num_free_blocks=1024)
        self.times = SimpleNamespace(steps=0, decode_rows=0, host_s=0.0, gpu_s=0.0, gap_s=0.0)
        self.text_wait_s, self.num_waiting_for_text = 0.0, 0
        self._frame = (np.random.default_rng(0).standard_normal(1920) * 0.05).astype(np.float32)
        self._ops = (torch.ones(16), torch.ones(16), torch.empty(16))
        self._next_at = time.perf_counter()

    def prepare_prompt(self, spec):
        if not self.real_prompts:
            return None
        try:
            from legato.models.qwen3_tts.prompt_build import build_prompt
        except ImportError:  # a tree from before batched prompts
            from legato.models.qwen3_tts.prompt import build_prompt
        return build_prompt(spec, self.loaded.talker, self.loaded.config)

    def prepare_prompts(self, specs):
        if not self.real_prompts:
            return [None] * len(specs)
        from legato.models.qwen3_tts.prompt_build import build_prompts

        return build_prompts(specs, self.loaded.talker, self.loaded.config)

    def add_request(self, er) -> int:
        if er.request_id in self.live:
            raise ValueError(f"duplicate request id {er.request_id!r}")
        frames = er.max_frames or 25
        first = self.config.first_chunk_frames if self.config.emit_audio else 1  # a talker-only engine: every step
        self.live[er.request_id] = [er, 0, 0, min(first, frames), frames]
        self.scheduler.num_running = len(self.live)
        return er.sampling.seed or 1

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        entry = self.live.pop(request_id, None)
        if entry is not None:
            self.done.append((request_id, entry[1], reason))
        self.scheduler.num_running = len(self.live)
        return entry is not None

    def append_text(self, request_id: str, ids: list[int], close: bool) -> None:
        """Streaming text: the paced request's length is fixed up front, so its text only has to arrive."""
        if request_id not in self.live:
            raise ValueError(f"no running request {request_id!r}")

    def waits_for_text_only(self) -> bool:
        return False  # its requests never wait for text (their length is fixed up front)

    def has_unfinished(self) -> bool:
        return bool(self.live or self.done)

    def step(self) -> list:
        from legato.engine.engine import RequestOutput

        delay = self._next_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        started = time.perf_counter()
        self._next_at = max(self._next_at + self.step_s, started)
        a, b, out = self._ops
        for _ in range(self.host_ops if self.live else 0):
            torch.add(a, b, out=out)
        outs = [RequestOutput(rid, torch.zeros((0, 16), dtype=torch.int64), None, True, reason, num_frames=made)
                for rid, made, reason in self.done]
        self.done = []
        cfg = self.config
        self.times.decode_rows += len(self.live)  # one frame per running request, as the engine counts
        for rid, e in list(self.live.items()):
            # Like the engine: a request's output comes when its next chunk of audio is due, with the codes since.
            e[1] += 1
            made, total = e[1], e[4]
            if made < e[3] and made < total:
                continue
            n = made - e[2]
            e[2] = made
            # A talker-only engine (split's talker, emit_audio off) sends its codes every step, with no audio.
            e[3] = made + (self._next(made, cfg.first_chunk_frames, cfg.chunk_frames, cfg.chunk_ramp)
                           if cfg.emit_audio else 1)
            last = made >= total
            audio = np.tile(self._frame, n) if cfg.emit_audio else None
            outs.append(RequestOutput(rid, torch.zeros((n, 16), dtype=torch.int64), audio, last,
                                      "length" if last else None, num_prompt_tokens=8, num_frames=made, seed=1))
            if last:
                del self.live[rid]
        self.scheduler.num_running = len(self.live)
        self.times.steps += 1
        self.times.host_s += time.perf_counter() - started
        return outs


class PacedCodec:
    """`CodecEngine`'s interface for split's codec worker, decoding nothing: a stream's frames come back as noise on
    the chunk schedule (first chunk, then the ramp), with the rest when it ends, one step per talker hand-over."""

    device = torch.device("cpu")

    def __init__(self, decoder=None, schedule=None, **options) -> None:
        from legato.engine.codec_schedule import StreamSchedule, next_chunk_frames

        self.schedule = schedule or StreamSchedule()
        self._next = next_chunk_frames
        self.streams: dict[str, list] = {}  # id -> [frames pushed, frames sent, next chunk's end, ended]
        self.frames_decoded = 0
        self.failures: Counter[str] = Counter()
        self._frame = (np.random.default_rng(1).standard_normal(1920) * 0.05).astype(np.float32)

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    def warm_up(self) -> float:
        return 0.0

    def open(self, request_id, ref_code=None, first_chunk_frames=None) -> None:
        self.streams[request_id] = [0, 0, first_chunk_frames or self.schedule.first_chunk_frames, False]

    def push(self, request_id, codes) -> bool:
        st = self.streams.get(request_id)
        if st is None:
            return False
        st[0] += len(codes)
        return True

    def end(self, request_id) -> bool:
        st = self.streams.get(request_id)
        if st is not None:
            st[3] = True
        return st is not None

    def abort(self, request_id) -> bool:
        return self.streams.pop(request_id, None) is not None

    def steps(self):
        from legato.pipeline.codec_engine import CodecOutput

        sched, out = self.schedule, []
        for rid, st in list(self.streams.items()):
            pushed, sent, due, ended = st
            if not ended and pushed < due:
                continue
            n = pushed - sent
            st[1] = pushed
            st[2] = pushed + self._next(pushed, sched.first_chunk_frames, sched.chunk_frames, sched.chunk_ramp)
            self.frames_decoded += n
            out.append(CodecOutput(rid, np.tile(self._frame, n), n, finished=ended))
            if ended:
                del self.streams[rid]
        yield out

    def step(self):
        return [o for outs in self.steps() for o in outs]


def install(step_ms: float, real_prompts: bool = False, host_ops: int = 0) -> None:
    """Makes every LocalEngineClient of this process build a PacedEngine (`paced/sitecustomize.py` calls it in
    worker processes, which inherit LEGATO_PACED_STEP_MS, LEGATO_PACED_PROMPTS, LEGATO_PACED_HOST_OPS and
    PYTHONPATH)."""
    import legato.pipeline.codec_worker as codec_worker
    import legato.pipeline.local as local

    codec_worker.CodecEngine = PacedCodec  # split's codec worker (thread or process) decodes nothing either
    PacedEngine.step_s = step_ms / 1000.0
    PacedEngine.real_prompts = real_prompts
    PacedEngine.host_ops = host_ops
    local.Engine = PacedEngine


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=40.0, help="one frame per running request this often")
    p.add_argument("--real-prompts", action="store_true",
                   help="admission builds each request's prompt with the model's weights, as it does for the engine")
    p.add_argument("--host-ops", type=int, default=0,
                   help="small torch ops the engine thread runs each step while requests run (GIL hand-overs)")
    args = p.parse_args(argv[:split])
    here = Path(__file__).resolve().parent
    os.environ["LEGATO_PACED_STEP_MS"] = str(args.step_ms)
    os.environ["LEGATO_PACED_PROMPTS"] = "1" if args.real_prompts else ""
    os.environ["LEGATO_PACED_HOST_OPS"] = str(args.host_ops)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(here / "paced")) if p)
    install(args.step_ms, args.real_prompts, args.host_ops)
    from legato.cli import main as legato_main

    return legato_main(["serve", "--device", "cpu", *argv[split + 1:]])


if __name__ == "__main__":
    sys.exit(main())
