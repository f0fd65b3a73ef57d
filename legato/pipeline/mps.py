"""A private CUDA MPS daemon for worker processes that share one GPU (`legato serve --mps`).

Without MPS, the worker processes of `replicas:N`, `MpNd` or `split` placed on one GPU take turns on it: the
GPU runs one process's kernels at a time and switches between them by time slice. A decode step is bound by
its kernel count more than by its rows, so two engines of half the batch each cost nearly two full steps.
Under MPS the processes' kernels run side by side, as streams of one context would.

The daemon is the server's own: it lives in a fresh directory (its pipes and logs), only the workers this
server starts are pointed at it (`CUDA_MPS_PIPE_DIRECTORY` in their environment), and it is told to quit once
they are gone. The server process itself never becomes a client.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("legato.mps")

MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_MODES = ("auto", "on", "off")
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"  # where clients look when PIPE_ENV is unset (the driver's default)


class MpsError(RuntimeError):
    """The daemon could not be started (or `--mps` was asked for where it cannot apply)."""


def gpu_of(device: str) -> str:
    """A device as one GPU is named ("cuda" is "cuda:0")."""
    return "cuda:0" if str(device) == "cuda" else str(device)


def shared_gpus(worker_devices: list[str]) -> list[str]:
    """The CUDA devices that host more than one worker process ("cuda" counts as "cuda:0")."""
    on = [gpu_of(d) for d in worker_devices]
    return sorted({d for d in on if d.startswith("cuda") and on.count(d) > 1})


def running_daemon_dir(control: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The pipe directory of an MPS daemon that clients started from `environ` would already join, if one answers
    there. A pipe left by a daemon that died answers nothing; without the control program a pipe is taken on
    trust."""
    environ = os.environ if environ is None else environ
    pipe_dir = environ.get(PIPE_ENV) or DEFAULT_PIPE_DIR
    if not Path(pipe_dir, "control").exists():
        return None
    if control is None:
        return pipe_dir
    try:
        asked = subprocess.run([control], input="get_server_list\n", env={**environ, PIPE_ENV: pipe_dir}, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=5.0)
    except (subprocess.TimeoutExpired, OSError):
        asked = None
    if asked is None or asked.returncode != 0:
        log.warning("an MPS control pipe at %s answers nothing (left by a daemon that died?): not joined", pipe_dir)
        return None
    return pipe_dir


@dataclass
class MpsDaemon:
    """One running control daemon: `env` points a worker at it; `stop` tells it to quit and removes its files."""

    control: str  # the nvidia-cuda-mps-control executable
    root: Path  # holds pipe/ and log/
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls, control: str | None = None, deadline_s: float = 15.0) -> MpsDaemon:
        control = control or shutil.which(MPS_CONTROL)
        if control is None:
            raise MpsError(f"--mps on needs {MPS_CONTROL} (from the NVIDIA driver's utilities) on PATH")
        root = Path(tempfile.mkdtemp(prefix="legato-mps-"))
        env = {PIPE_ENV: str(root / "pipe"), LOG_ENV: str(root / "log")}
        for d in env.values():
            Path(d).mkdir()
        daemon = cls(control, root, env)
        atexit.register(daemon.stop)  # a server that ends by an error path or a SIGTERM still stops it
        try:
            # -d forks the daemon and returns; its pipe appears once it listens. Its output goes to a file: a
            # daemon that kept a pipe of ours open would hold the wait for its end.
            said = root / "start.out"
            with said.open("w") as out:
                done = subprocess.run([control, "-d"], env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                                      stdout=out, stderr=subprocess.STDOUT, timeout=deadline_s)
            if done.returncode != 0:
                message = " ".join(said.read_text(errors="replace").split())[:200] or "no message"
                raise MpsError(f"{MPS_CONTROL} -d failed ({done.returncode}): {message}")
            until = time.monotonic() + deadline_s
            while not Path(env[PIPE_ENV], "control").exists():
                if time.monotonic() > until:  # its log goes with its directory: say its last words now
                    said = _tail(Path(env[LOG_ENV], "control.log"))
                    raise MpsError(f"{MPS_CONTROL} started but did not open its control pipe within "
                                   f"{deadline_s:.0f} s" + (f"; its log ends: {said}" if said else ""))
                time.sleep(0.05)
        except subprocess.TimeoutExpired:
            daemon.stop()
            raise MpsError(f"{MPS_CONTROL} -d did not return within {deadline_s:.0f} s") from None
        except BaseException:
            daemon.stop()
            raise
        log.info("started a CUDA MPS daemon for the workers that share a GPU (pipes in %s)", env[PIPE_ENV])
        return daemon

    def stop(self, timeout_s: float = 15.0) -> None:
        """Asks the daemon to quit (it ends its server once the clients are gone) and waits for it; kills it if
        it does not end in time, or at once if it never opened its pipe. Safe to call twice."""
        pipe = Path(self.env.get(PIPE_ENV, self.root / "pipe"))
        pid = _pid_of(pipe)  # before the quit: a daemon on its way out may remove the file
        until = time.monotonic() + timeout_s
        asked = False
        if pipe.joinpath("control").exists():
            try:
                subprocess.run([self.control], input="quit\n", env={**os.environ, **self.env}, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s)
                asked = True
            except (subprocess.TimeoutExpired, OSError):
                pass
        _end(pid, until if asked else time.monotonic())
        shutil.rmtree(self.root, ignore_errors=True)


def _tail(path: Path, chars: int = 200) -> str:
    try:
        return " ".join(path.read_text(errors="replace")[-chars:].split())
    except OSError:
        return ""


def _pid_of(pipe: Path) -> int | None:
    try:
        return int(pipe.joinpath("nvidia-cuda-mps-control.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def _end(pid: int | None, until: float) -> None:
    """Waits for process `pid` to be gone until `until` (monotonic), then kills it."""
    if pid is None:
        return
    while True:
        try:
            os.kill(pid, 0)
        except OSError:
            return  # gone
        if time.monotonic() >= until:
            break
        time.sleep(0.05)
    log.warning("the MPS daemon (pid %d) did not quit in time; killing it", pid)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def workers_run_under_mps(mode: str, control: str | None = None) -> bool:
    """Whether worker processes this server starts on a shared GPU would run as MPS clients: `--mps on`, `auto` with
    the control program found, or, whatever the mode, a daemon already answering where they look."""
    control = control or shutil.which(MPS_CONTROL)
    return mode == "on" or (mode == "auto" and control is not None) or running_daemon_dir(control) is not None


def start_for(mode: str, worker_devices: list[str], process_workers: bool, local: bool,
              control: str | None = None) -> MpsDaemon | None:
    """The daemon `--mps MODE` asks for, given where the workers run; None when none is started.

    `on` starts one whenever worker processes share a GPU and fails (MpsError) if it cannot; `auto` starts one
    where `on` would and the control program exists, and otherwise leaves the GPU time-sliced with a warning;
    `off` never starts one. A daemon already running where the workers would look is joined, not doubled."""
    if mode not in MPS_MODES:
        raise MpsError(f"--mps takes one of {', '.join(MPS_MODES)}, got {mode!r}")
    shared = shared_gpus(worker_devices)
    if mode == "off" or not shared:
        if mode == "on":
            log.warning("--mps on: no GPU holds two worker processes here, so no MPS daemon is started")
        return None
    if not process_workers or not local:
        why = "thread workers share one CUDA context already" if not process_workers else \
            "a Ray launcher's workers run under their nodes' own settings"
        if mode == "on":
            raise MpsError(f"--mps on applies to worker processes this server starts itself ({why})")
        return None
    control = control or shutil.which(MPS_CONTROL)
    existing = running_daemon_dir(control)
    if existing is not None:
        log.info("workers on %s join the MPS daemon already running (%s)", ", ".join(shared), existing)
        return None
    if control is None and mode == "auto":
        log.warning("%s share one GPU without MPS (%s not found): they take turns on it", ", ".join(shared),
                    MPS_CONTROL)
        return None
    try:
        return MpsDaemon.start(control)
    except MpsError as e:
        if mode == "on":
            raise
        log.warning("%s share one GPU without MPS (%s): they take turns on it", ", ".join(shared), e)
        return None
