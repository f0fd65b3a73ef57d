"""`--launcher ray`: the same topologies with every worker a Ray actor, on a two-node Ray cluster on this
machine (`ray.cluster_utils.Cluster`, every node and address 127.0.0.1, one CPU per node, no dashboard).

Codes must equal `single`'s (replicas:2 with a replica per node; 1p1d with prefill and decode on different
nodes and KV over Mooncake TCP; split with talker and codec worker apart), a killed actor must fail only its
own requests, with a reason (or recompute a handoff that did not cross), while the other node keeps
serving, and a stopped deployment must leave no actor, placement group, shm segment or socket behind.
Without Ray, `--launcher ray` must exit with a one-line instruction.

The cluster takes ~10 s to start; each deployment 15-45 s on a 2-core box (the tiny model loads in every
worker), `serve` on a local Ray instance ~30 s; the whole file 2-3 minutes there (10 tests, 114-160 s measured beside
other work). The seven deployment tests are marked slow. Mooncake's engine listens on every interface
(docs/ray.md); nothing else here binds or dials an address but 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np
import pytest
import torch
from client_helpers import gather_streams, mixed_requests

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline.client import SynthesisRequest
from legato.pipeline.launchers import RAY_MISSING, LauncherError, make_launcher
from legato.pipeline.topology import build_client, parse_topology

# Before Ray is imported: Ray otherwise swaps a loopback address for the machine's outward one.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

BLOCKS = 128
OPTS = {"torch_threads": 1, "start_timeout_s": 120}
STORE = 80 * 1024 * 1024


def _config() -> EngineConfig:
    # Batch-invariant: a row's floats must not follow which requests share its batch, which follows arrival
    # timing on a loaded box (the guarantee compared here is the invariant mode's).
    return EngineConfig(device="cpu", dtype="float32", max_num_seqs=8, num_kv_blocks=BLOCKS, max_model_len=512,
                        max_num_batched_tokens=256, batch_invariant=True, invariant_rows=8)


def _codes(chunks) -> np.ndarray:
    return np.concatenate([c.codes for c in chunks if c.codes is not None])


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "resources": {"node_a": 1}, "include_dashboard": False,
        "object_store_memory": STORE})
    try:
        c.add_node(node_ip_address="127.0.0.1", num_cpus=1, resources={"node_b": 1}, object_store_memory=STORE)
        ray.init(address=c.address, include_dashboard=False, log_to_driver=True)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def want(tiny_checkpoint):
    """Codes of `mixed_requests(8)` from the in-process `single` engine."""
    from legato.models.qwen3_tts.loader import load_model

    torch.set_num_threads(1)
    single = build_client(parse_topology("single"), lambda d: load_model(tiny_checkpoint, device=d), _config())

    async def run():
        await single.start()
        try:
            return await gather_streams(single, mixed_requests(8), 8)
        finally:
            await single.stop()
    return [_codes(chunks) for chunks in asyncio.run(run())]


def _deploy(path, topology: str, pins: dict[str, str], cpus: float = 1.0, **kw):
    # Placing two actors starts two Python workers that import torch: over 60 s on a 2-core box under a parallel
    # CPU load (seen once), so the deadline is generous; it still bounds a placement that can never happen.
    launcher = make_launcher("ray", {"node_resources": pins, "cpus_per_worker": cpus, "place_timeout_s": 180})
    client = build_client(parse_topology(topology), None, _config(), workers="process", model_path=str(path),
                          process_options=OPTS, launcher=launcher, **kw)
    return client, launcher


def _gone(launcher, instance_id: str, pids: list[int], ports: list[int]) -> None:
    """Nothing of the deployment is left: actors, placement group, processes, shm segments, sockets."""
    import ray

    for name, actor in launcher.actors.items():
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.where.remote(), timeout=30)
        assert name in launcher._released
    assert launcher.placement_group is None
    table = ray.util.placement_group_table()
    assert all(pg["state"] == "REMOVED" for pg in table.values()), table
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"vx{instance_id}")]  # shm connectors' segments
    with open("/proc/net/unix") as f:
        assert f"legato-{instance_id}" not in f.read()
    assert not set(ports) & _listening_tcp_ports()


def _listening_tcp_ports() -> set[int]:
    ports = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":
                ports.add(int(local.split(":")[1], 16))
    return ports


def _tcp_ports(client) -> list[int]:
    return [int(e.rsplit(":", 1)[1]) for e in client.endpoints if e.startswith("tcp://")]


def _descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p} - found
        found |= kids
        todo.extend(kids)
    return found


@pytest.mark.slow
def test_serve_on_a_local_ray_instance_answers_and_stops_clean():
    """`legato serve --launcher ray` without --ray-address: the server starts Ray on 127.0.0.1, serves,
    drains on SIGTERM and leaves no process behind (Ray's included). Runs before the cluster fixture."""
    import signal
    import socket
    import subprocess

    import httpx

    pytest.importorskip("ray")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-m", "legato.cli", "serve", "--launcher", "ray", "--device", "cpu",
                             "--port", str(port), "--ray-cpus-per-worker", "0.5", "--max-num-seqs", "4"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the server exited while starting"
            seen |= _descendants(proc.pid)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise AssertionError("no /health within 180 s")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", timeout=120,
                       json={"input": "Hello there.", "voice": "ryan", "response_format": "wav", "stream": False})
        assert r.status_code == 200 and r.content[:4] == b"RIFF"
        seen |= _descendants(proc.pid)
        assert len(seen) >= 3  # Ray's processes and the worker, all started by the server
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in seen):
        time.sleep(0.5)
    assert not [p for p in seen if _alive(p)], "left behind by the server"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.mark.slow
def test_replicas_one_per_node_give_the_codes_of_single(cluster, tiny_checkpoint, want):
    router, launcher = _deploy(tiny_checkpoint, "replicas:2", {"replica0": "node_a", "replica1": "node_b"})

    async def run():
        await router.start()
        try:
            return {c: await gather_streams(router, mixed_requests(8, prefix=f"r{c}-"), c) for c in (1, 8)}
        finally:
            await router.stop()

    got = asyncio.run(run())
    a, b = router.replicas
    assert launcher.placements["replica0"].node_id != launcher.placements["replica1"].node_id
    assert a.endpoints[0].startswith("ipc://") and b.endpoints[0].startswith("tcp://127.0.0.1:")
    for conc, results in got.items():
        for i, chunks in enumerate(results):
            assert chunks[-1].finish_reason == "length", (conc, i, chunks[-1])
            assert np.array_equal(_codes(chunks), want[i]), (conc, i)
    assert all(r.proc.returncode == 0 for r in router.replicas)
    _gone(launcher, a.instance_id, [a.pid, b.pid], _tcp_ports(b))


@pytest.mark.slow
def test_pd_across_nodes_over_mooncake_gives_the_codes_of_single(cluster, tiny_checkpoint, want):
    router, launcher = _deploy(tiny_checkpoint, "1p1d", {"prefill": "node_a", "decode": "node_b"},
                               kv_backend="mooncake")

    async def run():
        await router.start()
        try:
            return {c: await gather_streams(router, mixed_requests(8, prefix=f"c{c}-"), c) for c in (1, 8)}
        finally:
            await router.stop()

    got = asyncio.run(run())
    prefill, decode = router.prefill.replicas[0], router.decode[0]
    assert decode.kv.listen.startswith("tcp://127.0.0.1:") and prefill.kv.peer_addresses == [decode.kv.listen]
    for conc, results in got.items():
        for i, chunks in enumerate(results):
            assert chunks[-1].finish_reason == "length", (conc, i, chunks[-1])
            assert np.array_equal(_codes(chunks), want[i]), (conc, i)
    sent = sum(s.counters.get("sent", 0) for s in prefill.links.values())
    assert sent == 16, prefill.links  # every handoff crossed the link between the nodes
    _gone(launcher, prefill.instance_id, [prefill.pid, decode.pid],
          _tcp_ports(decode) + [int(decode.kv.listen.rsplit(":", 1)[1])])


@pytest.mark.slow
def test_split_talker_and_codec_on_two_nodes_give_the_codes_and_audio_of_single(cluster, tiny_checkpoint, want):
    client, launcher = _deploy(tiny_checkpoint, "split", {"talker": "node_a", "codec": "node_b"})

    async def run():
        await client.start()
        try:
            return await gather_streams(client, mixed_requests(8, prefix="s-"), 8)
        finally:
            await client.stop()

    got = asyncio.run(run())
    talker, codec = client.talker, client.codec.worker
    assert talker.endpoints[0].startswith("ipc://") and codec.endpoints[0].startswith("tcp://127.0.0.1:")
    for i, chunks in enumerate(got):
        assert chunks[-1].finish_reason == "length", (i, chunks[-1])
        assert np.array_equal(_codes(chunks), want[i]), i
        assert np.concatenate([c.audio for c in chunks]).size == want[i].shape[0] * 1920
    _gone(launcher, talker.instance_id, [talker.pid, codec.pid], _tcp_ports(codec))


@pytest.mark.slow
def test_probe_over_ray_finds_the_codes_of_single(cluster, tiny_checkpoint, capsys):
    import json

    from legato.cli import main

    rc = main(["probe", "--topology", "replicas:2", "--model", str(tiny_checkpoint), "--device", "cpu",
               "--requests", "4", "--concurrency", "4", "--frames", "5", "--batch-invariant", "--invariant-rows", "8",
               "--launcher", "ray", "--ray-node-resource", "replica0=node_a", "--ray-node-resource", "replica1=node_b"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["codes_identical"] and out["launcher"] == "ray" and out["workers"] == "process"


def _long(rid: str, frames: int = 400) -> SynthesisRequest:
    emb = torch.randn(64, generator=torch.Generator().manual_seed(0))
    inp = SpeechInput("A long one.", language="english", speaker_embedding=emb, x_vector_only=True)
    return SynthesisRequest(rid, inp, SamplingParams(seed=3, max_new_tokens=frames + 1), ignore_eos=True)


@pytest.mark.slow
def test_a_killed_decode_actor_fails_its_stream_recomputes_its_handoff_and_the_other_decode_serves(
        cluster, tiny_checkpoint):
    """1p2d: prefill and decode0 on node_a, decode1 on node_b, `--kv-transfer auto` (the link within node_a
    is shm, the one between the nodes mooncake, both with TCP control channels), `--kv-failure-policy
    recompute`. decode1's actor is killed while it streams one request and while another's handoff to it is
    held at the prefill worker: the first fails with the reason, the second is recomputed on decode0."""
    import ray

    pins = {"prefill": "node_a", "decode0": "node_a", "decode1": "node_b"}
    router, launcher = _deploy(tiny_checkpoint, "1p2d", pins, cpus=0.5, kv_backend="auto", pairing="round_robin",
                               on_kv_failure="recompute", kv_options={"send_delay_s": 3.0, "delay_prefix": "slow"})

    async def run():
        await router.start()
        try:
            streams = [router.generate(_long(f"long{i}")) for i in range(2)]
            firsts = [await s.__anext__() for s in streams]  # both streaming: long0 on decode0, long1 on decode1
            assert router.decode_in_flight == [1, 1] and not any(c.finished for c in firsts)
            ref = asyncio.ensure_future(gather_streams(router, [_long("ref-x", 6)], 1))  # turn 2: decode0
            deadline = time.monotonic() + 30
            while router.decode_in_flight[0] < 2 and time.monotonic() < deadline:  # ref has taken its turn
                await asyncio.sleep(0.05)
            slow = asyncio.ensure_future(gather_streams(router, [_long("slow-x", 6)], 1))  # turn 3: decode1, held
            while router.decode_in_flight[1] < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert router.decode_in_flight[1] == 2
            ray.kill(launcher.actors["decode1"], no_restart=True)
            ends = []
            for s in streams:
                ends.append([c async for c in s][-1])
            held, reference = (await slow)[0], (await ref)[0]
            after = await gather_streams(router, mixed_requests(4, prefix="after-"), 4)
            return ends, held, reference, after, router.stats()
        finally:
            await router.stop()

    ends, held, reference, after, stats = asyncio.run(run())
    assert [e.finish_reason for e in ends] == ["length", "error"], ends
    assert "Ray actor died" in ends[1].error
    assert held[-1].finish_reason == reference[-1].finish_reason == "length"
    assert np.array_equal(_codes(held), _codes(reference)) and stats.recomputed == 1
    assert all(c[-1].finish_reason == "length" for c in after)
    assert "Ray actor died" in router.decode[1].dead_reason
    prefill, d0, d1 = router.prefill.replicas[0], *router.decode
    assert prefill.kv.peer_backends == ["shm", "mooncake"] and d0.kv.peer_backends == ["shm"]
    assert d1.kv.peer_backends == ["mooncake"]
    _gone(launcher, prefill.instance_id, [prefill.pid, d0.pid, d1.pid], _tcp_ports(d1))


@pytest.mark.slow
def test_a_killed_replica_actor_fails_its_requests_and_the_other_node_serves(cluster, tiny_checkpoint):
    import ray

    router, launcher = _deploy(tiny_checkpoint, "replicas:2", {"replica0": "node_a", "replica1": "node_b"})
    long = _long

    async def run():
        await router.start()
        try:
            streams = [router.generate(long(f"long{i}")) for i in range(2)]
            firsts = [await s.__anext__() for s in streams]  # both streaming, one on each replica
            assert router.in_flight == [1, 1] and not any(c.finished for c in firsts)
            ray.kill(launcher.actors["replica1"], no_restart=True)
            ends = []
            for s in streams:
                ends.append([c async for c in s][-1])
            after = await gather_streams(router, mixed_requests(4, prefix="after-"), 4)
            return ends, after
        finally:
            await router.stop()

    t0 = time.monotonic()
    ends, after = asyncio.run(run())
    failed = [e for e in ends if e.finish_reason == "error"]
    assert len(failed) == 1 and "Ray actor died" in failed[0].error, ends
    assert [e.finish_reason for e in ends].count("length") == 1
    assert all(c[-1].finish_reason == "length" for c in after)
    assert "Ray actor died" in router.replicas[1].dead_reason
    assert time.monotonic() - t0 < 300
    a, b = router.replicas
    _gone(launcher, a.instance_id, [a.pid, b.pid], _tcp_ports(b))


def test_ray_options_and_plans_are_checked_before_anything_starts():
    pytest.importorskip("ray")
    from legato.pipeline.launchers import WorkerPlan
    from legato.pipeline.ray_launcher import RayLauncher, RayOptions

    with pytest.raises(LauncherError, match="--ray-placement"):
        RayOptions(placement="strict")
    with pytest.raises(LauncherError, match="not a role"):
        RayOptions(node_resources={"gpu7": "x"})
    assert RayOptions(node_resources={"decode": "b", "decode1": "c"}).resource_of("decode0") == "b"
    with pytest.raises(LauncherError, match="does not run"):
        RayLauncher(RayOptions(node_resources={"prefill": "a"})).plan([WorkerPlan("replica0")])
    from legato.pipeline.launchers import LocalLauncher, parse_node_resources
    from legato.pipeline.topology import TopologyError

    assert parse_node_resources(["decode0 = b", "prefill=a"]) == {"decode0": "b", "prefill": "a"}
    with pytest.raises(LauncherError, match="WORKER=RESOURCE"):
        parse_node_resources(["decode"])

    with pytest.raises(TopologyError, match="workers='process'"):
        build_client(parse_topology("single"), None, _config(), launcher=LocalLauncher())


def test_the_ray_deploy_files_name_only_serve_options():
    from pathlib import Path

    from legato.cli import build_parser
    from legato.pipeline.deploy import load_deploy

    args = build_parser().parse_args(["serve"])
    for path in sorted((Path(__file__).parents[1] / "deploy" / "ray").glob("*.yaml")):
        assert load_deploy(path, args.serve_defaults, args.serve_checks)["launcher"] == "ray", path


def test_launcher_ray_without_ray_is_a_one_line_instruction(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    for mod in [m for m in sys.modules if m.startswith("legato.pipeline.ray_launcher")]:
        monkeypatch.delitem(sys.modules, mod)
    with pytest.raises(LauncherError, match="needs Ray"):
        make_launcher("ray")
    from legato.cli import main

    assert main(["serve", "--launcher", "ray", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"legato serve: error: {RAY_MISSING}"
