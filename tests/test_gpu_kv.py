"""The cuda_ipc KV link on a GPU: handles between real processes, and process 1p1d over it against `single`.
Skipped without a GPU; on the CPU, test_kv_transfer.py runs the same carrier's packing, offers and arena
lifetime with a stand-in for the handles, and its refusal without CUDA."""

from __future__ import annotations

import asyncio
import multiprocessing
import uuid

import numpy as np
import pytest
import torch
from client_helpers import gather_streams, mixed_requests
from kv_transfer_helpers import child_report, make_handoff, sender_main, small_layout, wait_events

from legato.engine.config import EngineConfig
from legato.kv_transfer import EventKind, FailReason
from legato.kv_transfer.cuda_ipc import CudaIpcConnector
from legato.pipeline.topology import build_client, parse_topology

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU twins run elsewhere)"),
]


def test_cuda_ipc_carries_handoffs_between_processes():
    """A spawned sender's handoffs arrive whole on this process's GPU, one after another (so arenas are
    freed and reused), and a cancel still reaches the sender."""
    ctx = multiprocessing.get_context("spawn")
    lay = small_layout()
    kv_parent, kv_child = ctx.Pipe()
    cmd_parent, cmd_child = ctx.Pipe()
    child = ctx.Process(target=sender_main, args=(kv_child, cmd_child, lay.to_dict(), f"gs{uuid.uuid4().hex[:8]}",
                                                  "cuda_ipc"), daemon=True)
    child.start()
    cmd_child.close()
    recv = CudaIpcConnector(lay, kv_parent, f"gr{uuid.uuid4().hex[:8]}", device="cuda:0")
    try:
        recv.connect(60.0)
        assert child_report(cmd_parent, 60.0) == ("ready",)
        for i in range(5):
            rid = f"g{i}"
            recv.receive(rid, 10.0, num_tokens=10)
            cmd_parent.send(("send", rid, 20 + i, 10.0))
            (ev,) = wait_events(recv, 1, timeout_s=30.0)
            assert ev.kind is EventKind.RECEIVED, ev
            want, got = make_handoff(lay, rid, 20 + i), ev.handoff
            assert got.kv.device.type == "cuda" and torch.equal(got.kv.cpu(), want.kv)
            assert torch.equal(got.last_hidden.cpu(), want.last_hidden)
            assert torch.equal(got.trailing_text.cpu(), want.trailing_text) and torch.equal(got.ref_code, want.ref_code)
            assert (got.first_token, got.seed, got.sampling) == (want.first_token, want.seed, want.sampling)
            assert child_report(cmd_parent, 60.0) == ("event", rid, "sent", None)
        recv.receive("cut", 10.0)
        recv.cancel("cut")
        cmd_parent.send(("send", "cut", 30, 10.0))
        assert child_report(cmd_parent, 60.0) == ("event", "cut", "failed", FailReason.PEER_CANCELLED.value)
        cmd_parent.send(("exit",))
        assert child_report(cmd_parent, 60.0) == ("bye",)
    finally:
        if child.is_alive():
            child.kill()
        recv.close()


def _config(**kw) -> EngineConfig:
    return EngineConfig(device="cuda:0", dtype="float32", max_num_seqs=32, num_kv_blocks=256, max_model_len=512,
                        max_num_batched_tokens=512, batch_invariant=True, **kw)


def test_process_1p1d_over_cuda_ipc_gives_the_codes_of_single(tiny_checkpoint):
    """Prefill and decode workers in their own processes on one GPU, every handoff over cuda_ipc: seeded
    and greedy requests give `single`'s codes at concurrency 1, 8 and 32 (batch-invariant mode)."""
    from legato.models.qwen3_tts.loader import load_model

    reqs = {c: mixed_requests(32, prefix=f"c{c}-") for c in (1, 8, 32)}
    single = build_client(parse_topology("single"), lambda d: load_model(tiny_checkpoint, device=d), _config())
    pd = build_client(parse_topology("1p1d"), None, _config(), workers="process", model_path=str(tiny_checkpoint),
                      process_options={"torch_threads": 1, "start_timeout_s": 180}, kv_backend="cuda_ipc")

    async def run(client):
        await client.start()
        try:
            return {c: await gather_streams(client, rs, c) for c, rs in reqs.items()}
        finally:
            await client.stop()

    want, got = asyncio.run(run(single)), asyncio.run(run(pd))
    for c in reqs:
        for i, (w, g) in enumerate(zip(want[c], got[c], strict=True)):
            assert g[-1].finish_reason == w[-1].finish_reason == "length", (c, i, g[-1])
            codes = [np.concatenate([x.codes for x in chunks if x.codes is not None]) for chunks in (w, g)]
            assert np.array_equal(*codes), (c, i)
