"""KV handoffs between two processes on one GPU host: cuda_ipc against shm, then TTFP through process 1p1d.

Part `link`: a spawned sender process hands this process `--repeats` handoffs of a `--tokens`-token prompt
in the talker's layout (`--size`, bf16, blocks of 16), its KV on the sender's GPU as a prefill engine's is.
Per backend: the time from the sender's `send` to the handoff's KV being on the receiver's GPU (for shm
that includes the receiver's copy up; cuda_ipc lands there), and to the sender seeing the ack.

Part `ttfp`: time to first audio at concurrency 1 for `single`, and for process `1p1d` over each backend,
with a random-weight checkpoint of `--size` (written to `--ckpt` unless there) and fixed lengths (EOS
ignored); with `--check-codes` the 1p1d codes are compared against `single`'s (batch-invariant mode) at
concurrency 1, 8 and 32.

    python3 benchmarks/kv_handoff.py --parts link,ttfp --out /tmp/kv.json

`--device cpu --size tiny` runs both parts over shm alone, as a smoke test of this script without a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import statistics
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from legato.kv_transfer.handoff import Handoff, KVLayout, blocks_for
from legato.models.qwen3_tts.config import preset
from legato.models.qwen3_tts.sampling import SamplingParams

BACKENDS = ("shm", "cuda_ipc")


def model_config(size: str):
    """The released config of `size`, or "tiny" (the test-suite's, for a CPU smoke run)."""
    if size == "tiny":
        from legato.models.qwen3_tts.tiny import tiny_config

        return tiny_config()
    return preset(size, "base")


def layout_of(size: str) -> KVLayout:
    t = model_config(size).talker_config
    return KVLayout("bfloat16", 16, t.num_hidden_layers, t.num_key_value_heads, t.head_dim, f"bench-{size}")


def handoff(lay: KVLayout, rid: str, tokens: int, hidden: int, device: str) -> Handoff:
    nb = blocks_for(tokens, lay.block_size)
    kv = torch.randn(lay.num_layers, 2, nb, lay.block_size, lay.kv_heads, lay.head_dim, device=device,
                     dtype=torch.bfloat16)
    return Handoff(rid, lay, tokens, kv, torch.randn(hidden, device=device), 1234,
                   torch.randn(4, hidden, device=device, dtype=torch.bfloat16), SamplingParams(seed=1), 1, 100)


def connector(backend: str, lay: KVLayout, conn, name: str):
    if backend == "cuda_ipc":
        from legato.kv_transfer.cuda_ipc import CudaIpcConnector

        return CudaIpcConnector(lay, conn, name, device="cuda:0")
    from legato.kv_transfer.shm import ShmConnector

    return ShmConnector(lay, conn, name)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def sender(backend: str, layout: dict, kv_conn, cmd, tokens: int, hidden: int, device: str) -> None:
    """Child: sends a fresh handoff per ("send", rid) command; answers (rid, t_send, t_ack)."""
    lay = KVLayout.from_dict(layout)
    link = connector(backend, lay, kv_conn, f"s{uuid.uuid4().hex[:8]}")
    link.connect(60.0)
    cmd.send("ready")
    while True:
        msg = cmd.recv()
        if msg == "exit":
            link.close()
            return
        h = handoff(lay, msg[1], tokens, hidden, device)
        sync(device)  # the prefill's gather is done before the handoff is sent
        t_send = time.monotonic()
        link.send(h, 30.0)
        acked, deadline = None, time.monotonic() + 30
        while acked is None and time.monotonic() < deadline:
            acked = next((ev for ev in link.poll() if ev.request_id == msg[1]), None)
        cmd.send((msg[1], t_send, time.monotonic(), acked.kind.value if acked else "timeout"))


def link_part(args) -> dict:
    lay, hidden = layout_of(args.size), model_config(args.size).talker_config.hidden_size
    ctx = multiprocessing.get_context("spawn")
    out = {"layout": lay.to_dict(), "tokens": args.tokens, "repeats": args.repeats}
    backends = BACKENDS if args.device.startswith("cuda") else ("shm",)
    for backend in backends:
        kv_parent, kv_child = ctx.Pipe()
        cmd_parent, cmd_child = ctx.Pipe()
        child = ctx.Process(target=sender, args=(backend, lay.to_dict(), kv_child, cmd_child, args.tokens, hidden,
                                                 args.device), daemon=True)
        child.start()
        link = connector(backend, lay, kv_parent, f"r{uuid.uuid4().hex[:8]}")
        link.connect(120.0)
        assert cmd_parent.poll(120) and cmd_parent.recv() == "ready"
        landed, acked, nbytes = [], [], 0
        for i in range(args.warmup + args.repeats):
            rid = f"{backend}-{i}"
            link.receive(rid, 30.0)
            cmd_parent.send(("send", rid))
            ev, deadline = None, time.monotonic() + 30
            while ev is None and time.monotonic() < deadline:
                ev = next((e for e in link.poll() if e.request_id == rid), None)
            if ev is None or ev.handoff is None:
                raise RuntimeError(f"{backend}: handoff {rid} did not arrive: {ev}")
            kv = ev.handoff.kv.to(args.device, non_blocking=True)
            sync(args.device)
            t_landed = time.monotonic()
            nbytes = kv.numel() * kv.element_size()
            assert cmd_parent.poll(30)
            _, t_send, t_ack, kind = cmd_parent.recv()
            if i >= args.warmup:
                landed.append((t_landed - t_send) * 1e3)
                acked.append((t_ack - t_send) * 1e3)
        cmd_parent.send("exit")
        child.join(30)
        link.close()
        out[backend] = {"kv_bytes": nbytes, "to_receiver_gpu_ms_p50": statistics.median(landed),
                        "to_receiver_gpu_ms_p90": float(np.percentile(landed, 90)),
                        "to_ack_ms_p50": statistics.median(acked)}
        print(backend, json.dumps(out[backend]), flush=True)
    if "cuda_ipc" in out:
        out["ratio_shm_over_cuda_ipc"] = (out["shm"]["to_receiver_gpu_ms_p50"]
                                          / out["cuda_ipc"]["to_receiver_gpu_ms_p50"])
    return out


def free_device_memory() -> None:
    """Returns what this process's dropped engines held: cycles first (an engine and its runner refer to each
    other), then the caching allocator's blocks, which otherwise stay reserved for this process."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def ttfp_part(args) -> dict:
    from legato.engine.config import EngineConfig
    from legato.models.qwen3_tts.inputs import SpeechInput
    from legato.models.qwen3_tts.loader import load_model
    from legato.models.qwen3_tts.testing import write_checkpoint
    from legato.pipeline.client import SynthesisRequest
    from legato.pipeline.topology import build_client, parse_topology

    ckpt = Path(args.ckpt)
    on_gpu = args.device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if not (ckpt / "model.safetensors").exists():
        write_checkpoint(ckpt, model_config(args.size), dtype=dtype)
    emb = torch.randn(model_config(args.size).talker_config.hidden_size, generator=torch.Generator().manual_seed(1))

    def reqs(n: int, prefix: str) -> list[SynthesisRequest]:
        text = "Please call Stella and ask her to bring these things with her from the store."
        return [SynthesisRequest(f"{prefix}{i}", SpeechInput(text, language="english", speaker_embedding=emb,
                                                             x_vector_only=True),
                                 SamplingParams(seed=i, max_new_tokens=args.frames), ignore_eos=True)
                for i in range(n)]

    async def measure(client) -> dict:
        await client.start()
        try:
            ttfp = []
            for i, r in enumerate(reqs(args.warmup + args.requests, "t")):
                t0 = time.perf_counter()
                first = None
                async for chunk in client.generate(r):
                    if first is None and chunk.audio is not None and chunk.audio.size:
                        first = time.perf_counter() - t0
                if i >= args.warmup:
                    ttfp.append(first * 1e3)
            codes = {}
            if args.check_codes:
                async def one(r, sem):
                    async with sem:
                        return np.concatenate([x.codes async for x in client.generate(r) if x.codes is not None])
                for c in (1, 8, 32):
                    sem = asyncio.Semaphore(c)
                    codes[c] = await asyncio.gather(*(one(r, sem) for r in reqs(32, f"k{c}-")))
            return {"ttfp_ms_p50": statistics.median(ttfp), "ttfp_ms_p90": float(np.percentile(ttfp, 90)),
                    "codes": codes}
        finally:
            await client.stop()

    config = EngineConfig(device=args.device, dtype=str(dtype).removeprefix("torch."), max_num_seqs=32,
                          batch_invariant=args.check_codes, **({} if on_gpu else {"num_kv_blocks": 256}))
    out = {}
    runs = [("single", None)] + [("1p1d", b) for b in (BACKENDS if on_gpu else ("shm",))]
    for name, backend in runs:
        if backend is None:
            client = build_client(parse_topology("single"), lambda d: load_model(ckpt, device=d, dtype=dtype), config)
        else:
            client = build_client(parse_topology("1p1d"), None, config, workers="process", model_path=str(ckpt),
                                  process_options={"start_timeout_s": 600}, kv_backend=backend)
        label = name if backend is None else f"1p1d-{backend}"
        out[label] = asyncio.run(measure(client))
        print(label, out[label]["ttfp_ms_p50"], flush=True)
        # `single`'s engine lives in this process: its weights, KV cache and graph pool must be gone before the
        # 1p1d workers allocate theirs on the same GPU (holding them ran the workers out of memory on the H200).
        del client
        free_device_memory()
    if args.check_codes:
        want = out["single"]["codes"]
        for label in [k for k in out if k.startswith("1p1d")]:
            got = out[label]["codes"]
            out[label]["codes_equal_single"] = {c: all(np.array_equal(a, b) for a, b in zip(want[c], got[c],
                                                                                             strict=True))
                                                for c in want}
    for v in out.values():
        v.pop("codes", None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="link,ttfp")
    p.add_argument("--size", default="0.6B")
    p.add_argument("--tokens", type=int, default=130)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--frames", type=int, default=25)
    p.add_argument("--ckpt", default="/tmp/qwen3tts-0.6b-random")
    p.add_argument("--check-codes", action="store_true")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", default="kv_handoff.json")
    args = p.parse_args()
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "none"
    result = {"torch": torch.__version__, "gpu": gpu, "device": args.device}
    for part in args.parts.split(","):
        result[part] = {"link": link_part, "ttfp": ttfp_part}[part](args)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
