"""Helpers for the KV-transfer tests, importable by a spawned child process (no pytest, no fixtures)."""

from __future__ import annotations

import dataclasses
import time
import uuid
import weakref

import torch

from legato.kv_transfer.handoff import Handoff, KVLayout, blocks_for
from legato.models.qwen3_tts.sampling import SamplingParams

HIDDEN = 16


def small_layout(dtype: str = "bfloat16", **changes: object) -> KVLayout:
    fields = dict(dtype=dtype, block_size=4, num_layers=3, kv_heads=2, head_dim=8, model_hash="tiny-abc123")
    fields.update(changes)
    return KVLayout(**fields)


def make_handoff(layout: KVLayout, request_id: str, seed: int, num_tokens: int = 10, ref: bool = True) -> Handoff:
    """A deterministic handoff: the same (layout, request_id, seed) always gives the same bytes."""
    g = torch.Generator().manual_seed(seed)
    nb = blocks_for(num_tokens, layout.block_size)
    shape = (layout.num_layers, 2, nb, layout.block_size, layout.kv_heads, layout.head_dim)
    kv = torch.randn(shape, generator=g).to(layout.torch_dtype)
    return Handoff(
        request_id=request_id,
        layout=layout,
        num_tokens=num_tokens,
        kv=kv,
        last_hidden=torch.randn(HIDDEN, generator=g),
        first_token=int(torch.randint(0, 2048, (1,), generator=g)),
        trailing_text=torch.randn(3, HIDDEN, generator=g),
        sampling=SamplingParams(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.1, seed=seed),
        seed=seed * 1000 + 7,
        max_frames=321,
        ignore_eos=True,
        first_chunk_frames=2,
        ref_code=torch.randint(0, 2048, (5, 16), generator=g) if ref else None,
        text_open=seed % 2 == 1,  # odd seeds: a request whose text is still arriving
        text_tokens=seed % 17,
    )


class HostIpc:
    """A test stand-in for `CudaIpc` between two carriers of one process: a handle names a buffer in a shared
    registry, held weakly, so a buffer its sender has freed cannot be opened any more (as a freed CUDA
    allocation's handle cannot)."""

    def __init__(self, registry: dict) -> None:
        self.registry = registry

    def export(self, arena: torch.Tensor) -> dict:
        key = uuid.uuid4().hex
        self.registry[key] = weakref.ref(arena)
        return {"key": key}

    def open(self, msg: dict) -> torch.Tensor:
        ref = self.registry.get(msg["key"])
        arena = ref() if ref is not None else None
        if arena is None:
            raise OSError(f"buffer {msg['key']} is gone")
        return arena


def wait_events(conn, want: int, timeout_s: float = 10.0) -> list:
    """Polls `conn` until it has given `want` events or `timeout_s` has passed."""
    events, end = [], time.monotonic() + timeout_s
    while len(events) < want and time.monotonic() < end:
        events += conn.poll()
        time.sleep(0.002)
    return events


def child_report(cmd, timeout_s: float = 30.0):
    """The next report of a sender child over its command pipe."""
    assert cmd.poll(timeout_s), "child did not answer"
    return cmd.recv()


def on_device(h: Handoff, device: str) -> Handoff:
    """`h` with its KV and hidden states on `device` (as a prefill engine's handoff is; ref codes stay on the host)."""
    return dataclasses.replace(h, kv=h.kv.to(device), last_hidden=h.last_hidden.to(device),
                               trailing_text=h.trailing_text.to(device))


def sender_main(kv_conn, cmd_conn, layout: dict, instance_id: str, backend: str = "shm") -> None:
    """Child process: the prefill end of a shm (or, on CUDA, cuda_ipc) link, driven by test commands over
    `cmd_conn`.

    Commands: ("send", rid, seed, deadline_s), ("stall_send", rid, seed, deadline_s) (creates the segment
    and then hangs before writing it, to be killed mid-transfer), ("exit",). Reports ("ready",) once the
    handshake is done and ("event", rid, kind, reason) for every event."""
    from legato.kv_transfer import shm

    lay = KVLayout.from_dict(layout)
    if backend == "cuda_ipc":
        from legato.kv_transfer.cuda_ipc import CudaIpcConnector

        conn = CudaIpcConnector(lay, kv_conn, instance_id, device="cuda")
    else:
        conn = shm.ShmConnector(lay, kv_conn, instance_id)
    device = "cuda" if backend == "cuda_ipc" else "cpu"
    conn.connect(30.0)
    cmd_conn.send(("ready",))
    while True:
        for ev in conn.poll():
            cmd_conn.send(("event", ev.request_id, ev.kind.value, ev.reason.value if ev.reason else None))
        if not cmd_conn.poll(0.005):
            continue
        cmd = cmd_conn.recv()
        if cmd[0] == "send":
            conn.send(on_device(make_handoff(lay, cmd[1], cmd[2]), device), cmd[3])
        elif cmd[0] == "stall_send":
            def stalled(*args, **kwargs):
                time.sleep(600)

            shm.write_handoff = stalled
            conn.send(make_handoff(lay, cmd[1], cmd[2]), cmd[3])
        elif cmd[0] == "exit":
            conn.close()
            cmd_conn.send(("bye",))
            return
