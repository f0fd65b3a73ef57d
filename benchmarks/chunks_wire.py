"""One engine step's chunks across the worker link: the CPU cost of writing and reading a `Chunks` message.

At 256 streams every engine step sends one message of 256 chunks (one frame of audio, 1,920 float32 samples, and
its 16 codes each) from the worker to the front. The worker writes it on the event-loop thread that shares the GIL
with the engine thread; the front reads it on its I/O thread. This times both for the tree on PYTHONPATH, so an
old tree and a new one compare in one sitting:

    PYTHONPATH=.base python3 benchmarks/chunks_wire.py --out old.json
    PYTHONPATH=. python3 benchmarks/chunks_wire.py --out new.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

import numpy as np

from legato.pipeline import messages as m
from legato.pipeline.client import StreamChunk


def step_chunks(n: int, finished_every: int = 30) -> list[tuple[str, StreamChunk]]:
    """A step's chunks as the engine makes them: one frame each, a request ending now and then."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        last = i % finished_every == 0
        out.append((f"req-{i:06d}-{rng.integers(1 << 40):010x}", StreamChunk(
            rng.standard_normal(1920).astype(np.float32), int(rng.integers(1, 400)), num_prompt_tokens=40,
            finished=last, finish_reason="length" if last else None, seed=int(rng.integers(1 << 62)),
            codes=rng.integers(0, 2048, (1, 16)))))
    return out


def best_of(fn, repeats: int, rounds: int = 5) -> float:
    """Seconds per call: the best of `rounds` rounds of `repeats` calls (the least disturbed by the box)."""
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - t) / repeats)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="64,256", help="chunks a message, comma list")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for n in (int(x) for x in args.streams.split(",")):
        chunks = step_chunks(n)
        frames = m.encode(m.Chunks(chunks))
        assert [rid for rid, _ in m.decode(frames).chunks] == [rid for rid, _ in chunks]
        enc = best_of(lambda c=chunks: m.encode(m.Chunks(c)), args.repeats)
        dec = best_of(lambda f=frames: m.decode(f), args.repeats)
        rows.append({"streams": n, "encode_ms": round(enc * 1e3, 3), "decode_ms": round(dec * 1e3, 3),
                     "frames": len(frames), "bytes": sum(len(f) for f in frames)})
        print(f"{n} chunks: encode {enc * 1e3:.3f} ms, decode {dec * 1e3:.3f} ms ({len(frames)} frames)")
    tree = os.path.dirname(os.path.dirname(os.path.abspath(m.__file__)))
    try:
        commit = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip() or None
    except OSError:
        commit = None
    result = {"tree": tree, "commit": os.environ.get("LEGATO_COMMIT") or commit, "python": platform.python_version(),
              "cpus": os.cpu_count(), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
