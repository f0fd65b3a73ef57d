"""Topology names and how they become an `EngineClient`.

Supported: `single` (one engine), `split` (a talker engine streaming codes to a codec worker),
`replicas:N` (N engines behind the least-loaded router) and `MpNd` (M prefill engines handing requests to N
decode engines), each engine on its own thread or (workers="process") in its own worker process, on its
device. Process MpNd moves each handoff over a KV link between the two workers (`kv_backend`: shm,
cuda_ipc, mooncake, or auto: each link's from its two devices, `kv_links.choose_backend`). Code-predictor
replicas are an engine setting (`EngineConfig.mtp_replicas`), so they combine with every topology; MpNd
applies them to its decode engines only.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.loader import LoadedModel
from legato.pipeline.client import EngineClient
from legato.pipeline.launchers import Launcher, WorkerPlan
from legato.pipeline.local import LocalEngineClient
from legato.pipeline.mps import PIPE_ENV, gpu_of, shared_gpus
from legato.pipeline.pd import LinkedPrefillDecodeRouter, PrefillDecodeRouter, check_pd_options
from legato.pipeline.router import ReplicaRouter

log = logging.getLogger(__name__)


class TopologyError(ValueError):
    """An unknown or unsupported topology, or devices that do not fit it."""


@dataclass(frozen=True)
class Topology:
    kind: str  # single | split | replicas | pd
    replicas: int = 1  # replicas: N; pd: the number of prefill engines (M)
    decode: int = 0  # pd: the number of decode engines (N)

    @property
    def num_workers(self) -> int:
        return 2 if self.kind == "split" else self.replicas + self.decode

    @property
    def decode_engines(self) -> int:
        """Engines that decode requests side by side (`max_num_seqs` requests each)."""
        return {"pd": self.decode, "replicas": self.replicas}.get(self.kind, 1)

    def __str__(self) -> str:
        if self.kind == "pd":
            return f"{self.replicas}p{self.decode}d"
        return self.kind if self.kind in ("single", "split") else f"replicas:{self.replicas}"


def parse_topology(text: str) -> Topology:
    text = text.strip().lower()
    if text in ("single", "split"):
        return Topology(text)
    m = re.fullmatch(r"replicas:(\d+)", text)
    if m:
        n = int(m.group(1))
        if not 1 <= n <= 64:
            raise TopologyError(f"replicas:N needs 1 <= N <= 64, got {n}")
        return Topology("replicas", n)
    m = re.fullmatch(r"(\d+)p(\d+)d", text)
    if m:
        prefill, decode = int(m.group(1)), int(m.group(2))
        if not (1 <= prefill <= 32 and 1 <= decode <= 32):
            raise TopologyError(f"MpNd needs 1 <= M, N <= 32, got {text!r}")
        return Topology("pd", prefill, decode)
    if text.startswith("mtp"):
        raise TopologyError(f"{text!r}: code-predictor replicas are a modifier, not a topology: use "
                            "--mtp-replicas K with any topology")
    raise TopologyError(f"unknown topology {text!r}; available: single, split, replicas:N, MpNd")


def build_client(
    topology: Topology,
    load: Callable[[str], LoadedModel] | None,
    config: EngineConfig,
    devices: list[str] | None = None,
    name: str = "legato",
    workers: str = "thread",
    model_path: str | None = None,
    instance_id: str | None = None,
    process_options: dict | None = None,
    memory_shares: list[float] | None = None,
    kv_backend: str = "shm",
    kv_options: dict | None = None,
    pairing: str = "least_loaded",
    on_kv_failure: str = "fail",
    launcher: Launcher | None = None,
) -> EngineClient:
    """One engine per worker; `load(device)` loads a model copy onto a device. Workers take `devices` in
    order (several workers may share one device, each with its own KV budget from `config`).

    `workers="thread"` runs each engine on a thread of this process (`load` is called here);
    `workers="process"` runs each in its own process (`legato.pipeline.worker`) that loads `model_path`
    itself; IPC names derive from `instance_id` (a fresh one when None); `process_options` are passed on
    to `ProcessEngineClient` (e.g. torch_threads, start_timeout_s). `memory_shares` gives each worker its
    own `gpu_memory_utilization` (prefill engines first); without it, workers sharing a device split it.
    `kv_backend` and `kv_options` (KVLinkSpec fields, e.g. transfer_timeout_s) configure process MpNd's
    KV links. `config.mtp_replicas` applies to every engine except MpNd's prefill engines. MpNd picks each
    request's decode engine by `pairing` (least_loaded | round_robin); `on_kv_failure` (fail | recompute)
    says what process MpNd does with a request whose handoff did not cross (thread MpNd moves handoffs by
    reference: they cannot fail in transit). `launcher` starts the worker processes (`launchers.py`: local
    child processes by default, or Ray actors), and is given the deployment's plan here."""
    if workers not in ("thread", "process"):
        raise TopologyError(f"workers must be 'thread' or 'process', got {workers!r}")
    if launcher is not None and workers != "process":
        raise TopologyError("a launcher starts worker processes: it needs workers='process'")
    try:  # before any model is loaded
        check_pd_options(pairing, on_kv_failure)
    except ValueError as e:
        raise TopologyError(str(e)) from None
    if topology.kind == "split":
        from legato.pipeline.split import build_split_client

        try:
            return build_split_client(load, config, devices, name=name, workers=workers, model_path=model_path,
                                      instance_id=instance_id, process_options=process_options,
                                      memory_shares=memory_shares, launcher=launcher)
        except ValueError as e:
            raise TopologyError(str(e)) from None
    if workers == "process" and model_path is None:
        raise TopologyError("workers='process' needs model_path (each worker loads the model itself)")
    if workers == "process":
        from legato.pipeline.process_client import ProcessEngineClient, new_instance_id

        instance_id = instance_id or new_instance_id()
    if memory_shares is not None and len(memory_shares) != topology.num_workers:
        raise TopologyError(f"{topology} runs {topology.num_workers} workers; worker_memory names "
                            f"{len(memory_shares)}")
    devices = devices or [config.device]
    if len(devices) not in (1, topology.num_workers):
        raise TopologyError(f"{topology} runs {topology.num_workers} worker{'s' if topology.num_workers > 1 else ''}: "
                            f"give it 1 device{f' or {topology.num_workers}' if topology.num_workers > 1 else ''} "
                            f"(--devices), got {len(devices)}: {','.join(map(str, devices))}")
    if topology.kind == "pd" and workers == "process":
        from legato.kv_transfer import backend_names
        from legato.pipeline.kv_links import KVLinkSpec, choose_backend

        if kv_backend not in (*backend_names(), "auto") or kv_backend == "inproc":
            raise TopologyError(f"process MpNd needs a cross-process KV backend (shm, cuda_ipc, mooncake, or auto: "
                                f"shm within a node, mooncake between nodes), got {kv_backend!r}")
        if kv_backend == "cuda_ipc" and any(not str(d).startswith("cuda") for d in devices):
            raise TopologyError(f"the cuda_ipc KV backend moves handoffs between CUDA devices; the workers run on "
                                f"{', '.join(map(str, devices))} (use shm)")
    note = shared_gpu_note(topology, devices, mps=PIPE_ENV in getattr(launcher, "env", {}))
    if note is not None:
        log.warning(note)
    names = worker_names(topology)
    if launcher is not None and workers == "process":
        launcher.plan([WorkerPlan(n, gpu_share(devices[i % len(devices)], devices, topology.num_workers,
                                               memory_shares[i] if memory_shares else config.gpu_memory_utilization))
                       for i, n in enumerate(names)])
    clients = []
    for i in range(topology.num_workers):
        device = devices[i % len(devices)]
        cfg = dataclasses.replace(config, device=device)
        if topology.kind == "pd" and i < topology.replicas:
            cfg.mtp_replicas = 1  # the prefill engines never run the code predictor's decode loop
            cfg.prefill_only = True  # nor the codec, nor decode graphs
        if memory_shares is not None:
            cfg.gpu_memory_utilization = memory_shares[i]
        elif len(devices) == 1 and topology.num_workers > 1:
            # Workers sharing one device split its memory budget.
            cfg.gpu_memory_utilization = config.gpu_memory_utilization / topology.num_workers
        if workers == "process":
            kv = None
            if topology.kind == "pd":
                prefill = i < topology.replicas
                peers = range(topology.replicas, topology.num_workers) if prefill else range(topology.replicas)
                # `auto` per link, from the two workers' devices (all on this host; a Ray launcher re-picks
                # per node when it places them).
                backends = [choose_backend(kv_backend, device, devices[p % len(devices)]) for p in peers]
                kv = KVLinkSpec(role="prefill" if prefill else "decode",
                                index=i if prefill else i - topology.replicas, peers=len(peers),
                                instance_id=instance_id, backend=kv_backend,
                                **{"peer_backends": backends if kv_backend == "auto" else [], **(kv_options or {})})
            clients.append(ProcessEngineClient(model_path, cfg, device, name, instance_id, i,
                                               **(process_options or {}), kv=kv, launcher=launcher,
                                               worker_name=names[i]))
        else:
            clients.append(LocalEngineClient(load(device), cfg, name=name))
    if topology.kind == "pd":
        prefill, decode = clients[: topology.replicas], clients[topology.replicas :]
        if workers == "process":
            return LinkedPrefillDecodeRouter(prefill, decode, pairing=pairing, on_kv_failure=on_kv_failure)
        return PrefillDecodeRouter(prefill, decode, pairing=pairing)
    return clients[0] if topology.kind == "single" else ReplicaRouter(clients)


def shared_gpu_note(topology: Topology, devices: list[str], mps: bool = False) -> str | None:
    """What to expect of several engines on one GPU (None when no GPU holds two of them). Their processes
    time-slice the GPU, and a decode step costs about as much at 32 streams as at 64, so two half batches cost
    nearly two full steps: on an H200 at 64 streams, replicas:2 on one GPU served 0.65x single's audio-s/s and
    1p1d 0.77x; under MPS (`--mps on`) 0.78x and 0.84x (docs/benchmarks.md)."""
    if topology.kind not in ("replicas", "pd"):
        return None
    on = [gpu_of(d) for d in worker_devices(topology, devices)]
    shared = shared_gpus(on)
    if not shared:
        return None
    count = max(on.count(d) for d in shared)
    if mps:
        return (f"{topology} puts {count} engines on {', '.join(shared)}, under MPS: they share the GPU, and still "
                "serve less than one engine there (on an H200 at 64 streams: replicas:2 0.78x single, 1p1d 0.84x). "
                "Replicas and prefill-decode pay off with a GPU each")
    return (f"{topology} puts {count} engines on {', '.join(shared)}: they take turns "
            "on one GPU and each step costs nearly what a full batch's does, so they serve less than one engine "
            "there (on an H200 at 64 streams: replicas:2 0.65x single, 1p1d 0.77x; 0.78x and 0.84x with --mps on). "
            "Replicas and prefill-decode pay off with a GPU each; on one GPU serve single (with --fronts for many "
            "streams)")


def worker_devices(topology: Topology, devices: list[str]) -> list[str]:
    """The device of each of a topology's workers, in build order (split: the talker's, then the codec's)."""
    if topology.kind == "split":
        return [devices[0], devices[-1]]
    return [devices[i % len(devices)] for i in range(topology.num_workers)]


def worker_names(topology: Topology) -> list[str]:
    """The launcher's names for a topology's workers, in build order (prefill engines before decode)."""
    if topology.kind == "single":
        return ["engine"]
    if topology.kind == "split":
        return ["talker", "codec"]
    if topology.kind == "replicas":
        return [f"replica{i}" for i in range(topology.replicas)]
    return [f"prefill{i}" for i in range(topology.replicas)] + [f"decode{j}" for j in range(topology.decode)]


def gpu_share(device: str, devices: list[str], num_workers: int, memory_share: float) -> float:
    """The GPUs a worker asks its launcher for: none on CPU, its memory share of a device it shares with
    other workers, or the whole device it has alone."""
    if not device.startswith("cuda"):
        return 0.0
    sharing = num_workers if len(devices) == 1 else devices.count(device)
    return 1.0 if sharing <= 1 else min(1.0, memory_share)
