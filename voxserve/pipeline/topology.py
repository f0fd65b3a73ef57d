"""Topology names and how they become an `EngineClient`.

Supported here: `single` (one engine), `replicas:N` (N engines behind the least-loaded router) and `MpNd`
(M prefill engines handing requests to N decode engines), each engine on its own thread (or, with
workers="process", in its own process; not yet for MpNd) and device. `split` and code-predictor replicas are
named by the architecture but not built yet: asking for them is a clear error.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

from voxserve.engine.config import EngineConfig
from voxserve.models.qwen3_tts.loader import LoadedModel
from voxserve.pipeline.client import EngineClient
from voxserve.pipeline.local import LocalEngineClient
from voxserve.pipeline.pd import PrefillDecodeRouter
from voxserve.pipeline.router import ReplicaRouter


class TopologyError(ValueError):
    """An unknown or unsupported topology, or devices that do not fit it."""


@dataclass(frozen=True)
class Topology:
    kind: str  # single | replicas | pd
    replicas: int = 1  # replicas: N; pd: the number of prefill engines (M)
    decode: int = 0  # pd: the number of decode engines (N)

    @property
    def num_workers(self) -> int:
        return self.replicas + self.decode

    def __str__(self) -> str:
        if self.kind == "pd":
            return f"{self.replicas}p{self.decode}d"
        return "single" if self.kind == "single" else f"replicas:{self.replicas}"


def parse_topology(text: str) -> Topology:
    text = text.strip().lower()
    if text == "single":
        return Topology("single")
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
    if text == "split" or text.startswith("mtp"):
        raise TopologyError(f"topology {text!r} is not implemented yet; available: single, replicas:N, MpNd")
    raise TopologyError(f"unknown topology {text!r}; available: single, replicas:N, MpNd")


def build_client(
    topology: Topology,
    load: Callable[[str], LoadedModel] | None,
    config: EngineConfig,
    devices: list[str] | None = None,
    name: str = "voxserve",
    workers: str = "thread",
    model_path: str | None = None,
    instance_id: str | None = None,
    process_options: dict | None = None,
    memory_shares: list[float] | None = None,
) -> EngineClient:
    """One engine per worker; `load(device)` loads a model copy onto a device. Workers take `devices` in
    order (several workers may share one device, each with its own KV budget from `config`).

    `workers="thread"` runs each engine on a thread of this process (`load` is called here);
    `workers="process"` runs each in its own process (`voxserve.pipeline.worker`) that loads `model_path`
    itself; IPC names derive from `instance_id` (a fresh one when None); `process_options` are passed on
    to `ProcessEngineClient` (e.g. torch_threads, start_timeout_s). `memory_shares` gives each worker its
    own `gpu_memory_utilization` (prefill engines first); without it, workers sharing a device split it."""
    if workers not in ("thread", "process"):
        raise TopologyError(f"workers must be 'thread' or 'process', got {workers!r}")
    if workers == "process" and topology.kind == "pd":
        raise TopologyError("MpNd runs its engines as threads for now (workers='thread'); process workers "
                            "need the KV connector between processes")
    if workers == "process" and model_path is None:
        raise TopologyError("workers='process' needs model_path (each worker loads the model itself)")
    if workers == "process":
        from voxserve.pipeline.process_client import ProcessEngineClient, new_instance_id

        instance_id = instance_id or new_instance_id()
    if memory_shares is not None and len(memory_shares) != topology.num_workers:
        raise TopologyError(f"{topology} runs {topology.num_workers} workers; worker_memory names "
                            f"{len(memory_shares)}")
    devices = devices or [config.device]
    if len(devices) not in (1, topology.num_workers):
        raise TopologyError(f"{topology} runs {topology.num_workers} workers; give 1 device or "
                            f"{topology.num_workers}, got {devices}")
    clients = []
    for i in range(topology.num_workers):
        device = devices[i % len(devices)]
        cfg = dataclasses.replace(config, device=device)
        if memory_shares is not None:
            cfg.gpu_memory_utilization = memory_shares[i]
        elif len(devices) == 1 and topology.num_workers > 1:
            # Workers sharing one device split its memory budget.
            cfg.gpu_memory_utilization = config.gpu_memory_utilization / topology.num_workers
        if workers == "process":
            clients.append(ProcessEngineClient(model_path, cfg, device, name, instance_id, i,
                                               **(process_options or {})))
        else:
            clients.append(LocalEngineClient(load(device), cfg, name=name))
    if topology.kind == "pd":
        return PrefillDecodeRouter(clients[: topology.replicas], clients[topology.replicas :])
    return clients[0] if topology.kind == "single" else ReplicaRouter(clients)
