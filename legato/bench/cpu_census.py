"""Where a host's CPU time goes while a benchmark runs: every thread of a process tree (the bench harness, the
server it started, its fronts and workers, the bench client), grouped by role and thread name, as cumulative
counters a `legato.bench.steady.Sample` can carry.

For each group, `cpu:<group>` is the seconds its threads ran on a CPU and `runq:<group>` the seconds they were
ready to run but waited for one (the kernel's run-queue delay, `/proc/<pid>/task/<tid>/schedstat`). Over a
window, a thread that is always busy has cpu + runq close to 1 second a second; what is left it spent blocked
(waiting for the GIL, a lock, I/O or the device). `cpu:host` is the whole machine's busy CPU seconds
(`/proc/stat`), to read against `os.cpu_count()`.

Linux only; elsewhere (or for threads that end between listing and reading) the counters are simply absent.
Python threads show their native name (`legato.pipeline.threads.name_native_thread`), others the process's.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def role_of(cmdline: str) -> str:
    """A short role for a process from its command line: worker, front, server, client or the program's name."""
    if "legato.pipeline.worker" in cmdline:
        return "worker"
    if "legato.server.front" in cmdline:
        return "front"
    if " bench " in f" {cmdline} " or "legato.bench" in cmdline:
        return "client"
    if " serve" in cmdline:
        return "server"
    words = cmdline.split()
    script = next((w for w in words if w.endswith(".py")), words[0] if words else "?")
    return os.path.basename(script) or "?"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def process_tree(root: int | None = None) -> list[int]:
    """`root` (default: this process) and every process below it: through each thread's `children` file, or, on
    a kernel without those, through every process's parent in `/proc/<pid>/stat`."""
    root = os.getpid() if root is None else root
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return _tree_by_parents(root)
    seen: dict[int, None] = {}  # insertion-ordered: root first
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen[pid] = None
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            text = _read(f"/proc/{pid}/task/{tid}/children")
            if text:
                todo.extend(int(c) for c in text.split())
    return list(seen)


def _tree_by_parents(root: int) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (text := _read(f"/proc/{entry}/stat")):
            fields = text.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
            if len(fields) > 1:
                children[int(fields[1])].append(int(entry))
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo.extend(children.get(pid, []))
    return seen


def thread_group(role: str, pid: int, tid: int, comm: str) -> str:
    """`role/name`: a process's first thread is `main`; other threads go by their (native) name, with digits and
    the suffixes that number a pool's threads dropped so that a pool is one group."""
    if tid == pid:
        return f"{role}/main"
    name = re.sub(r"[\d_:/-]+$", "", comm.strip()) or "thread"
    return f"{role}/{name}"


def census(root: int | None = None) -> dict[str, float]:
    """Cumulative CPU and run-queue seconds of each thread group below `root` (default: this process), and the
    host's busy seconds, as `{"cpu:<group>": s, "runq:<group>": s, "cpu:host": s}`."""
    out: dict[str, float] = defaultdict(float)
    for pid in process_tree(root):
        raw = _read(f"/proc/{pid}/cmdline")
        if raw is None:
            continue
        role = role_of(raw.replace("\0", " ").strip())
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            sched = _read(f"/proc/{pid}/task/{tid}/schedstat")
            comm = _read(f"/proc/{pid}/task/{tid}/comm")
            if sched is None or comm is None:
                continue
            fields = sched.split()
            if len(fields) < 2:
                continue
            group = thread_group(role, pid, tid, comm)
            out[f"cpu:{group}"] += int(fields[0]) / 1e9
            out[f"runq:{group}"] += int(fields[1]) / 1e9
    host = host_busy_s()
    if host is not None:
        out["cpu:host"] = host
    return dict(out)


def host_busy_s() -> float | None:
    """The machine's busy CPU seconds since boot (all CPUs: user, nice, system, irq, softirq, steal)."""
    text = _read("/proc/stat")
    if not text or not text.startswith("cpu "):
        return None
    v = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
    busy = sum(v[:3]) + sum(v[5:8])  # user nice system (idle iowait) irq softirq steal
    return busy * _TICK_S


def busiest(rates: dict[str, float], top: int = 12, floor: float = 0.02) -> dict[str, dict[str, float]]:
    """The groups using the most CPU over a window (`rates`: each counter's rise per second), as
    `{group: {"cpu": cores, "runq": cores}}`, busiest first; groups under `floor` cores are left out."""
    groups = [(k[4:], v) for k, v in rates.items() if k.startswith("cpu:") and k != "cpu:host" and v >= floor]
    groups.sort(key=lambda kv: -kv[1])
    return {g: {"cpu": round(v, 3), "runq": round(rates.get(f"runq:{g}", 0.0), 3)} for g, v in groups[:top]}
