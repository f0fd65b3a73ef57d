"""The topology × concurrency sweep, and the fairness rules every comparison follows.

For each topology and each concurrency the sweep starts a fresh `legato serve --topology T --port P ...`
(fresh state per cell: no warm caches or queues carried over), waits for `/health` (bounded; a server that
exits or never gets ready fails that cell with its log tail), runs the client, stops the server (SIGTERM, then
SIGKILL to its whole process group after a grace period, so no worker outlives it) and waits until the port
is free. Then it writes SUMMARY.md, summary.json and the plots.

Fairness (the lesson of comparing a 7-GPU disaggregated setup against a 1-GPU baseline): runs are compared
only at the same GPU count and with the same limits — max concurrency, request rate, the server's
max_num_seqs, max_new_tokens and the fixed-length settings, and the same workload. A topology's GPU count
comes from its name (`single` = 1, `replicas:N` = N); any other kind must be given explicitly (`--gpus T=N`).
On a machine without GPUs every topology runs on the same one host, so all are compared as equal hardware (and
no per-GPU figures are made). The plain `replicas` control at each GPU count in the sweep (`single` at 1 GPU)
is added when missing. Comparisons that break a rule are refused unless `allow_unfair`, and then flagged in
the summary.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from . import client as bench_client
from .datasets import BenchRequest
from .metrics import SloSpec
from .report import build_result, run_stem, save_run, write_sweep

log = logging.getLogger(__name__)
_REPLICAS = re.compile(r"^replicas:(\d+)$")


class SweepError(RuntimeError):
    pass


def gpu_count(topology: str, explicit: dict[str, int] | None = None) -> int:
    """GPUs a topology occupies: explicit if given, else from its name (single = 1, replicas:N = N)."""
    if explicit and topology in explicit:
        return explicit[topology]
    if topology == "single":
        return 1
    m = _REPLICAS.match(topology)
    if m and int(m.group(1)) >= 1:
        return int(m.group(1))
    raise SweepError(f"cannot tell how many GPUs topology {topology!r} uses; give it with --gpus {topology}=N")


def control_for(gpus: int) -> str:
    """The plain scale-out control at a GPU count: independent single-GPU replicas."""
    return "single" if gpus == 1 else f"replicas:{gpus}"


def with_controls(topologies: list[str], explicit: dict[str, int] | None = None) -> list[str]:
    """The topology list with the `replicas` control of every GPU count in it added (first) when missing."""
    out: list[str] = []
    for t in topologies:
        ctrl = control_for(gpu_count(t, explicit))
        if ctrl not in topologies and ctrl not in out:
            out.append(ctrl)
        if t not in out:
            out.append(t)
    return out


def parse_flag(args: list[str], flag: str) -> str | None:
    """The value of `flag` in an argv list (`--flag V` or `--flag=V`; the last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def limits(config: dict) -> dict:
    """What must match for two runs to be compared (see the module doc). None means "not known" (a server
    limit nobody recorded); settings the bench itself chose are always known."""
    client, req, ds = config.get("client", {}), config.get("request", {}), config.get("dataset", {})
    fixed = req.get("fixed_length")
    return {
        "num_gpus": config.get("num_gpus"),
        "max_concurrency": client.get("max_concurrency") or "unbounded",
        "request_rate": client.get("request_rate"),
        "max_num_seqs": config.get("max_num_seqs"),
        "max_new_tokens": req.get("max_new_tokens") or "server default",
        "fixed_length": [fixed["frames_per_char"], fixed["min_frames"], fixed["max_frames"]] if fixed else "off",
        "workload": [Path(str(ds.get("path"))).name, ds.get("num_prompts"), ds.get("seed"), req.get("mode")],
    }


def fairness_problems(configs: dict[str, dict]) -> tuple[list[str], list[str]]:
    """(problems, warnings) comparing runs by name: a known limit that differs is a problem; a limit known
    for some runs and unknown (None) for others is a warning, since it cannot be checked."""
    problems, warnings = [], []
    lims = {name: limits(c) for name, c in configs.items()}
    for key in next(iter(lims.values()), {}):
        values = {name: lim[key] for name, lim in lims.items()}
        known = {str(v) for v in values.values() if v is not None}
        desc = ", ".join(f"{n}={v}" for n, v in values.items())
        if len(known) > 1:
            problems.append(f"{key} differs: {desc}")
        elif known and None in values.values():
            warnings.append(f"{key} unknown for some runs, not checked: {desc}")
    return problems, warnings


def last_line(text: str) -> str:
    """The last non-blank line: a failed server's log ends with the error that stopped it."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port_free(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is fine
            try:
                s.bind((host, port))
                return
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise SweepError(f"port {port} still busy {timeout_s:g} s after the server stopped")
        time.sleep(0.2)


class ServerProcess:
    """One server subprocess in its own process group, with its output in a log file."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.cmd, self.log_path, self.env = cmd, log_path, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen(self.cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, health_url: str, timeout_s: float) -> float:
        """Poll `health_url` until 200; seconds it took. Fails fast if the process exits."""
        t0 = time.monotonic()
        with httpx.Client(timeout=2.0) as c:
            while True:
                if self.proc.poll() is not None:
                    raise SweepError(f"server exited with code {self.proc.returncode} before it was ready:\n"
                                     f"{self.log_tail()}")
                try:
                    if c.get(health_url).status_code == 200:
                        return time.monotonic() - t0
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > timeout_s:
                    raise SweepError(f"server not ready after {timeout_s:g} s:\n{self.log_tail()}")
                time.sleep(0.2)

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM, then SIGKILL to the whole group after `grace_s`; stray group members are killed too."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("server did not stop within %.1f s of SIGTERM; killing its process group", grace_s)
                self._kill_group()
                self.proc.wait()
        if self._group_alive():
            log.warning("server left processes behind after exiting; killing them")
            self._kill_group()
            deadline = time.monotonic() + 5.0  # SIGKILL lands asynchronously; the next cell needs the memory back
            while self._group_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.proc.returncode

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def installed_server_cmd() -> list[str]:
    """`legato serve` as installed beside this Python (or on PATH). Unlike `python -m legato.cli`, an entry
    point does not put the working directory first on sys.path, so a folder there named `legato` cannot
    shadow the installed package; `-P` does the same for the fallback (Python >= 3.11)."""
    script = Path(sys.executable).parent / "legato"
    found = str(script) if script.is_file() else shutil.which("legato")
    if found:
        return [found, "serve"]
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "legato.cli", "serve"]


@dataclass
class SweepConfig:
    topologies: list[str]
    concurrencies: list[int]
    out_dir: Path
    label: str = "sweep"
    server_cmd: list[str] = field(default_factory=installed_server_cmd)
    server_args: list[str] = field(default_factory=list)  # shared by every topology
    topology_args: dict[str, list[str]] = field(default_factory=dict)  # extra args of one topology
    gpus: dict[str, int] = field(default_factory=dict)  # explicit GPU counts
    devices: list[str] | None = None  # when given: CUDA_VISIBLE_DEVICES = the first N of them
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port picked once
    startup_timeout_s: float = 300.0
    stop_grace_s: float = 15.0
    allow_unfair: bool = False
    cpu_only: bool = False  # no GPUs here: every topology runs on this one host (equal hardware)

    def gpu_counts(self, topologies: list[str]) -> dict[str, int]:
        """Explicit GPU counts, plus 1 for every topology on a CPU-only machine (one host for all)."""
        if not self.cpu_only:
            return self.gpus
        return {**{t: 1 for t in topologies}, **self.gpus}


def _cell_config(base: dict, cfg: SweepConfig, topology: str, gpus: int, conc: int) -> dict:
    args = cfg.server_args + cfg.topology_args.get(topology, [])
    mns = parse_flag(args, "--max-num-seqs")
    config = {**base, "label": cfg.label, "topology": topology, "num_gpus": gpus, "server_args": args,
              "max_num_seqs": int(mns) if mns else None}
    config["client"] = {**base.get("client", {}), "max_concurrency": conc}
    return config


def plan(cfg: SweepConfig, base_config: dict) -> tuple[list[str], list[str]]:
    """(topologies to run, fairness notes); raises SweepError on an unfair plan unless allow_unfair."""
    counts = cfg.gpu_counts(cfg.topologies)
    topologies = with_controls(cfg.topologies, counts)
    counts = cfg.gpu_counts(topologies)
    if cfg.devices is not None:
        for t in topologies:
            if gpu_count(t, counts) > len(cfg.devices):
                raise SweepError(f"{t} needs {gpu_count(t, counts)} GPUs; --devices lists {len(cfg.devices)}")
    conc = cfg.concurrencies[0]
    configs = {t: _cell_config(base_config, cfg, t, gpu_count(t, counts), conc) for t in topologies}
    problems, warnings = fairness_problems(configs)
    if problems and not cfg.allow_unfair:
        raise SweepError("refusing an unfair comparison (use --allow-unfair to run it anyway): " + "; ".join(problems))
    notes = [f"UNFAIR comparison (--allow-unfair): {p}" for p in problems] + warnings
    if cfg.cpu_only:
        notes.append("CPU only: every topology ran on this one host and is compared as equal hardware "
                     "(no per-GPU figures)")
    return topologies, notes


def run_sweep(cfg: SweepConfig, requests: list[BenchRequest], client_cfg: bench_client.ClientConfig,
              base_config: dict, slo: SloSpec, meta: dict) -> tuple[list[dict], list[Path]]:
    """Run every (topology, concurrency) cell and write the summary; returns (cells, paths written)."""
    topologies, notes = plan(cfg, base_config)
    counts = cfg.gpu_counts(topologies)
    port = cfg.port or free_port(cfg.host)
    runs_dir = cfg.out_dir / "runs"
    cells = []
    for topo in topologies:
        gpus = gpu_count(topo, counts)
        for conc in cfg.concurrencies:
            config = _cell_config(base_config, cfg, topo, gpus, conc)
            stem = run_stem(cfg.label, topo, conc)
            cell = {"topology": topo, "gpus": gpus, "concurrency": conc, "control": control_for(gpus),
                    "aggregates": None, "error": None}
            env = dict(os.environ)
            if cfg.devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(cfg.devices[:gpus])
            cmd = [*cfg.server_cmd, "--topology", topo, "--host", cfg.host, "--port", str(port), *config["server_args"]]
            server = ServerProcess(cmd, cfg.out_dir / "logs" / f"{stem}.log", env)
            log.info("cell %s: %s", stem, " ".join(cmd))
            try:
                server.start()
                cell["startup_s"] = server.wait_ready(f"http://{cfg.host}:{port}/health", cfg.startup_timeout_s)
                ccfg = replace(client_cfg, base_url=f"http://{cfg.host}:{port}", max_concurrency=conc)
                config["client"]["base_url"] = ccfg.base_url
                out = bench_client.run(ccfg, requests)
                result = build_result(config, out, slo, None if cfg.cpu_only else gpus)
                paths = save_run(result, out, runs_dir, stem, ccfg.sample_rate)
                cell["aggregates"], cell["result"] = result["aggregates"], str(paths["json"].relative_to(cfg.out_dir))
            except SweepError as e:
                cell["error"] = last_line(str(e))
                log.error("cell %s failed: %s", stem, e)
            finally:
                cell["server_exit_code"] = server.stop(cfg.stop_grace_s)
                wait_port_free(cfg.host, port, 60.0)
            cells.append(cell)
    meta = {**meta, "topologies": topologies, "concurrencies": cfg.concurrencies, "fairness_notes": notes,
            "server_cmd": cfg.server_cmd, "server_args": cfg.server_args, "topology_args": cfg.topology_args,
            "control": sorted({c["control"] for c in cells}), "cpu_only": cfg.cpu_only}
    return cells, write_sweep(cells, meta, cfg.out_dir)
