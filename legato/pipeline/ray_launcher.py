"""`--launcher ray`: every worker of a deployment in a Ray actor, all placed through one placement group.

Each worker gets a `WorkerHost` actor with the CPUs and GPUs (whole or a fraction) it needs, in the bundle
of the placement group that the deployment's strategy places (`pack`, `spread`, or pinned to a node by a
custom resource per role: `RayOptions.node_resources`). The actor runs the unchanged worker main
(`python -m legato.pipeline.worker`) as its own child process, with Ray's GPU assignment in its environment,
so the worker is the same program under either launcher; the actor reports where it runs, relays its log,
and is how the server sees it die: a killed actor (`ray.kill`, a lost node) reads as a dead worker process,
and its child, orphaned, exits by itself. Method arguments are JSON strings and plain numbers only: the
control channel itself stays ZMQ (`ipc://` on the server's node, `tcp://` otherwise), pickle-free.

Actors are not restarted by Ray (`max_restarts=0`): a worker's links and in-flight requests die with it,
and the router already fails or recomputes those requests; a replacement would be a new deployment.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from legato.pipeline.kv_links import KVLinkSpec
from legato.pipeline.launchers import Launcher, LauncherError, Placement, WorkerPlan, spawn_worker, worker_env

log = logging.getLogger(__name__)

PLACEMENTS = {"pack": "PACK", "spread": "SPREAD"}
ROLES = ("engine", "replica", "prefill", "decode", "talker", "codec")
_PIN = 0.001  # of a node's custom resource per pinned worker: many workers may share one node


@dataclass
class RayOptions:
    """How a deployment is placed on Ray (the `--ray-*` serve flags)."""

    address: str | None = None  # join this cluster; None starts a local one on 127.0.0.1
    placement: str = "pack"  # pack | spread: the placement group's strategy (soft: Ray's PACK / SPREAD)
    node_resources: dict[str, str] = field(default_factory=dict)  # role or worker name -> custom resource
    cpus_per_worker: float = 1.0
    place_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise LauncherError(f"--ray-placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        for key in self.node_resources:
            if key.rstrip("0123456789") not in ROLES:
                raise LauncherError(f"--ray-node-resource {key}=...: not a role ({', '.join(ROLES)}) or a worker "
                                    "name (a role and its index, e.g. decode0)")

    def resource_of(self, name: str) -> str | None:
        """The custom resource pinning worker `name`: its own entry, else its role's."""
        return self.node_resources.get(name) or self.node_resources.get(name.rstrip("0123456789"))


class WorkerHost:
    """The Ray actor hosting one worker process (runs on the worker's node; see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: subprocess.Popen | None = None
        self._lines: collections.deque[str] = collections.deque(maxlen=2000)
        self._dropped = 0  # lines fallen off the front of `_lines`
        self._ended = False
        self._cond = threading.Condition()

    def where(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "host": ray.util.get_node_ip_address()}

    def free_port(self) -> int:
        """A TCP port free on this node's address now (for a KV-link listener the worker binds next)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def spawn(self, spec_json: str, torch_threads: int | None) -> int:
        spec = json.loads(spec_json)
        spec["parent_pid"] = os.getpid()  # the worker exits by itself when this actor is gone
        if str(spec["engine_config"].get("device", "")).startswith("cuda"):
            spec["engine_config"]["device"] = "cuda:0"  # Ray's CUDA_VISIBLE_DEVICES shows us our GPU first
        self.proc = spawn_worker(json.dumps(spec), worker_env(torch_threads))
        threading.Thread(target=self._pump_log, name=f"log-{self.name}", daemon=True).start()
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, how: str) -> None:
        if self.proc is not None and how in ("terminate", "kill"):
            getattr(self.proc, how)()

    def read_log(self, offset: int, wait_s: float) -> tuple[list[str], int, bool]:
        """Lines from `offset` on (waiting up to `wait_s` for one), the next offset, and whether the log ended."""
        with self._cond:
            self._cond.wait_for(lambda: self._ended or self._dropped + len(self._lines) > offset, timeout=wait_s)
            start = max(offset, self._dropped)
            lines = list(self._lines)[start - self._dropped:]
            end = self._dropped + len(self._lines)
            return lines, end, self._ended and start + len(lines) >= end

    def _pump_log(self) -> None:
        for raw in self.proc.stdout:
            with self._cond:
                if len(self._lines) == self._lines.maxlen:
                    self._dropped += 1
                self._lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._ended = True
            self._cond.notify_all()


class _RemoteLog:
    """The worker's output as `Popen.stdout` reads it: byte lines, ending when the worker or its actor does."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def __iter__(self):
        offset = 0
        while True:
            try:
                lines, offset, ended = ray.get(self.actor.read_log.remote(offset, 1.0), timeout=30.0)
            except GetTimeoutError:
                continue
            except RayActorError:
                return
            for line in lines:
                yield (line + "\n").encode()
            if ended:
                return

    def close(self) -> None:
        pass


class RayWorkerProcess:
    """A worker process in a `WorkerHost` actor, behind the `subprocess.Popen` methods `ProcessEngineClient`
    uses. `poll` never blocks: it reads the answer of the last probe sent to the actor, if it came."""

    def __init__(self, actor, pid: int, name: str) -> None:
        self.actor, self.pid, self.args = actor, pid, name
        self.returncode: int | None = None
        self.death: str | None = None  # why, when the actor itself died
        self.stdout = _RemoteLog(actor)
        self._probe = None
        self._next_probe = 0.0
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            now = time.monotonic()
            if self._probe is None and now >= self._next_probe:
                self._probe = self.actor.poll.remote()
            if self._probe is not None and ray.wait([self._probe], timeout=0)[0]:
                probe, self._probe, self._next_probe = self._probe, None, now + 0.2
                try:
                    self.returncode = ray.get(probe)
                except RayActorError as e:
                    self.returncode = -9
                    self.death = f"its Ray actor died: {str(e).strip().splitlines()[0][:300]}"
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def terminate(self) -> None:
        self.actor.signal.remote("terminate")

    def kill(self) -> None:
        self.actor.signal.remote("kill")


class RayLauncher(Launcher):
    """Places a deployment's workers on a Ray cluster. Each worker's first `place` places them all."""

    def __init__(self, options: RayOptions) -> None:
        self.options = options
        self.workers: list[WorkerPlan] = []
        self.actors: dict[str, object] = {}
        self.placements: dict[str, Placement] = {}
        self.placement_group = None
        self._owns_ray = False
        self._released: set[str] = set()
        self._links: tuple[list[str], dict[str, str]] | None = None
        self._lock = asyncio.Lock()

    def plan(self, workers: list[WorkerPlan]) -> None:
        names = [w.name for w in workers]
        unknown = set(self.options.node_resources) - set(names) - {n.rstrip("0123456789") for n in names}
        if unknown:
            raise LauncherError(f"--ray-node-resource names {', '.join(sorted(unknown))}, which this deployment "
                                f"does not run (its workers: {', '.join(names)})")
        self.workers = list(workers)
        # Now, on the caller's (main) thread, before the server installs its signal handlers: Ray's own
        # SIGTERM handler, installed by ray.init, would otherwise abort the process instead of letting the
        # server drain.
        self._connect()

    async def place(self, name: str) -> Placement:
        async with self._lock:
            if self.placement_group is None:
                await asyncio.get_running_loop().run_in_executor(None, self._place_all)
        return self.placements[name]

    async def spawn(self, name: str, spec_json: str, torch_threads: int | None) -> RayWorkerProcess:
        actor = self.actors[name]
        ref = actor.spawn.remote(spec_json, torch_threads)
        pid = await asyncio.get_running_loop().run_in_executor(None, ray.get, ref)
        return RayWorkerProcess(actor, pid, name)

    async def link(self, kv: KVLinkSpec) -> KVLinkSpec:
        """Process MpNd across nodes: decode workers listen on TCP at their node's address (prefill workers
        dial it); all on one node, the links stay on Unix sockets."""
        async with self._lock:
            if self._links is None:
                self._links = await asyncio.get_running_loop().run_in_executor(None, self._link_addresses)
        listens, hosts = self._links
        if any(listens) and kv.backend == "shm":
            raise LauncherError("--kv-transfer shm needs prefill and decode workers on one node; these are placed "
                                "on several: use --kv-transfer mooncake (or pin them to one node)")
        me = f"{kv.role}{kv.index}"
        backends = []
        if kv.backend == "auto":  # per link: shm within a node, mooncake between nodes
            other = "prefill" if kv.role == "decode" else "decode"
            node = self.placements[me].node_id
            backends = ["shm" if self.placements[f"{other}{i}"].node_id == node else "mooncake"
                        for i in range(kv.peers)]
        if kv.role == "decode":
            return replace(kv, listen=listens[kv.index], host=hosts[me], peer_backends=backends)
        return replace(kv, peer_addresses=list(listens), host=hosts[me], peer_backends=backends)

    async def release(self, name: str) -> None:
        actor = self.actors.get(name)
        if actor is None or name in self._released:
            return
        self._released.add(name)
        await asyncio.get_running_loop().run_in_executor(None, self._release, name, actor)

    # --- blocking Ray calls (on an executor thread) --------------------------------------------------

    def _connect(self) -> None:
        if ray.is_initialized():
            return
        opts = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
        if self.options.address is None:  # a local cluster, bound to loopback only
            need = max(1.0, self.options.cpus_per_worker * len(self.workers))
            # A small object store: actor calls carry only strings and numbers, nothing big goes through it.
            # address="local": a new instance even when this machine already runs one (None would join it).
            ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=int(need + 0.999),
                     object_store_memory=100 * 2**20, **opts)
        else:
            ray.init(address=self.options.address, **opts)
        self._owns_ray = True

    def _place_all(self) -> None:
        self._connect()
        cpus = self.options.cpus_per_worker
        bundles = []
        for w in self.workers:
            bundle = {"CPU": cpus}
            if w.num_gpus > 0:
                bundle["GPU"] = w.num_gpus
            res = self.options.resource_of(w.name)
            if res:
                bundle[res] = _PIN
            bundles.append(bundle)
        pg = placement_group(bundles, strategy=PLACEMENTS[self.options.placement])
        try:
            ray.get(pg.ready(), timeout=self.options.place_timeout_s)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise LauncherError(f"Ray could not place the deployment's workers within "
                                f"{self.options.place_timeout_s:.0f} s: they need {bundles}; the cluster has "
                                f"{ray.available_resources()} free") from None
        self.placement_group = pg
        for i, w in enumerate(self.workers):
            self.actors[w.name] = ray.remote(WorkerHost).options(
                num_cpus=cpus, num_gpus=w.num_gpus, max_restarts=0, max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote(w.name)
        server_node = ray.get_runtime_context().get_node_id()
        server_host = ray.util.get_node_ip_address()
        where = ray.get([self.actors[w.name].where.remote() for w in self.workers],
                        timeout=self.options.place_timeout_s)
        for w, at in zip(self.workers, where, strict=True):
            self.placements[w.name] = Placement(same_node=at["node_id"] == server_node, host=at["host"],
                                                node_id=at["node_id"], server_host=server_host)
            log.info("Ray placed worker %s on node %s (%s)", w.name, at["node_id"][:12], at["host"])

    def _link_addresses(self) -> tuple[list[str], dict[str, str]]:
        decode = [w.name for w in self.workers if w.name.startswith("decode")]
        pd = [w.name for w in self.workers if w.name.startswith(("prefill", "decode"))]
        hosts = {n: self.placements[n].host for n in pd}
        if len({self.placements[n].node_id for n in pd}) == 1:
            return [""] * len(decode), hosts
        ports = ray.get([self.actors[n].free_port.remote() for n in decode], timeout=30.0)
        return [f"tcp://{hosts[n]}:{p}" for n, p in zip(decode, ports, strict=True)], hosts

    def _release(self, name: str, actor) -> None:
        ray.kill(actor, no_restart=True)
        if len(self._released) < len(self.actors):
            return
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
