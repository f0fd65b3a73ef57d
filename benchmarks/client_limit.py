"""What the bench client alone can sustain: `legato bench serve` against `legato bench standin`.

For each concurrency it starts a stand-in making audio at `--speed` x real time per stream, runs the bench
(fixed lengths, all requests at once, `--client-procs` processes) and records the client's audio-s/s against
what the stand-in offered, the client's TTFP (the stand-in writes a first chunk one step after a request
arrives, so TTFP above a step is the client's own delay or the host's), and the stand-in's own lateness.

    python3 benchmarks/client_limit.py --concurrency 64,256,512 --frames 25 --speed 2 --out docs/benchmarks/x

`--baseline TREE` runs an older tree's bench (e.g. main's, PYTHONPATH=TREE) on the same stand-in for a before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def prompt_list(folder: Path, n: int) -> Path:
    (folder / "en").mkdir(parents=True, exist_ok=True)
    rows = [f"utt{i:05d}|ref|none.wav|The kettle clicked off just as the rain began." for i in range(n)]
    (folder / "en" / "meta.lst").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return folder


def start_standin(python: str, speed: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([python, "-m", "legato.cli", "bench", "standin", "--port", "0", "--speed", str(speed)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    m = re.search(r"http://127\.0\.0\.1:\d+", proc.stdout.readline())
    if not m:
        proc.kill()
        raise RuntimeError("the stand-in did not start")
    return proc, m.group(0)


def run_cell(args, bench_cmd: list[str], pythonpath: str, conc: int, procs: int, data: Path, out: Path,
             label: str) -> dict:
    standin, url = start_standin(args.python, args.speed)
    try:
        n = conc * args.waves
        cmd = [*bench_cmd, "bench", "serve", "--base-url", url, "--dataset-path", str(data), "--num-prompts", str(n),
               "--fixed-length", "--min-frames", str(args.frames), "--max-frames", str(args.frames),
               "--max-concurrency", str(conc), "--num-warmups", "2", "--no-progress", "--result-dir", str(out),
               "--label", label]
        if procs > 1:
            cmd += ["--client-procs", str(procs)]
        started = time.perf_counter()
        # Run from the tree itself: `python -m` puts the working directory first on sys.path.
        done = subprocess.run(cmd, cwd=pythonpath, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": pythonpath})
        wall = time.perf_counter() - started
        health = httpx.get(f"{url}/health", timeout=10).json()["standin"]
    finally:
        standin.terminate()
        standin.wait(30)
    if done.returncode != 0:
        raise RuntimeError(f"bench failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads((out / f"{label}-server-c{conc}.json").read_text())
    agg = result["aggregates"]
    step_s = 1920 / 24000 / args.speed
    # All requests at once, `waves` rounds: the stand-in offers conc streams x speed while every slot is busy.
    offered = conc * args.speed
    return {"label": label, "concurrency": conc, "client_procs": procs, "requests": n,
            "completed": agg["completed"], "failed": agg["failed"],
            "audio_throughput": agg["audio_throughput"], "offered_audio_per_s": offered,
            "ttfp_ms_p50": agg["ttfp_ms"]["median"], "ttfp_ms_p99": agg["ttfp_ms"]["p99"],
            "standin_step_ms": step_s * 1000, "e2el_ms_p50": agg["e2el_ms"]["median"],
            "ideal_e2el_ms": args.frames * step_s * 1000, "standin": health, "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="64,256,512")
    p.add_argument("--client-procs", default="1", help="comma list: each concurrency runs with each")
    p.add_argument("--frames", type=int, default=25, help="frames per request (fixed)")
    p.add_argument("--speed", type=float, default=2.0, help="stand-in speed, x real time per stream")
    p.add_argument("--waves", type=int, default=2, help="requests = waves x concurrency")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--baseline", default=None, help="a tree whose bench runs as 'before' (PYTHONPATH=TREE)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    concs = [int(c) for c in args.concurrency.split(",")]
    procs = [int(c) for c in args.client_procs.split(",")]
    data = prompt_list(Path(tempfile.mkdtemp(prefix="client-limit-")), max(concs) * args.waves)
    variants = [("new", str(ROOT))] + ([("before", str(Path(args.baseline).resolve()))] if args.baseline else [])
    cells = []
    for conc in concs:
        for name, tree in variants:
            for pr in procs if name == "new" else [1]:
                label = f"{name}-p{pr}"
                cell = run_cell(args, [args.python, "-m", "legato.cli"], tree, conc, pr, data, out / "runs", label)
                cell["variant"] = name
                cells.append(cell)
                print(f"c={conc:4d} {label:10s} {cell['audio_throughput']:7.1f}/{cell['offered_audio_per_s']:.0f} "
                      f"audio-s/s  TTFP p50 {cell['ttfp_ms_p50']:7.1f} p99 {cell['ttfp_ms_p99']:7.1f} ms  "
                      f"E2EL p50 {cell['e2el_ms_p50']:7.1f} (ideal {cell['ideal_e2el_ms']:.0f})  "
                      f"stand-in late ticks {cell['standin']['late_ticks']}/{cell['standin']['ticks']} "
                      f"busy {cell['standin']['busy_s']:.2f} s  failed {cell['failed']}", flush=True)
    (out / "client_limit.json").write_text(json.dumps({"argv": sys.argv, "frames": args.frames, "speed": args.speed,
                                                       "waves": args.waves, "cpus": os.cpu_count(),
                                                       "cells": cells}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
