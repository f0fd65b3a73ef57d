"""What the engine loop pays on first use, and where its host waits for the device (issue 22).

One engine, warmed up as the server warms it, then `--bursts` closed-loop bursts of the same requests (as
`engine_loop.py`: `--concurrency` live, each finished one replaced until `--requests` have run). For each
burst it reports audio-s/s, the engine's step timers, the idle gap before steps with and without a prefill,
the slowest steps, and every Triton kernel compiled (in this process) during the burst; torch.compile's
graph count too. The first burst after warm-up against the second says what warm-up leaves to the first
requests. With `--trace-steps N`, a last burst profiles N of its steps (torch.profiler) and attributes
each idle gap of the compute stream to the host phase that ended it (the launch the device waited for),
and gives each phase's host time on steps with a prefill and without. With `--sync-burst`, one more burst
runs under `torch.cuda.set_sync_debug_mode("warn")`: each place the host blocks on the device (other than
the step's own result copy, which waits on an event) is counted by its call stack.

    python3 benchmarks/loop_diag.py --concurrency 64 --requests 256 --bursts 2 --sync-burst --out /tmp/diag.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_loop import add_workload_args, make_request, random_base_model  # noqa: E402

from legato.engine.config import EngineConfig  # noqa: E402
from legato.engine.engine import Engine  # noqa: E402
from legato.engine.step_copies import PendingCopy  # noqa: E402


class Compiles:
    """Triton kernels compiled in this process (the JIT's in-memory cache missed), in order."""

    def __init__(self) -> None:
        self.names: list[str] = []
        try:
            from triton import knobs
        except ImportError:
            return
        previous = knobs.runtime.jit_cache_hook

        def hook(*args, **kwargs):
            self.names.append(str(kwargs.get("repr", "?"))[:300])
            return previous(*args, **kwargs) if previous else None  # None: compile as usual

        knobs.runtime.jit_cache_hook = hook


def dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"].get("unique_graphs", 0))


class SyncStacks:
    """Counts `torch.cuda.set_sync_debug_mode("warn")` warnings by the legato frames of their stack."""

    def __init__(self) -> None:
        self.stacks: Counter[str] = Counter()
        self._shown = warnings.showwarning

    def __enter__(self) -> SyncStacks:
        def show(message, category, filename, lineno, file=None, line=None):
            frames = [f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                      if "legato" in f.filename or "benchmarks" in f.filename]
            self.stacks[f"{str(message)[:80]} | " + " <- ".join(reversed(frames[-6:]))] += 1

        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._shown
        warnings.resetwarnings()


class Phases:
    """Wraps the engine's step phases in `record_function` ranges (names in PHASES) for the trace."""

    def __init__(self, engine: Engine) -> None:
        self.undo = []
        targets = [(engine, "step", "step"), (engine.scheduler, "schedule", "schedule"), (engine, "_start", "start"),
                   (engine.copies, "begin", "begin"), (engine.runner, "prefill", "prefill"),
                   (engine.runner, "decode", "decode"), (engine.copies, "submit", "submit"),
                   (engine.scheduler, "update", "sched_update"), (engine, "_collect", "collect"),
                   (engine, "_audio", "audio")]
        if engine.codec is not None:
            targets.append((engine.codec, "queue", "codec_queue"))
        for obj, name, label in targets:
            self._wrap(obj, name, label)
        wait = PendingCopy.wait

        def timed_wait(copy):
            with torch.profiler.record_function("wait"):
                return wait(copy)

        PendingCopy.wait = timed_wait
        self.undo.append(lambda: setattr(PendingCopy, "wait", wait))

    def _wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)

        setattr(obj, name, timed)
        self.undo.append(lambda: setattr(obj, name, fn))

    def remove(self) -> None:
        for f in reversed(self.undo):
            f()


def analyse_trace(path: str, min_gap_us: float = 20.0) -> dict:
    """Idle gaps of the compute stream (the stream with the most kernels) and the host phase open when each
    ended; host time per phase on steps with a prefill and without."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and "dur" in e]
    by_stream: dict = {}
    for k in kernels:
        by_stream.setdefault(k.get("args", {}).get("stream"), []).append(k)
    if not by_stream:
        return {}
    main = max(by_stream, key=lambda s: len(by_stream[s]))
    ks = sorted(by_stream[main], key=lambda k: k["ts"])
    steps = sorted((r for r in ranges if r["name"] == "step"), key=lambda r: r["ts"])
    inner = [r for r in ranges if r["name"] != "step"]

    def phase_at(t: float) -> str:
        open_now = [r for r in inner if r["ts"] <= t <= r["ts"] + r["dur"]]
        return min(open_now, key=lambda r: r["dur"])["name"] if open_now else "outside phases"

    gaps, by_phase, by_start = [], Counter(), Counter()
    end = ks[0]["ts"] + ks[0]["dur"]
    for k in ks[1:]:
        gap = k["ts"] - end
        if gap >= min_gap_us:
            by_phase[phase_at(k["ts"])] += gap
            by_start[phase_at(end)] += gap
            gaps.append(gap)
        end = max(end, k["ts"] + k["dur"])
    span = end - ks[0]["ts"]
    busy = sum(k["dur"] for k in ks)
    # Per step: which phases, how long; a step "has a prefill" if a prefill range lies inside it.
    per = {"with_prefill": Counter(), "decode_only": Counter()}
    counts = Counter()
    for st in steps:
        a, b = st["ts"], st["ts"] + st["dur"]
        mine = [r for r in inner if a <= r["ts"] and r["ts"] + r["dur"] <= b]
        kind = "with_prefill" if any(r["name"] == "prefill" for r in mine) else "decode_only"
        counts[kind] += 1
        per[kind]["step"] += st["dur"]
        for r in mine:
            per[kind][r["name"]] += r["dur"]
    return {
        "streams": {str(s): len(v) for s, v in by_stream.items()}, "main_stream": str(main),
        "window_ms": span / 1000, "main_busy_ms": busy / 1000, "main_busy_frac": busy / span if span else None,
        "idle_gaps": len(gaps), "idle_ms": sum(gaps) / 1000,
        "idle_ms_by_phase_at_gap_end": {k: v / 1000 for k, v in by_phase.most_common()},
        "idle_ms_by_phase_at_gap_start": {k: v / 1000 for k, v in by_start.most_common()},
        "largest_gaps_us": sorted(gaps, reverse=True)[:12], "steps": dict(counts),
        "host_ms_per_step_by_phase": {kind: {k: v / 1000 / max(1, counts[kind]) for k, v in c.most_common()}
                                      for kind, c in per.items()},
    }


def burst(engine: Engine, lm, args, compiles: Compiles, first_id: int, trace: tuple[int, str] | None = None) -> dict:
    rng = random.Random(0)
    lo, hi = (int(x) for x in args.frames.split(","))
    todo = []
    for i in range(args.requests):
        er = make_request(lm, i, args.mode, rng.randint(lo, hi), args.ref_frames)
        er.request_id = f"b{first_id}-{er.request_id}"
        er.prompt = engine.prepare_prompt(er.spec)
        todo.append(er)
    prefills = [0]
    runner_prefill = engine.runner.prefill

    def counted(work):
        prefills[0] += 1
        return runner_prefill(work)

    engine.runner.prefill = counted
    live: set[str] = set()
    nxt = 0

    def add() -> None:
        nonlocal nxt
        engine.add_request(todo[nxt])
        live.add(todo[nxt].request_id)
        nxt += 1

    for _ in range(args.concurrency):
        add()
    c0, g0 = len(compiles.names), dynamo_graphs()
    t0 = engine.times
    base = (t0.steps, t0.host_s, t0.gpu_s, t0.gap_s)
    samples, steps = 0, []
    started = time.perf_counter()
    prof = None
    while live:
        if trace is not None and len(steps) == args.trace_after:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        if prof is not None and len(steps) == args.trace_after + trace[0]:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(trace[1])
            prof = None
        p0, gap0, n0 = prefills[0], engine.times.gap_s, len(compiles.names)
        s = time.perf_counter()
        outs = engine.step()
        steps.append({"host_ms": 1000 * (time.perf_counter() - s), "prefill": prefills[0] > p0,
                      "gap_ms_accounted": 1000 * (engine.times.gap_s - gap0),
                      "compiled": compiles.names[n0:]})
        for o in outs:
            if o.audio is not None:
                samples += o.audio.size
            if o.finished:
                live.discard(o.request_id)
                if nxt < len(todo):
                    add()
    wall = time.perf_counter() - started
    engine.runner.prefill = runner_prefill
    t = engine.times
    n = t.steps - base[0]
    # The gap accounted while collecting step k (one iteration after its launch) is the idle time before k.
    with_prefill, without = [], []
    for i in range(1, len(steps)):
        (with_prefill if steps[i - 1]["prefill"] else without).append(steps[i]["gap_ms_accounted"])
    host = sorted(x["host_ms"] for x in steps)
    med = statistics.median(host) if host else 0.0
    slow = sorted(({"step": i, **x} for i, x in enumerate(steps) if x["host_ms"] > 3 * med),
                  key=lambda x: -x["host_ms"])[:12]
    return {
        "wall_s": wall, "steps": n, "audio_s_per_s": samples / 24000 / wall,
        "host_ms_per_step": 1000 * (t.host_s - base[1]) / n, "gpu_ms_per_step": 1000 * (t.gpu_s - base[2]) / n,
        "gap_ms_per_step": 1000 * (t.gap_s - base[3]) / n,
        "gpu_busy": (t.gpu_s - base[2]) / max(1e-9, (t.gpu_s - base[2]) + (t.gap_s - base[3])),
        "gap_ms_mean_after_prefill_step": statistics.fmean(with_prefill) if with_prefill else None,
        "gap_ms_mean_after_decode_only_step": statistics.fmean(without) if without else None,
        "steps_with_prefill": len(with_prefill), "steps_decode_only": len(without),
        "host_ms_p50": med, "host_ms_p99": host[int(0.99 * (len(host) - 1))] if host else None,
        "host_ms_max": host[-1] if host else None, "slowest_steps": slow,
        "triton_compiles": compiles.names[c0:], "dynamo_graphs_added": dynamo_graphs() - g0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--bursts", type=int, default=2)
    ap.add_argument("--sync-burst", action="store_true")
    ap.add_argument("--trace-steps", type=int, default=0)
    ap.add_argument("--trace-after", type=int, default=40, help="steps of the traced burst before the window")
    ap.add_argument("--trace-out", default="/tmp/loop-trace.json.gz")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    compiles = Compiles()
    lm = random_base_model(args.size, args.device)
    cfg = EngineConfig(device=args.device, dtype="bfloat16" if args.size != "tiny" else "float32",
                       max_num_seqs=args.max_num_seqs, gpu_memory_utilization=0.6)
    t = time.perf_counter()
    engine = Engine(lm, cfg)
    built_s = time.perf_counter() - t
    n_build = len(compiles.names)
    warm_s = engine.warm_up()
    result = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "commit": os.environ.get("LEGATO_COMMIT", "?"), "args": vars(args), "engine_built_s": built_s,
              "warm_up_s": warm_s, "compiles_at_build": n_build, "compiles_in_warm_up": compiles.names[n_build:],
              "bursts": []}
    for b in range(args.bursts):
        row = burst(engine, lm, args, compiles, b)
        result["bursts"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("slowest_steps",)})[:1500], flush=True)
    if args.sync_burst and torch.cuda.is_available():
        with SyncStacks() as syncs:
            row = burst(engine, lm, args, compiles, args.bursts)
        row["sync_stacks"] = dict(syncs.stacks.most_common(30))
        result["sync_burst"] = row
        print(json.dumps(row["sync_stacks"], indent=1)[:6000], flush=True)
    if args.trace_steps:
        phases = Phases(engine)
        row = burst(engine, lm, args, compiles, args.bursts + 1, (args.trace_steps, args.trace_out))
        phases.remove()
        if os.path.exists(args.trace_out):
            row["trace"] = analyse_trace(args.trace_out)
        result["trace_burst"] = row
        print(json.dumps(row.get("trace"), indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
