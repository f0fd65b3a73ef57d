"""Topology names and how they become an `EngineClient`.

Supported here: `single` (one engine) and `replicas:N` (N engines behind the least-loaded router), each
engine on its own thread and device. Prefill-decode disaggregation (`MpNd`), `split` and code-predictor
replicas are named by the architecture but not built yet: asking for them is a clear error.
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
from voxserve.pipeline.router import ReplicaRouter


class TopologyError(ValueError):
    """An unknown or unsupported topology, or devices that do not fit it."""


@dataclass(frozen=True)
class Topology:
    kind: str  # single | replicas
    replicas: int = 1

    @property
    def num_workers(self) -> int:
        return self.replicas

    def __str__(self) -> str:
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
    if text == "split" or re.fullmatch(r"\d+p\d+d", text) or text.startswith("mtp"):
        raise TopologyError(f"topology {text!r} is not implemented yet; available: single, replicas:N")
    raise TopologyError(f"unknown topology {text!r}; available: single, replicas:N")


def build_client(
    topology: Topology,
    load: Callable[[str], LoadedModel],
    config: EngineConfig,
    devices: list[str] | None = None,
    name: str = "voxserve",
) -> EngineClient:
    """One engine per worker; `load(device)` loads a model copy onto a device. Workers take `devices` in
    order (several workers may share one device, each with its own KV budget from `config`)."""
    devices = devices or [config.device]
    if len(devices) not in (1, topology.num_workers):
        raise TopologyError(f"{topology} runs {topology.num_workers} workers; give 1 device or "
                            f"{topology.num_workers}, got {devices}")
    clients = []
    for i in range(topology.num_workers):
        device = devices[i % len(devices)]
        cfg = dataclasses.replace(config, device=device)
        if len(devices) == 1 and topology.num_workers > 1:
            # Workers sharing one device split its memory budget.
            cfg.gpu_memory_utilization = config.gpu_memory_utilization / topology.num_workers
        clients.append(LocalEngineClient(load(device), cfg, name=name))
    return clients[0] if topology.kind == "single" else ReplicaRouter(clients)
