"""Served speed on one GPU, several code versions side by side in one run.

For each variant (a source tree and its package name) it starts one server, records the time to ready and
the first request's TTFP, then runs `legato bench serve` (the bench of this tree, for every variant) at each
concurrency and mode, and reads the server's step timers from /metrics where it has them. A GPU memory
sampler records the peak. The table at the end gives audio-s/s, req/s, TTFP p50/p99, RTF p50, continuity,
GPU busy and peak memory per cell; everything lands in OUT/summary.json.

    python3 benchmarks/serving_speed.py --ckpt /tmp/ckpt --data .bench-data/prompts --out $OUT \\
        --variant new=.:legato --variant old=.before:voxserve --concurrency 1,8,32,64 --modes xvec,clone

Random weights carry no speech: lengths are fixed from the text (`--fixed-length`, EOS ignored).

A mode ending in `-ws` (`xvec-ws`, `clone-ws`) sends the same prompts over the streaming-text WebSocket
(`bench serve --stream-text`, `--text-rate` tokens a second, one client process) at the same fixed lengths, so
its cells compare with the HTTP mode's (issue 23: 64 contexts against HTTP).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from legato.bench.cpu_census import busiest, census
from legato.bench.steady import Sample, steady_rates, steady_summary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MemorySampler(threading.Thread):
    """Peak used GPU memory (MiB) by nvidia-smi, every half second, until stopped."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.peak = max(self.peak, max(int(x) for x in out.split()))
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            self.stop.wait(0.5)


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def step_timers(url: str) -> dict:
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    keys = ("legato_engine_steps_total", "legato_engine_step_host_seconds_total",
            "legato_engine_loop_other_seconds_total", "legato_engine_step_gpu_seconds_total",
            "legato_engine_step_gap_seconds_total")
    return {k: v for k in keys if (v := metric(text, k)) is not None}


STEADY_KEYS = {"legato_engine_decode_rows_total": "decode_rows", "legato_engine_steps_total": "steps",
               "legato_engine_step_gpu_seconds_total": "gpu_s", "legato_engine_step_gap_seconds_total": "gap_s",
               "legato_engine_step_host_seconds_total": "host_s",
               "legato_engine_loop_other_seconds_total": "loop_other_s"}


class MetricsPoller(threading.Thread):
    """The server's engine counters every `every` seconds while a cell runs, for the rates over its steady middle
    (`legato.bench.steady`): a tree without the decode-rows counter gives none."""

    def __init__(self, url: str, every: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.url, self.every = url, every
        self.samples: list[Sample] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self.stop.is_set():
                try:
                    text = client.get(f"{self.url}/metrics").text
                except httpx.HTTPError:
                    text = ""
                values = {short: v for name, short in STEADY_KEYS.items() if (v := metric(text, name)) is not None}
                if "decode_rows" in values:
                    values.update(census())  # every thread of the server and the bench client below this process
                    self.samples.append(Sample(time.monotonic(), values))
                self.stop.wait(self.every)

    def steady(self) -> dict | None:
        """The steady middle's rates, with `cpu`: the busiest thread groups' CPU and run-queue cores there and
        `host_cores`, the machine's busy cores (of `os.cpu_count()`)."""
        summary = steady_summary(self.samples)
        rates = steady_rates(self.samples)
        if summary is not None and rates is not None:
            steps = rates.get("steps") or 0.0
            for key in ("host_s", "loop_other_s"):  # the engine thread's time in step() and around it, per step
                summary[f"{key[:-2]}_ms_per_step"] = 1000 * rates[key] / steps if steps and key in rates else None
            summary["cpu"] = busiest(rates)
            summary["host_cores"] = rates.get("cpu:host")
            summary["cpu_count"] = os.cpu_count()
        return summary


def pyspy_command(args, pid: int, out: Path) -> list[str]:
    """py-spy sampling the server and its workers at 100 Hz: `--gil` only the thread holding the GIL; `--native`
    with C frames (the process is paused for each sample then: native unwinding needs it); `--idle` threads that
    wait too (a GIL or lock wait, a device sync)."""
    return ["py-spy", "record", "--pid", str(pid), "--duration", str(args.profile_seconds), "--rate", "100",
            "--format", "raw", "--threads", "--subprocesses", *([] if args.profile_native else ["--nonblocking"]),
            *(["--gil"] if args.profile_gil else []), *(["--native"] if args.profile_native else []),
            *(["--idle"] if args.profile_idle else []), "--output", str(out)]


class DelayedProfile:
    """A profiler started `delay_s` after now (so that it samples a cell's steady middle, not its first burst)."""

    def __init__(self, command: list[str], delay_s: float) -> None:
        self.proc: subprocess.Popen | None = None
        self._timer = threading.Timer(delay_s, self._start, (command,))
        self._timer.daemon = True
        self._timer.start()

    def _start(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def wait(self, timeout: float) -> None:
        self._timer.join(timeout)
        if self.proc is None:  # the cell ended before the delay: no profile
            self._timer.cancel()
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def server_ttfps(log_path: Path, start: int) -> list[float]:
    """TTFP the server itself logged (request in to first audio out, `ttfp_s=`) after byte `start`."""
    with open(log_path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return [float(v) for v in re.findall(r" ttfp_s=([0-9.eE+-]+)", text)]


def server_stages(log_path: Path, start: int) -> dict[str, dict[str, float | None]]:
    """p50/p99 ms of each engine-side stage the server logged beside its TTFP (`prepare_s=` ...), after `start`,
    and of `front`: the TTFP less those stages, per request (the body in, the front's checks and clip, the hops to
    the worker and back, the first write). Where the front logged its own stamps (`front_in_s`: headers in ->
    handed to the engine client; `reply_s`: handed over -> first audio pulled), `front_in`, `reply` and `hops`
    (reply less the engine-side stages: the ways to the worker and back) split `front`; `voice`, `queue`, `build`
    and `resume` split `prepare` where the engine client logged them. Where a worker process logged `worker` (its
    request's message in -> first audio out), `hops` splits into `in_worker` (worker less the engine-side stages:
    the worker's own event-loop passes) and `link` (reply less worker: the sockets, and the front's I/O thread and
    event loop, both ways). `split` logs the talker's stages to its first codes and `codec` (those codes in the front
    -> first audio there), which `hops` leaves out; `codec_worker` is the codec worker process's share of `codec`, and
    `codec_link` the rest (the front's passes and the sockets to that worker and back)."""
    with open(log_path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    stages = ("prepare", "inbox", "engine")
    # logged where the tree has them
    split = ("front_in", "reply", "voice", "queue", "build", "resume", "worker", "codec", "codec_worker")
    values: dict[str, list[float]] = {k: [] for k in (*stages, "front", "hops", "in_worker", "link", "codec_link",
                                                      *split)}
    for line in text.splitlines():
        found = {k: float(v) for k, v in re.findall(r" ([a-z_]+)_s=([0-9.eE+-]+)", line)}
        for k in (*stages, *split):
            if k in found:
                values[k].append(found[k])
        if "codec" in found and "codec_worker" in found:
            values["codec_link"].append(found["codec"] - found["codec_worker"])
        if all(k in found for k in stages):
            engine = sum(found[k] for k in stages)  # split: the talker's, to its first codes
            codec = found.get("codec", 0.0)
            if "ttfp" in found:
                values["front"].append(found["ttfp"] - engine - codec)
            if "reply" in found:
                values["hops"].append(found["reply"] - engine - codec)
            if "worker" in found:
                values["in_worker"].append(found["worker"] - engine)
                if "reply" in found:
                    values["link"].append(found["reply"] - found["worker"] - codec)
    return {k: {q: (1000 * percentile(v, p) if v else None) for q, p in (("p50_ms", 0.5), ("p99_ms", 0.99))}
            for k, v in values.items()}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def first_request_ttfp(url: str, body: dict) -> float:
    t0 = time.perf_counter()
    ttfp = None
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=300) as r:
        r.raise_for_status()
        for part in r.iter_bytes():
            if part and ttfp is None:
                ttfp = time.perf_counter() - t0
    return ttfp


def run_variant(args, name: str, tree: str, package: str) -> list[dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(Path(tree).resolve()),
                                                                     os.environ.get("PYTHONPATH")) if p),
           **dict(kv.partition("=")[::2] for kv in args.variant_env.get(name, "").split())}
    cmd = [sys.executable, "-m", f"{package}.cli", "serve", "--model", str(Path(args.ckpt).resolve()),
           "--port", str(port), "--max-num-seqs", str(args.max_num_seqs), *args.server_args.split(),
           *args.variant_args.get(name, "").split()]
    if any(m.endswith("-ws") for m in args.modes.split(",")):  # a session carries the reference clip inline
        cmd += ["--ws-max-message-bytes", str(8 * 2**20)]
    log = open(Path(args.out) / f"server-{name}.log", "w")
    mem = MemorySampler()
    mem.start()
    t0 = time.monotonic()
    # From the tree itself: `python -m` puts the working directory first on sys.path, so a variant of the same
    # package name run from here would serve this tree's code.
    proc = subprocess.Popen(cmd, env=env, cwd=Path(tree).resolve(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    cells = []
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: server exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > args.startup_timeout:
                raise RuntimeError(f"{name}: server not ready after {args.startup_timeout} s")
            time.sleep(0.2)
        ready_s = time.monotonic() - t0
        probe = {"input": "The first request after a fresh start.", "response_format": "pcm", "stream": True,
                 "ignore_eos": True, "num_frames": 25, "speaker_embedding": [0.01] * args.hidden,
                 "x_vector_only_mode": True}
        first = first_request_ttfp(url, probe)
        steady = min(first_request_ttfp(url, probe) for _ in range(3))
        print(f"[{name}] ready in {ready_s:.1f} s; first request TTFP {first * 1000:.0f} ms "
              f"(steady {steady * 1000:.0f} ms)", flush=True)
        cells.append({"variant": name, "kind": "startup", "ready_s": ready_s, "first_ttfp_s": first,
                      "steady_ttfp_s": steady})
        for mode in args.modes.split(","):
            for conc, procs in [(int(c), int(p)) for c in args.concurrency.split(",")
                                for p in args.client_procs.split(",")]:
                n = min(args.max_prompts, max(args.min_prompts, args.prompts_per_conc * conc))
                tag = f"-p{procs}" if "," in args.client_procs else ""
                stem = f"{name}-{mode}-c{conc}{tag}"
                before = step_timers(url)
                log.flush()
                log_at = (Path(args.out) / f"server-{name}.log").stat().st_size
                prompt_mode, ws = mode.removesuffix("-ws"), mode.endswith("-ws")
                bench = [sys.executable, "-m", "legato.cli", "bench", "serve", "--base-url", url,
                         "--dataset-path", args.data, "--num-prompts", str(n), "--mode", prompt_mode,
                         "--fixed-length", "--max-concurrency", str(conc), "--num-warmups", "2", "--no-progress",
                         "--timeout", "300", "--result-dir", str(Path(args.out) / "runs"), "--label",
                         f"{name}-{mode}{tag}", "--topology", "single", "--max-num-seqs", str(args.max_num_seqs),
                         "--num-gpus", "1", "--client-procs", "1" if ws else str(procs)]
                if ws:
                    bench += ["--stream-text", "--text-rate", args.text_rate]
                t1 = time.monotonic()
                poller = MetricsPoller(url)
                poller.start()
                spy = None
                profiled = f"{mode}:{conc}" in args.profile.split(",")  # a sampling profile of the server
                if profiled and shutil.which("py-spy") is None:
                    print(f"[{stem}] py-spy is not on PATH: no profile of this cell", flush=True)
                elif profiled:
                    spy = DelayedProfile(pyspy_command(args, proc.pid, Path(args.out) / f"profile-{stem}.txt"),
                                         args.profile_delay)
                done = subprocess.run(bench, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                    p for p in (str(Path(".").resolve()), os.environ.get("PYTHONPATH")) if p)},
                    capture_output=True, text=True, timeout=args.cell_timeout)
                poller.stop.set()
                poller.join(10)
                after = step_timers(url)
                served = server_ttfps(Path(args.out) / f"server-{name}.log", log_at)
                stages = server_stages(Path(args.out) / f"server-{name}.log", log_at)
                if spy is not None:
                    spy.wait(args.profile_delay + args.profile_seconds + 30)
                label = f"{name}-{mode}{tag}-stream-text" if ws else f"{name}-{mode}{tag}"
                result_path = Path(args.out) / "runs" / f"{label}-single-c{conc}.json"
                if done.returncode != 0 or not result_path.exists():
                    print(f"[{stem}] bench failed: {done.stderr[-800:]}", flush=True)
                    cells.append({"variant": name, "kind": "cell", "mode": mode, "concurrency": conc,
                                  "client_procs": procs, "error": done.stderr[-2000:]})
                    continue
                agg = json.loads(result_path.read_text())["aggregates"]
                # each cell's requests kept apart: a concurrency listed twice (the first burst, then the second)
                # would write the same file (benchmarks/underruns.py reads them per cell)
                result_path.rename(result_path.with_name(
                    f"{result_path.stem}-cell{sum(c.get('kind') == 'cell' for c in cells) + 1}.json"))
                gpu = after.get("legato_engine_step_gpu_seconds_total", 0) - before.get(
                    "legato_engine_step_gpu_seconds_total", 0)
                gap = after.get("legato_engine_step_gap_seconds_total", 0) - before.get(
                    "legato_engine_step_gap_seconds_total", 0)
                steps = after.get("legato_engine_steps_total", 0) - before.get("legato_engine_steps_total", 0)
                other = after.get("legato_engine_loop_other_seconds_total", 0) - before.get(
                    "legato_engine_loop_other_seconds_total", 0)
                host = after.get("legato_engine_step_host_seconds_total", 0) - before.get(
                    "legato_engine_step_host_seconds_total", 0)
                cell = {"variant": name, "kind": "cell", "mode": mode, "concurrency": conc, "prompts": n,
                        "client_procs": procs,
                        "wall_s": time.monotonic() - t1, "audio_s_per_s": agg["audio_throughput"],
                        "req_per_s": agg["request_throughput"], "ttfp_p50_ms": agg["ttfp_ms"]["median"],
                        "ttfp_p99_ms": agg["ttfp_ms"]["p99"],
                        "server_ttfp_p50_ms": 1000 * (percentile(served, 0.5) or 0) if served else None,
                        "server_ttfp_p99_ms": 1000 * (percentile(served, 0.99) or 0) if served else None,
                        "server_stages": stages,
                        "rtf_p50": agg["rtf"]["median"],
                        "continuity": agg["continuity_rate"], "underrun_p99_s": agg["underrun_s"]["p99"],
                        "completed": agg["completed"], "failed": agg["failed"],
                        "gpu_busy": gpu / (gpu + gap) if gpu + gap > 0 else None,
                        "host_ms_per_step": 1000 * host / steps if steps else None,
                        "gpu_ms_per_step": 1000 * gpu / steps if steps else None,
                        "gap_ms_per_step": 1000 * gap / steps if steps else None,
                        "loop_other_ms_per_step": 1000 * other / steps if steps else None,
                        "steady": poller.steady()}
                cells.append(cell)
                print(json.dumps(cell), flush=True)
                print(f"[{stem}] steady cpu: {cpu_line(cell['steady'])}", flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        mem.stop.set()
        mem.join(5)
        log.close()
    for c in cells:
        c["peak_gpu_mib"] = mem.peak
    return cells


def steady_cols(st: dict | None) -> str:
    """The steady middle's decoded rows a second, steps a second and rows a step (`MetricsPoller.steady`)."""
    if not st:
        return "-"
    return f"{st['decode_rows_per_s']:.0f}, {st['steps_per_s'] or 0:.1f}, {st['rows_per_step'] or 0:.1f}"


def cpu_line(st: dict | None) -> str:
    """The steady middle's host cores busy and its busiest thread groups' CPU / run-queue cores, on one line."""
    if not st or "cpu" not in st:
        return "-"
    groups = ", ".join(f"{g} {v['cpu']:.2f}/{v['runq']:.2f}" for g, v in st["cpu"].items())
    host = st.get("host_cores")
    return (f"host {host or 0:.1f} of {st.get('cpu_count')} cores; engine step host "
            f"{st.get('host_ms_per_step') or 0:.1f} + other {st.get('loop_other_ms_per_step') or 0:.1f} ms; {groups}")


def table(cells: list[dict]) -> str:
    head = ("variant", "mode", "conc", "audio s/s", "req/s", "TTFP p50", "TTFP p99", "srv TTFP p50/p99", "RTF p50",
            "contin.", "busy", "host/gpu/gap ms", "srv stages p50 prep/inbox/engine/front",
            "front_in/hops/voice/queue/build/resume/codec/codec_worker", "steady rows/s, steps/s, rows/step",
            "client procs", "peak MiB")
    lines = [" | ".join(head)]
    for c in cells:
        if c["kind"] != "cell" or "error" in c:
            continue

        def f(v, fmt=".1f"):
            return "-" if v is None else format(v, fmt)

        timers = (f"{f(c['host_ms_per_step'])}/{f(c['gpu_ms_per_step'])}/{f(c['gap_ms_per_step'])}"
                  if c["gpu_ms_per_step"] is not None else "-")
        st = c.get("server_stages") or {}
        stages = "/".join(f((st.get(k) or {}).get("p50_ms"), ".0f") for k in ("prepare", "inbox", "engine", "front"))
        split = "/".join(f((st.get(k) or {}).get("p50_ms"), ".0f")
                         for k in ("front_in", "hops", "voice", "queue", "build", "resume", "codec", "codec_worker"))
        lines.append(" | ".join([c["variant"], c["mode"], str(c["concurrency"]), f(c["audio_s_per_s"]),
                                 f(c["req_per_s"], ".2f"), f(c["ttfp_p50_ms"], ".0f"), f(c["ttfp_p99_ms"], ".0f"),
                                 f"{f(c.get('server_ttfp_p50_ms'), '.0f')}/{f(c.get('server_ttfp_p99_ms'), '.0f')}",
                                 f(c["rtf_p50"], ".3f"), f(c["continuity"], ".2f"), f(c["gpu_busy"], ".2f"),
                                 timers, stages, split, steady_cols(c.get("steady")), str(c.get("client_procs", "-")),
                                 str(c["peak_gpu_mib"])]))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", required=True, metavar="NAME=TREE[:PACKAGE]")
    p.add_argument("--variant-args", action="append", default=[], metavar="NAME=ARGS",
                   help="server options of one variant only, after --server-args (e.g. 'f4=--fronts 4')")
    p.add_argument("--variant-env", action="append", default=[], metavar="NAME=K=V[ K=V]",
                   help="environment of one variant's server only (e.g. 'g02=LEGATO_GIL_SWITCH_MS=0.2')")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--hidden", type=int, default=1024, help="the model's hidden size (x-vector width)")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--modes", default="xvec,clone")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--server-args", default="")
    p.add_argument("--min-prompts", type=int, default=16)
    p.add_argument("--max-prompts", type=int, default=256)
    p.add_argument("--prompts-per-conc", type=int, default=2,
                   help="prompts per cell = this x concurrency (within --min/--max-prompts); 4 or more keeps the "
                        "first wave's prefill and the last requests' tail a small part of a cell")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--cell-timeout", type=float, default=300)
    p.add_argument("--client-procs", default="1",
                   help="bench client processes (legato bench serve --client-procs): 2 or more at c>=256; a comma "
                        "list runs each cell once per count on the same server (is the client the limit?)")
    p.add_argument("--profile", default="", metavar="MODE:CONC[,MODE:CONC]",
                   help="py-spy the server during these cells")
    p.add_argument("--profile-seconds", type=int, default=5)
    p.add_argument("--profile-gil", action="store_true",
                   help="sample only the thread holding the GIL (py-spy --gil): who the others wait for")
    p.add_argument("--profile-native", action="store_true",
                   help="py-spy --native: C frames too (a CUDA driver call or lock the engine thread waits in)")
    p.add_argument("--profile-idle", action="store_true", help="py-spy --idle: waiting threads' samples too")
    p.add_argument("--profile-delay", type=float, default=0.0,
                   help="seconds into the cell before the profile starts (its steady middle)")
    p.add_argument("--text-rate", default="inf", help="tokens a second of the -ws modes' text ('inf': at once)")
    args = p.parse_args()
    args.variant_args = dict(item.partition("=")[::2] for item in args.variant_args)
    args.variant_env = dict(item.partition("=")[::2] for item in args.variant_env)
    Path(args.out, "runs").mkdir(parents=True, exist_ok=True)
    cells = []
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        tree, _, package = rest.partition(":")
        try:
            cells += run_variant(args, name, tree, package or "legato")
        except Exception as e:  # one variant failing still leaves the others' figures
            print(f"[{name}] failed: {e}", flush=True)
            cells.append({"variant": name, "kind": "error", "error": str(e)})
        Path(args.out, "summary.json").write_text(json.dumps(cells, indent=1))
    print(table(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
