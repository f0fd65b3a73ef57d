"""Several HTTP front processes on one port: `legato serve --fronts N`.

One front process (uvicorn, the routes, the audio encoders, the engine link's I/O thread) costs about a
millisecond of CPU per streamed request, so at a few hundred streams its event loop's passes grow and every
request's first audio waits on them. With `--fronts N` the process the user started (front 0) binds N
listening sockets to the port with SO_REUSEPORT, so the kernel spreads new connections over them, and starts
N - 1 more fronts, each handed one socket. Front 0 alone starts and stops the engine workers; every front
has its own link to each worker (`pipeline/front_links.py`).

- A front that exits while front 0 runs is started again (at most MAX_RESTARTS times a minute; then front 0
  drains and exits 1, so a supervisor restarts the whole server). Its socket goes with it, and the kernel
  sends new connections to the others meanwhile.
- SIGTERM/SIGINT to front 0 drains every front: front 0 sends the others DRAIN_SIGNAL, which starts their
  drain and is never counted as a second signal (a process manager that signals the whole group reaches each
  front itself too). Each front drains its own requests (lifecycle.py) while front 0's Shutdown drains the
  workers with the same grace.
- A front whose front 0 is gone (killed, or a second signal) drains and exits.
- /metrics adds up every front's counters and histograms (prometheus_client's multiprocess mode, in a
  directory front 0 makes and removes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from legato.server.cli import PARSE_ONLY
from legato.server.listen import bind_listener

log = logging.getLogger("legato.fronts")

ROLE_ENV = "LEGATO_FRONT"  # a started front's role, as JSON (FrontRole)
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess directory
DRAIN_SIGNAL = signal.SIGUSR1  # front 0 -> the other fronts: drain and exit
MAX_RESTARTS = 5  # restarts of fronts within RESTART_WINDOW_S before front 0 gives up
RESTART_WINDOW_S = 60.0
_TOPOLOGIES = ("single", "replicas")


@dataclass
class FrontRole:
    """What a front started by front 0 is told: which it is, which server it belongs to, its listening socket."""

    index: int
    count: int
    instance_id: str  # the server's: names the engine links (ipc.py)
    parent_pid: int  # front 0
    fd: int  # its listening socket, inherited
    args: dict  # `legato serve`'s options, as front 0 resolved them


def role_from_env() -> FrontRole | None:
    """This process's role when front 0 started it; None for front 0 (or a server of one front)."""
    text = os.environ.get(ROLE_ENV)
    return FrontRole(**json.loads(text)) if text else None


def check_fronts(count: int, workers: str, topology_kind: str, launcher: str, topology: str | None = None) -> None:
    """ValueError (one line) when `--fronts` cannot be used as asked; `topology` is the --topology value as given,
    for the message."""
    if count < 1:
        raise ValueError(f"--fronts must be >= 1, got {count}")
    if count == 1:
        return
    if not hasattr(socket, "SO_REUSEPORT") or not sys.platform.startswith("linux"):
        raise ValueError("--fronts > 1 needs Linux (the kernel spreads connections over the fronts' sockets)")
    if launcher != "local":
        raise ValueError("--fronts > 1 runs with --launcher local")
    if workers != "process":
        raise ValueError("--fronts > 1 needs engine worker processes (--workers process): fronts cannot share "
                         "an engine thread")
    if topology_kind not in _TOPOLOGIES:
        raise ValueError(f"--fronts > 1 runs with the {' and '.join(_TOPOLOGIES)} topologies, not "
                         f"--topology {topology or topology_kind}")


def bind_front_listeners(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets bound to one (host, port) in one SO_REUSEPORT group (ValueError, one line, if it cannot
    be bound). The port is first bound alone, without the option: a port any other socket holds, another
    legato's group included, is refused rather than shared."""
    probe = bind_listener(host, port)
    port = probe.getsockname()[1]  # port 0: the one the kernel picked
    probe.close()
    return [bind_listener(host, port, reuse_port=True) for _ in range(count)]


def resolved_args(args: argparse.Namespace) -> dict:
    """`legato serve`'s options as the fronts started later take them (no deploy file to apply again)."""
    out = {k: v for k, v in vars(args).items() if not callable(v) and k not in PARSE_ONLY}
    out["deploy"] = None
    return out


class FrontSupervisor:
    """Front 0's other fronts: started, restarted when one exits, signalled, and waited for."""

    def __init__(self, args: dict, host: str, port: int, count: int, instance_id: str,
                 on_give_up: Callable[[], None]) -> None:
        self.args, self.host, self.port, self.count = args, host, port, count
        self.instance_id = instance_id
        self.on_give_up = on_give_up  # called (from the watcher thread) when fronts keep exiting
        self.procs: dict[int, subprocess.Popen] = {}
        self._stopping = threading.Event()
        self._restarts: list[float] = []
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def start(self, sockets: dict[int, socket.socket]) -> None:
        """Starts front k on `sockets[k]` for each k, closes this process's copies (a socket held here would
        keep taking connections nobody accepts once its front is gone), and starts watching them."""
        for index, sock in sockets.items():
            self._spawn(index, sock)
        self._watcher = threading.Thread(target=self._watch, name="fronts-watch", daemon=True)
        self._watcher.start()

    def _spawn(self, index: int, sock: socket.socket) -> None:
        try:
            role = FrontRole(index, self.count, self.instance_id, os.getpid(), sock.fileno(), self.args)
            env = {**os.environ, ROLE_ENV: json.dumps(asdict(role))}
            proc = subprocess.Popen([sys.executable, "-m", "legato.server.fronts"], env=env,
                                    pass_fds=(sock.fileno(),))
        finally:
            sock.close()
        with self._lock:
            self.procs[index] = proc
        log.info("front %d started (pid %d)", index, proc.pid)

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            with self._lock:
                exited = [(i, p) for i, p in self.procs.items() if p.poll() is not None]
            for index, proc in exited:
                if self._stopping.is_set():
                    return
                _forget_metrics(proc.pid)
                log.error("front %d (pid %d) exited with code %s", index, proc.pid, proc.returncode)
                now = time.monotonic()
                self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S] + [now]
                if len(self._restarts) > MAX_RESTARTS:
                    log.error("fronts exited %d times within %.0f s: stopping the server", len(self._restarts),
                              RESTART_WINDOW_S)
                    with self._lock:
                        self.procs.pop(index, None)
                    self.on_give_up()
                    return
                try:
                    self._spawn(index, bind_listener(self.host, self.port, reuse_port=True))
                except (OSError, ValueError) as e:
                    log.error("front %d could not be started again: %s", index, e)
                    with self._lock:
                        self.procs.pop(index, None)

    def drain_all(self) -> None:
        """Asks every front to drain and exit (each ends its own requests); no restarts from now on."""
        self._stopping.set()
        with self._lock:
            procs = list(self.procs.values())
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(DRAIN_SIGNAL)

    def stop(self, timeout_s: float) -> None:
        """Stops every front (drain if not yet asked), waits up to `timeout_s`, then kills what is left."""
        if not self._stopping.is_set():
            self.drain_all()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            procs = list(self.procs.values())
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("front (pid %d) did not exit in time: killing it", proc.pid)
                proc.kill()
                proc.wait(5.0)


def metrics_dir() -> str:
    """A fresh directory for prometheus_client's multiprocess mode, set in this process's environment (the
    fronts it starts inherit it). Set before any metric exists: the mode is chosen when a metric is made."""
    path = tempfile.mkdtemp(prefix="legato-metrics-")
    os.environ[METRICS_ENV] = path
    return path


def remove_metrics_dir(path: str) -> None:
    os.environ.pop(METRICS_ENV, None)
    shutil.rmtree(path, ignore_errors=True)


def _forget_metrics(pid: int) -> None:
    """A gone front's live gauges (open WebSockets) no longer count; its counters still do."""
    if os.environ.get(METRICS_ENV):
        from prometheus_client import multiprocess

        with contextlib.suppress(OSError):
            multiprocess.mark_process_dead(pid)


def follow_front0(parent_pid: int, request_drain: Callable[[], None]) -> None:
    """A front started by front 0: drains on DRAIN_SIGNAL, and as on SIGTERM when front 0 is gone (killed: it
    would have asked us to drain; the workers went with it)."""
    signal.signal(DRAIN_SIGNAL, lambda sig, frame: request_drain())

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        log.error("front 0 (pid %d) is gone: shutting down", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="front0-watch", daemon=True).start()


def main() -> int:
    """Entry point of a front front 0 starts (`python -m legato.server.fronts`, role in $LEGATO_FRONT)."""
    from legato.server.cli import serve

    role = role_from_env()
    if role is None:
        print(f"legato.server.fronts: started without ${ROLE_ENV}; run `legato serve --fronts N`", file=sys.stderr)
        return 2
    args = argparse.Namespace(**role.args)
    args.serve_defaults, args.serve_checks = {}, {}
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
