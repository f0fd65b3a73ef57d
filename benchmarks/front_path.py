"""The server's host path on the CPU: engine worker -> IPC -> event loop -> encoder -> socket, old and new trees
in one run, with the embedded tiny model or (`--paced-step-ms`) a paced stand-in for its engine
(`paced_serve.py`: the tiny model's real engine cannot feed 256 streams on a CPU).

For each variant it starts `legato serve` from that tree (on the CPU), runs the bench
client of this tree (`legato bench serve`, fixed lengths, `--mode`, voice by default) at each concurrency, reads
the server's own TTFPs and stages from its log, and with `--profile` samples the server process and its workers
with py-spy during one cell (`--profile-conc`). Results land in OUT/front_path.json.

    python3 benchmarks/front_path.py --variant before=/tmp/before --variant new=. --concurrency 64,256 \\
        --frames 25 --paced-step-ms 40 --profile --out docs/benchmarks/front-path-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from client_limit import prompt_list  # noqa: E402
from serving_speed import free_port, percentile, server_stages, server_ttfps, step_timers  # noqa: E402

from legato.bench.cpu_census import census  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_variant(args, name: str, tree: Path, data: Path, out: Path) -> list[dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = out / f"server-{name}.log"
    serve = ["--port", str(port), "--max-num-seqs", str(max(args.concurrency)), *args.server_args.split(),
             *args.variant_args.get(name.split("-r")[0], "").split()]
    if args.model:
        serve += ["--model", str(Path(args.model).resolve())]
    if args.paced_step_ms:  # the real front, a paced stand-in for the engine (paced_serve.py), thread workers
        cmd = [args.python, str(ROOT / "benchmarks" / "paced_serve.py"), "--step-ms", str(args.paced_step_ms),
               "--host-ops", str(args.paced_host_ops),
               *(["--real-prompts"] if args.real_prompts else []), "--", *serve]
    else:
        cmd = [args.python, "-m", "legato.cli", "serve", "--device", "cpu", *serve]
    with open(log_path, "w") as log:
        # From the tree itself: `python -m` puts the working directory first on sys.path.
        proc = subprocess.Popen(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        cells = []
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name}: server exited with {proc.returncode}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: server not ready")
                time.sleep(0.2)
            for conc in args.concurrency:
                label = f"{name}-c{conc}"
                log.flush()
                at = log_path.stat().st_size
                before = step_timers(url)
                cpu_before = census()  # every live thread below this process: the server's
                children_before = _children_cpu_s()
                spy = None
                if args.profile and conc == args.profile_conc:
                    spy = subprocess.Popen([args.py_spy, "record", "--pid", str(proc.pid), "--subprocesses",
                                            "--duration", str(args.profile_seconds), "--rate", "100", "--format",
                                            "raw", "--nonblocking", "--threads", "--output",
                                            str(out / f"profile-{label}.txt")],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                bench = [args.python, "-m", "legato.cli", "bench", "serve", "--base-url", url, "--dataset-path",
                         str(data), "--num-prompts", str(conc * args.waves), "--mode", args.mode, "--fixed-length",
                         "--min-frames", str(args.frames), "--max-frames", str(args.frames), "--max-concurrency",
                         str(conc), "--num-warmups", "2", "--no-progress", "--result-dir", str(out / "runs"),
                         "--label", label, "--client-procs", str(args.client_procs)]
                done = subprocess.run(bench, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                      capture_output=True, text=True, timeout=args.cell_timeout)
                cpu_after = census()
                cpu = cpu_per_request(cpu_before, cpu_after, conc * args.waves)
                cpu["client"] = round(1000 * (_children_cpu_s() - children_before) / (conc * args.waves), 3)
                runq = cpu_per_request(cpu_before, cpu_after, conc * args.waves, "runq:")
                if spy is not None:
                    spy.wait(args.profile_seconds + 60)
                after = step_timers(url)
                if done.returncode != 0:
                    cells.append({"variant": name, "concurrency": conc, "error": done.stderr[-2000:]})
                    print(f"[{label}] bench failed: {done.stderr[-800:]}", flush=True)
                    continue
                agg = json.loads((out / "runs" / f"{label}-server-c{conc}.json").read_text())["aggregates"]
                log.flush()
                served = server_ttfps(log_path, at)
                stages = server_stages(log_path, at)
                steps = after.get("legato_engine_steps_total", 0) - before.get("legato_engine_steps_total", 0)
                host = (after.get("legato_engine_step_host_seconds_total", 0)
                        - before.get("legato_engine_step_host_seconds_total", 0))
                cell = {"variant": name, "concurrency": conc, "requests": conc * args.waves,
                        "completed": agg["completed"], "failed": agg["failed"],
                        "audio_s_per_s": agg["audio_throughput"], "ttfp_p50_ms": agg["ttfp_ms"]["median"],
                        "ttfp_p99_ms": agg["ttfp_ms"]["p99"],
                        "server_ttfp_p50_ms": 1000 * percentile(served, 0.5) if served else None,
                        "server_ttfp_p99_ms": 1000 * percentile(served, 0.99) if served else None,
                        "server_stages": stages, "continuity": agg["continuity_rate"], "engine_steps": steps,
                        "engine_host_ms_per_step": 1000 * host / steps if steps else None,
                        "cpu_ms_per_request": cpu, "runq_ms_per_request": runq}
                cells.append(cell)
                print(json.dumps(cell), flush=True)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return cells


def _children_cpu_s() -> float:
    """CPU seconds of this process's ended and waited-for children (the bench client, once its cell is over)."""
    import resource

    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def cpu_per_request(before: dict[str, float], after: dict[str, float], requests: int,
                    kind: str = "cpu:") -> dict[str, float]:
    """CPU milliseconds a request cost each thread group over a cell (`cpu_census` counters before and after), the
    busiest first, groups under 0.05 ms left out; `all` sums the groups (the host's total is left aside: it counts
    whatever else ran on the machine). The bench client has ended by then: its share is added by the caller.
    `kind` "runq:" gives the milliseconds a request's threads waited for a CPU instead."""
    used = {k[len(kind):]: after[k] - before.get(k, 0.0) for k in after if k.startswith(kind) and k != "cpu:host"}
    per = {g: round(1000 * v / requests, 3) for g, v in sorted(used.items(), key=lambda kv: -kv[1])
           if 1000 * v / requests >= 0.05}
    per["all"] = round(1000 * sum(v for v in used.values() if v > 0) / requests, 3)
    return per


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", required=True, metavar="NAME=TREE")
    p.add_argument("--concurrency", type=lambda v: [int(c) for c in v.split(",")], default=[64, 256])
    p.add_argument("--frames", type=int, default=25)
    p.add_argument("--mode", default="voice", help="the bench's request mode (xvec/clone send reference clips: "
                   "give --data with clips and a Base --model)")
    p.add_argument("--data", default=None, help="a prompt set (default: one generated line, repeated)")
    p.add_argument("--model", default=None, help="the checkpoint served (default: the embedded model)")
    p.add_argument("--waves", type=int, default=2)
    p.add_argument("--client-procs", type=int, default=1)
    p.add_argument("--server-args", default="", help="more `legato serve` arguments, e.g. '--workers process'")
    p.add_argument("--variant-args", action="append", default=[], metavar="NAME=ARGS",
                   help="server options of one variant only, after --server-args (e.g. 'f2=--fronts 2')")
    p.add_argument("--paced-step-ms", type=float, default=None,
                   help="serve a paced stand-in engine (a frame per stream this often) instead of the tiny model")
    p.add_argument("--paced-host-ops", type=int, default=0,
                   help="small torch ops the paced engine thread runs a step (its step time then shows GIL waits)")
    p.add_argument("--real-prompts", action="store_true",
                   help="with --paced-step-ms: admission builds real prompts from the served weights")
    p.add_argument("--rounds", type=int, default=1, help="variants alternate this many times (noise on a shared host)")
    p.add_argument("--cell-timeout", type=float, default=600)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-conc", type=int, default=256)
    p.add_argument("--profile-seconds", type=int, default=8)
    p.add_argument("--py-spy", default="py-spy")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.variant_args = dict(item.partition("=")[::2] for item in args.variant_args)
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    data = Path(args.data).resolve() if args.data else prompt_list(out / "prompts", max(args.concurrency) * args.waves)
    cells = []
    for r in range(args.rounds):
        for spec in args.variant:
            name, _, tree = spec.partition("=")
            cells += run_variant(args, f"{name}-r{r}" if args.rounds > 1 else name, Path(tree).resolve(), data, out)
            (out / "front_path.json").write_text(json.dumps({"argv": sys.argv, "cpus": os.cpu_count(),
                                                             "cells": cells}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
