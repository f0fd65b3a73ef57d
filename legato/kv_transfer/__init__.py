"""Moving a prefill's result (`Handoff`: KV blocks + side state) from one engine to another.

Backends are chosen by name and imported only when chosen (`get_backend`), so an optional transport
library is needed only by the deployments that use it:

    inproc    both ends in one process (tests, single-process topologies)
    shm       same host, separate processes: POSIX shared memory + a control channel (the default)
    cuda_ipc  same host, GPU to GPU: the handoff stays in device memory, read through a CUDA IPC handle
    mooncake  cross-host over TCP/RDMA: one-sided reads from the sender's registered arena by the
              Mooncake Transfer Engine (extra: pip install legato[mooncake])
    nixl      cross-host over UCX (extra: pip install legato[nixl]); not implemented yet
"""

from __future__ import annotations

import importlib

from legato.kv_transfer.base import (
    CancelResult,
    EventKind,
    FailReason,
    KVConnector,
    LinkState,
    TransferEvent,
    TransferStats,
)
from legato.kv_transfer.handoff import (
    HANDOFF_VERSION,
    Handoff,
    HandoffFormatError,
    KVLayout,
    LayoutMismatch,
    encode_handoff,
    gather_blocks,
    read_handoff,
    scatter_blocks,
)

_BACKENDS: dict[str, tuple[str, str]] = {
    "inproc": ("legato.kv_transfer.inproc", "InprocConnector"),
    "shm": ("legato.kv_transfer.shm", "ShmConnector"),
    "cuda_ipc": ("legato.kv_transfer.cuda_ipc", "CudaIpcConnector"),
    "mooncake": ("legato.kv_transfer.mooncake", "MooncakeConnector"),
    "nixl": ("legato.kv_transfer.nixl", "NixlConnector"),
}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> type[KVConnector]:
    """The connector class registered as `name`, importing its module (and only it) now. Raises
    ValueError for an unknown name and ImportError, naming the extra to install, for a backend whose
    library is missing."""
    try:
        module, attr = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown KV transfer backend {name!r}; choose one of: {', '.join(backend_names())}") from None
    return getattr(importlib.import_module(module), attr)


__all__ = [
    "HANDOFF_VERSION", "CancelResult", "EventKind", "FailReason", "Handoff", "HandoffFormatError", "KVConnector",
    "KVLayout", "LayoutMismatch", "LinkState", "TransferEvent", "TransferStats", "backend_names",
    "encode_handoff", "gather_blocks", "get_backend", "read_handoff", "scatter_blocks",
]
