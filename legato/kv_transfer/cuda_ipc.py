"""Same host, GPU to GPU: the handoff stays in device memory and the receiver copies it through a CUDA IPC handle.

`shm` carries a GPU handoff through the host: the sender copies the KV down into shared memory and the
receiver copies it up again. Here the sender packs the handoff's tensors into one device buffer (the
"arena", one per handoff, laid out like the wire form's tensor regions) and offers its CUDA IPC handle; the
receiver opens the handle, copies the arena into a buffer of its own GPU on a side stream, waits for that
copy, and acks. The sender keeps the arena until the ack, a reject, a decline, the deadline, a cancel or
close (the `LinkConnector` protocol): nothing is freed or reused while the peer may still read it.

The offer is JSON like every other backend's: the handoff's scalar fields (`handoff_header`), the tensor
specs (dtype, shape, offset), and the handle's fields. The GPU is named by its UUID, not its index, since
two processes may number their GPUs differently (`CUDA_VISIBLE_DEVICES`); a receiver that cannot see the
sender's GPU fails that transfer with a transport error. Two processes on one GPU work the same way.

The handle mechanism is torch's own (`torch.multiprocessing.reductions`: the producer's event orders the
read after the arena's writes, and a shared reference count keeps the memory mapped while the receiver
holds it). `CudaIpc` wraps it; the carrier takes any object with its `export`/`open` pair, so its packing
and lifetime are tested on the CPU with an in-process stand-in, while the handles themselves need CUDA.
"""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Callable

import torch

from legato.kv_transfer.handoff import (
    Handoff,
    HandoffFormatError,
    KVLayout,
    copy_regions,
    handoff_from_parts,
    handoff_header,
    handoff_tensors,
    pack_offsets,
    tensor_region,
    tensor_spec,
)
from legato.kv_transfer.link import LinkConnector
from legato.kv_transfer.transport import Carrier, Channel, Message

_HANDLE_FIELDS = ("handle", "ref_handle", "event")


class CudaIpcUnavailable(RuntimeError):
    """This process cannot use CUDA IPC (no CUDA device, or a CPU engine)."""


def require_cuda_device(device: str | torch.device | None) -> torch.device:
    """The CUDA device the carrier works on (the current one for None); raises CudaIpcUnavailable, in one
    line, where there is none."""
    if device is not None and torch.device(device).type != "cuda":
        raise CudaIpcUnavailable(f"the cuda_ipc KV backend moves handoffs between CUDA devices; this worker runs "
                                 f"on {device} (use --kv-transfer shm)")
    if not torch.cuda.is_available():
        raise CudaIpcUnavailable("the cuda_ipc KV backend needs CUDA, and this process sees no CUDA device "
                                 "(use --kv-transfer shm)")
    return torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class CudaIpc:
    """Exports a device buffer as a JSON-able CUDA IPC handle, and opens a peer's."""

    def __init__(self, device: torch.device) -> None:
        self.device = require_cuda_device(device)

    def export(self, arena: torch.Tensor) -> Message:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        rebuild, args = reduce_tensor(arena)
        if rebuild is not rebuild_cuda_tensor:
            raise OSError(f"cannot export a {arena.device} buffer through CUDA IPC")
        (_cls, _size, _stride, offset, _storage_cls, _dtype, index, handle, size_bytes, offset_bytes, _grad,
         ref_handle, ref_offset, event, event_sync) = args
        msg = {"gpu": _gpu_uuid(index), "numel": arena.numel(), "tensor_offset": offset, "size_bytes": size_bytes,
               "offset_bytes": offset_bytes, "ref_offset": ref_offset, "event_sync": bool(event_sync),
               "handle": handle, "ref_handle": ref_handle, "event": event}
        for key in _HANDLE_FIELDS:  # bytes -> text: the offer is JSON
            msg[key] = None if msg[key] is None else base64.b64encode(msg[key]).decode()
        return msg

    def open(self, msg: Message) -> torch.Tensor:
        """The peer's buffer (uint8, on the sender's GPU as this process numbers it). Raises OSError when it
        cannot be opened: the GPU is not visible here, or the driver refuses the handle."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = next((i for i in range(torch.cuda.device_count()) if _gpu_uuid(i) == msg["gpu"]), None)
        if index is None:
            raise OSError(f"the sender's GPU {msg['gpu']} is not visible to this process")
        raw = {k: None if msg[k] is None else base64.b64decode(msg[k]) for k in _HANDLE_FIELDS}
        try:
            # The argument order of torch's own rebuild, as `reduce_tensor` produced it on the sender.
            return rebuild_cuda_tensor(
                torch.Tensor, torch.Size([int(msg["numel"])]), (1,), int(msg["tensor_offset"]),
                torch.storage.TypedStorage, torch.uint8, index, raw["handle"], int(msg["size_bytes"]),
                int(msg["offset_bytes"]), False, raw["ref_handle"], int(msg["ref_offset"]), raw["event"],
                bool(msg["event_sync"]))
        except RuntimeError as e:
            raise OSError(f"cannot open the sender's CUDA IPC handle: {e}") from e


class CudaIpcCarrier(Carrier):
    """Handoffs as device arenas offered by handle. `ipc` is a `CudaIpc` (the default) or a stand-in with
    the same `export`/`open`; `device` is where received handoffs land (also the sender's default)."""

    def __init__(self, device: str | torch.device | None = None, ipc: CudaIpc | None = None) -> None:
        if ipc is None:
            self.device = require_cuda_device(device)
            ipc = CudaIpc(self.device)
        else:
            self.device = torch.device(device or "cpu")
        self.ipc = ipc
        self._own: dict[str, torch.Tensor] = {}  # request id -> the arena the peer may still read
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def published(self) -> list[str]:
        """The requests whose arena is held for the peer (until ack, reject, decline, deadline, cancel or
        close)."""
        return sorted(self._own)

    def publish(self, handoff: Handoff) -> tuple[Message, int]:
        handoff.validate()
        tensors = handoff_tensors(handoff)
        specs = {name: tensor_spec(t) for name, t in tensors.items()}
        total = pack_offsets(specs, 0)
        device = handoff.kv.device if handoff.kv.device.type == self.device.type else self.device
        arena = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
        copy_regions(arena, tensors, specs)
        # Exported after the copies are queued: the handle's event orders the peer's read after them.
        locator = {"header": handoff_header(handoff), "tensors": specs, "nbytes": total,
                   "ipc": self.ipc.export(arena)}
        self._own[handoff.request_id] = arena
        return locator, total

    def fetch(self, peer_id: str, request_id: str, locator: Message) -> Handoff:
        header, specs, total = locator["header"], locator["tensors"], int(locator["nbytes"])
        if header.get("request_id") != request_id:
            raise HandoffFormatError(f"offer for {request_id!r} carries request {header.get('request_id')!r}")
        regions = {name: tensor_region(spec, total) for name, spec in specs.items()}
        with self._on_copy_stream():
            peer = self.ipc.open(locator["ipc"])  # the current stream waits for the sender's writes
            if peer.dtype != torch.uint8 or peer.dim() != 1 or peer.numel() < total:
                raise HandoffFormatError(f"the peer's buffer holds {peer.numel()} bytes, the offer says {total}")
            own = torch.empty(max(total, 1), dtype=torch.uint8, device=self.device)
            own[:total].copy_(peer[:total], non_blocking=True)
            if self._copy_stream is not None:
                self._copy_stream.synchronize()  # the copy is done before the ack lets the sender free its arena
                # The engine reads `own` on the default stream: the allocator must not reuse it before that.
                own.record_stream(torch.cuda.default_stream(self.device))
        del peer  # drops this process's reference to the sender's memory
        tensors = {}
        for name, (dtype, shape, nbytes, offset) in regions.items():
            t = own[offset: offset + nbytes].view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
            tensors[name] = t.cpu() if name == "ref_code" else t  # the codec takes reference codes on the host
        return handoff_from_parts(header, tensors)

    def discard(self, request_id: str) -> None:
        self._own.pop(request_id, None)

    def reap(self, peer_id: str, request_id: str) -> None:
        """Nothing to do: the arena is the sender's, freed by it (or by the driver when its process ends)."""

    def close(self) -> None:
        self._own.clear()

    def _on_copy_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self._copy_stream) if self._copy_stream is not None else contextlib.nullcontext()


class CudaIpcConnector(LinkConnector):
    """One end of a same-host GPU link: the `LinkConnector` protocol over `channel`, payloads by CUDA IPC.
    `device` is this worker's CUDA device. Raises CudaIpcUnavailable, in one line, without CUDA."""

    def __init__(self, layout: KVLayout, channel: Channel, instance_id: str, device: str | None = None,
                 clock: Callable[[], float] = time.monotonic, ipc: CudaIpc | None = None) -> None:
        from multiprocessing.connection import Connection

        from legato.kv_transfer.shm import ConnectionChannel

        if isinstance(channel, Connection):
            channel = ConnectionChannel(channel)
        super().__init__(layout, channel, CudaIpcCarrier(device, ipc), instance_id, clock)
