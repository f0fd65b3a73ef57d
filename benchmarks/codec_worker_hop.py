"""The CPU a `split` codec worker process spends moving frames in and PCM out, without the decode itself.

The worker side (`codec_process._CodecWorker` and its `LocalCodecClient` thread) runs in this process with a stand-in
codec engine that decodes nothing (`paced_serve.PacedCodec`: each frame it is given comes back on the next step as
80 ms of noise), fed as the server
feeds it: one `CodecFrameBatch` of every stream's frame per talker step, paced at `--step-ms`. It reports the
process's CPU time per step (both threads) and each frame's time from its message to its chunk leaving. Run it
against two trees in one sitting, the tree on PYTHONPATH being the one measured:

    PYTHONPATH=.prev python3 benchmarks/codec_worker_hop.py --out before.json
    PYTHONPATH=. python3 benchmarks/codec_worker_hop.py --out after.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections import Counter

import numpy as np
from paced_serve import PacedCodec  # this script's own folder

import legato.pipeline.codec_process as cp
from legato.engine.codec_schedule import StreamSchedule
from legato.pipeline import messages as m
from legato.pipeline.codec_worker import LocalCodecClient
from legato.pipeline.worker import WorkerSpec


class _Out:
    """The worker's PUSH socket: what it sends and when (decoded after the run, outside the CPU measured)."""

    def __init__(self) -> None:
        self.sent_at: list[tuple[float, list]] = []

    def send_multipart(self, frames) -> asyncio.Future:
        self.sent_at.append((time.perf_counter(), frames))
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


def make_codec() -> LocalCodecClient:
    """A `LocalCodecClient` with the stand-in engine (its constructor builds a real `CodecEngine` from a decoder):
    `paced_serve.PacedCodec` on a schedule of one-frame chunks, so every frame comes back on the next step."""
    import legato.pipeline.codec_worker as cw

    real = cw.CodecEngine
    cw.CodecEngine = lambda *a, **k: PacedCodec(schedule=StreamSchedule(1, 1, chunk_ramp=False))
    try:
        return LocalCodecClient(None)
    finally:
        cw.CodecEngine = real


async def measure(streams: int, steps: int, step_ms: float) -> dict:
    codec = make_codec()
    await codec.start()
    out = _Out()
    worker = cp._CodecWorker(WorkerSpec("-", {}, "hop", "hop-0", "-", "-", os.getppid(), role="codec"), codec, out)
    rids = [f"r{i}" for i in range(streams)]
    for rid in rids:
        await worker.handle(m.CodecOpen(rid))
    frame = np.zeros((1, 16), np.int64)
    posted: list[float] = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    next_at = wall0
    for step in range(steps):
        last = step == steps - 1
        posted.append(time.perf_counter())
        await worker.handle(m.CodecFrameBatch([(rid, frame, last) for rid in rids]))
        next_at += step_ms / 1000
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
    deadline = time.monotonic() + 30
    # This tree's open streams, or the tree before's (a task each).
    open_streams = worker.streams if hasattr(worker, "streams") else worker.tasks
    while open_streams:
        if time.monotonic() > deadline:
            raise RuntimeError("the streams did not end within 30 s")
        await asyncio.sleep(0.005)
    for _ in range(3):  # the last pass's chunks leave
        await asyncio.sleep(0)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    await codec.stop(1.0)
    # Each frame's time from its step's message to the message carrying its chunk (frame k of every stream).
    seen: Counter[str] = Counter()
    lat = []
    for at, frames in out.sent_at:
        for rid, chunk in _chunks(m.decode(frames)):
            if chunk.audio.size:
                k = seen[rid]
                seen[rid] += 1
                lat.append((at - posted[k]) * 1000)
    lat.sort()
    return {"streams": streams, "steps": steps, "step_ms": step_ms, "cpu_ms_per_step": 1000 * cpu / steps,
            "cpu_share": cpu / wall, "hop_ms_p50": statistics.median(lat), "hop_ms_p99": lat[int(0.99 * len(lat))],
            "hop_ms_max": lat[-1], "frames": len(lat)}


def _chunks(msg: m.Message) -> list:
    if isinstance(msg, m.Chunks):
        return msg.chunks
    return [(msg.request_id, msg.chunk)] if isinstance(msg, m.Chunk) else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--step-ms", type=float, default=6.5, help="the talker's step (~150 steps a second at c=64)")
    ap.add_argument("--out")
    args = ap.parse_args()
    row = asyncio.run(measure(args.streams, args.steps, args.step_ms))
    row["tree"] = os.path.dirname(os.path.dirname(cp.__file__))
    print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
