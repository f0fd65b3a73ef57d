"""How a worker process is started, placed and watched: the seam between `ProcessEngineClient` and the
runtime that hosts its worker.

`ProcessEngineClient` owns everything about a worker but its process: it asks its launcher where the worker
will run (`place`), binds its control sockets accordingly (`ipc://` on the server's node, `tcp://` on the
server's address otherwise), has the launcher start `python -m legato.pipeline.worker` there (`spawn`),
and watches the result through the `subprocess.Popen` methods it always used (`poll`, `wait`, `terminate`,
`kill`, `pid`, `returncode`, `stdout`). `release` is called once the worker is gone, in the deployment's
shutdown order.

`LocalLauncher` spawns a child of the server (the only behaviour before launchers existed);
`RayLauncher` (`ray_launcher.py`, needs the `ray` extra) puts every worker in a Ray actor.
"""

from __future__ import annotations

import os
import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import legato
from legato.pipeline.kv_links import KVLinkSpec

LAUNCHERS = ("local", "ray")
RAY_MISSING = "--launcher ray needs Ray: pip install 'legato[ray]'"


class LauncherError(RuntimeError):
    """A deployment the launcher cannot place or start (unknown launcher, Ray missing, no room)."""


@dataclass(frozen=True)
class WorkerPlan:
    """One worker of a deployment, as the launcher needs to place it (before any starts)."""

    name: str  # e.g. "replica1", "prefill0", "decode0", "talker", "codec", "engine"
    num_gpus: float = 0.0  # whole or fractional; 0 on CPU


@dataclass(frozen=True)
class Placement:
    """Where a worker runs, as its control channel and KV links need to know."""

    same_node: bool  # on the server's node: the control channel stays ipc://
    host: str = "127.0.0.1"  # the address others reach the worker's node at
    node_id: str = ""
    server_host: str = "127.0.0.1"  # the address the worker reaches the server at (tcp:// binds there)


def worker_env(torch_threads: int | None) -> dict[str, str]:
    """The environment a worker process gets on top of its host's: this legato first on its path."""
    root = str(Path(legato.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if torch_threads:
        env["OMP_NUM_THREADS"] = str(torch_threads)
    return env


def worker_argv(spec_json: str) -> list[str]:
    # -P (Python >= 3.11): the working directory is not put on sys.path, so nothing there shadows legato.
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", "legato.pipeline.worker", spec_json]


def spawn_worker(spec_json: str, env: dict[str, str]) -> subprocess.Popen:
    """Starts one worker process, its stdout and stderr on one pipe.

    A session of its own: a Ctrl-C at the terminal reaches the server only, which then shuts the worker
    down in order (the worker still exits by itself if its parent dies)."""
    return subprocess.Popen(worker_argv(spec_json), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


class Launcher(ABC):
    """Starts the workers of one deployment. `plan` first (all workers), then per worker: `place`, `spawn`,
    and `release` once its process is gone."""

    def plan(self, workers: list[WorkerPlan]) -> None:  # noqa: B027 (the local launcher needs no plan)
        """Every worker of the deployment, before any is placed (a placement group needs them all)."""

    @abstractmethod
    async def place(self, name: str) -> Placement:
        """Where worker `name` will run (for a launcher that places workers: it is placed now)."""

    @abstractmethod
    async def spawn(self, name: str, spec_json: str, torch_threads: int | None) -> subprocess.Popen:
        """Starts the worker; the result behaves as a `subprocess.Popen` of it."""

    async def link(self, kv: KVLinkSpec) -> KVLinkSpec:
        """A process MpNd worker's KV-link spec with its addresses filled in (see `KVLinkSpec.listen`); on one
        host the links use Unix sockets named from the instance id, as given."""
        return kv

    async def release(self, name: str) -> None:  # noqa: B027 (nothing to give back for a child process)
        """Worker `name`'s process is gone: give back what hosted it."""


class LocalLauncher(Launcher):
    """Every worker a child process of the server, on the server's host; `env` is added to each worker's
    environment (e.g. the MPS daemon's pipe directory)."""

    def __init__(self, env: dict[str, str] | None = None):
        self.env = dict(env or {})

    async def place(self, name: str) -> Placement:
        return Placement(same_node=True)

    async def spawn(self, name: str, spec_json: str, torch_threads: int | None) -> subprocess.Popen:
        return spawn_worker(spec_json, {**worker_env(torch_threads), **self.env})


def parse_node_resources(items: list[str]) -> dict[str, str]:
    """`--ray-node-resource WORKER=RESOURCE` items as {worker: resource}; LauncherError for a malformed one."""
    pins = {}
    for item in items:
        worker, sep, resource = item.partition("=")
        if not sep or not worker.strip() or not resource.strip():
            raise LauncherError(f"--ray-node-resource takes WORKER=RESOURCE, got {item!r}")
        pins[worker.strip()] = resource.strip()
    return pins


def make_launcher(kind: str, ray_options: dict | None = None) -> Launcher:
    """The launcher named `kind`; "ray" imports Ray now and raises LauncherError(RAY_MISSING) without it."""
    if kind == "local":
        return LocalLauncher()
    if kind == "ray":
        address = (ray_options or {}).get("address")
        if address is None or address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost"):
            # Ray turns a loopback address into the machine's outward one before it connects (or starts a
            # node); this keeps a loopback cluster on loopback. Read when Ray is imported, hence here.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        try:
            from legato.pipeline.ray_launcher import RayLauncher, RayOptions
        except ImportError as e:
            if (e.name or "").split(".")[0] != "ray":
                raise
            raise LauncherError(RAY_MISSING) from None
        return RayLauncher(RayOptions(**(ray_options or {})))
    raise LauncherError(f"unknown launcher {kind!r}; choose one of: {', '.join(LAUNCHERS)}")
