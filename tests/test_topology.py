"""Topology parsing and the in-process replicas router: placement, codes equal to single, aborts, stats."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.loader import load_model
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline.client import RequestRejected, SynthesisRequest
from legato.pipeline.router import ReplicaRouter
from legato.pipeline.topology import Topology, TopologyError, build_client, parse_topology, shared_gpu_note

EMB = torch.randn(64, generator=torch.Generator().manual_seed(0))


def test_parse():
    assert parse_topology("single") == Topology("single")
    assert parse_topology("Replicas:3") == Topology("replicas", 3)
    assert str(parse_topology("replicas:2")) == "replicas:2"
    assert parse_topology("1p1d") == Topology("pd", 1, 1) and str(parse_topology("3P1D")) == "3p1d"
    assert parse_topology("2p3d").num_workers == 5
    assert parse_topology("split") == Topology("split") and parse_topology("split").num_workers == 2
    # Engines decoding side by side: what /v1/models multiplies --max-num-seqs by (decode_slots).
    assert [parse_topology(t).decode_engines for t in ("single", "split", "replicas:3", "2p3d")] == [1, 1, 3, 3]
    for bad, match in [("0p1d", "1 <= M"), ("mtp:2", "--mtp-replicas"), ("replicas:0", "1 <= N"),
                       ("ring", "unknown")]:
        with pytest.raises(TopologyError, match=match):
            parse_topology(bad)


def _config() -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=128, max_model_len=512,
                        max_num_batched_tokens=256)


def _req(i: int) -> SynthesisRequest:
    inp = SpeechInput(f"Sentence number {i} is here.", language="english", speaker_embedding=EMB, x_vector_only=True)
    return SynthesisRequest(f"r{i}", inp, SamplingParams(seed=100 + i, max_new_tokens=6))


async def _run(client, n: int):
    await client.start()
    try:
        async def one(i):
            return [c async for c in client.generate(_req(i))]
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.stop()


def test_replicas_give_the_codes_and_audio_of_single(tiny_checkpoint):
    torch.set_num_threads(1)
    single = build_client(parse_topology("single"), lambda dev: load_model(tiny_checkpoint, device=dev), _config())
    router = build_client(parse_topology("replicas:2"), lambda dev: load_model(tiny_checkpoint, device=dev),
                          _config())
    assert isinstance(router, ReplicaRouter) and len(router.replicas) == 2
    want = asyncio.run(_run(single, 6))
    got = asyncio.run(_run(router, 6))
    for a, b in zip(want, got, strict=True):
        assert a[-1].finish_reason == b[-1].finish_reason == "length"
        assert a[-1].seed == b[-1].seed
        ca = np.concatenate([c.codes for c in a])
        cb = np.concatenate([c.codes for c in b])
        assert ca.shape == (5, 16) and np.array_equal(ca, cb)
        # Audio is decoded in batches whose make-up differs between topologies: equal up to float rounding.
        wa = np.concatenate([c.audio for c in a])
        wb = np.concatenate([c.audio for c in b])
        assert wa.shape == wb.shape and np.abs(wa - wb).max() < 1e-5
    # Both replicas served requests and nothing is left allocated.
    stats = router.stats()
    assert stats.free_kv_blocks == stats.num_kv_blocks == 256
    assert router.in_flight == [0, 0]


def test_least_loaded_placement():
    class Fake:
        info = None

        def __init__(self, alive=True):
            self.alive = alive

        def is_alive(self):
            return self.alive

    router = ReplicaRouter([Fake(), Fake(), Fake()])  # type: ignore[list-item]
    router.in_flight = [2, 0, 1]
    assert router.pick() == 1
    router.in_flight = [1, 1, 1]
    assert router.pick() == 0
    router.replicas[0].alive = False
    assert router.pick() == 1
    for r in router.replicas:
        r.alive = False
    with pytest.raises(RequestRejected, match="no engine replica"):
        router.pick()
    prefill = ReplicaRouter([Fake()], what="prefill engine")  # type: ignore[list-item]
    prefill.replicas[0].alive = False
    with pytest.raises(RequestRejected, match="no prefill engine is serving"):  # a PD deployment's own words
        prefill.pick()


def test_device_list_must_fit():
    with pytest.raises(TopologyError, match="2 workers"):
        build_client(Topology("replicas", 2), lambda d: None, _config(), devices=["cpu", "cpu", "cpu"])


def test_voices_are_extracted_only_on_live_replicas():
    class Fake:
        info = None

        def __init__(self, name, alive=True):
            self.name, self.alive = name, alive

        def is_alive(self):
            return self.alive

        async def extract_voice(self, samples, sample_rate):
            if not self.alive:
                raise AssertionError(f"{self.name} is dead: its inbox would never answer")
            return self.name

    router = ReplicaRouter([Fake("a", alive=False), Fake("b"), Fake("c")])  # type: ignore[list-item]
    got = [asyncio.run(router.extract_voice(None, 16000)) for _ in range(4)]
    assert set(got) == {"b", "c"}
    for r in router.replicas:
        r.alive = False
    with pytest.raises(RequestRejected, match="no engine replica"):
        asyncio.run(router.extract_voice(None, 16000))


def test_auto_kv_transfer_is_cuda_ipc_between_gpus_of_one_host_and_shm_otherwise():
    from legato.pipeline.kv_links import choose_backend

    assert choose_backend("auto", "cuda:0", "cuda:1") == "cuda_ipc"
    assert choose_backend("auto", "cuda", "cuda") == "cuda_ipc"  # two workers on one GPU
    assert choose_backend("auto", "cpu", "cuda:0") == "shm"
    assert choose_backend("auto", "cpu", "cpu") == "shm"
    assert choose_backend("auto", "cuda:0", "cuda:1", same_host=False) == "mooncake"
    assert choose_backend("shm", "cuda:0", "cuda:1") == "shm"  # a named backend is taken as given


def test_process_pd_gives_each_kv_link_the_backend_of_its_two_devices(tiny_checkpoint):
    # Built, not started: no worker runs, so no GPU is needed to read the links each would open.
    def links(kv_backend: str, devices: list[str]) -> list[tuple[str, list[str]]]:
        router = build_client(parse_topology("1p2d"), None, EngineConfig(), devices=devices, workers="process",
                              model_path=str(tiny_checkpoint), kv_backend=kv_backend)
        return [(c.kv.role, c.kv.peer_backends) for c in [*router.prefill.replicas, *router.decode]]

    assert links("auto", ["cuda:0", "cuda:1", "cpu"]) == [
        ("prefill", ["cuda_ipc", "shm"]), ("decode", ["cuda_ipc"]), ("decode", ["shm"])]
    assert links("auto", ["cpu"]) == [("prefill", ["shm", "shm"]), ("decode", ["shm"]), ("decode", ["shm"])]
    assert links("shm", ["cuda:0", "cuda:1", "cuda:1"]) == [("prefill", []), ("decode", []), ("decode", [])]


def test_engines_sharing_a_gpu_are_told_what_to_expect():
    two = parse_topology("replicas:2")
    note = shared_gpu_note(two, ["cuda:0"])
    assert note is not None and "2 engines on cuda:0" in note and "single" in note
    assert shared_gpu_note(parse_topology("replicas:3"), ["cuda:0", "cuda:1"]) is not None  # cuda:0 holds two
    assert shared_gpu_note(two, ["cuda:0", "cuda:1"]) is None  # a GPU each
    assert shared_gpu_note(two, ["cpu"]) is None
    pd_note = shared_gpu_note(parse_topology("1p1d"), ["cuda:0"])  # prefill and decode engines take turns too
    assert pd_note is not None and "--mps on" in pd_note and "take turns" in pd_note
    assert shared_gpu_note(parse_topology("1p1d"), ["cuda:0", "cuda:1"]) is None
    under_mps = shared_gpu_note(two, ["cuda:0"], mps=True)
    assert "under MPS" in under_mps and "take turns" not in under_mps
    assert shared_gpu_note(parse_topology("split"), ["cuda:0"]) is None  # one engine and a codec worker
