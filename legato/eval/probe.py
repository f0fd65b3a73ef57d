"""`legato probe`: run the same seeded requests through a topology and through `single`, and report whether
the codes are identical and how the time to first audio compares.

    legato probe --topology 1p1d --requests 8 --concurrency 1,8 [--workers process] [--kv-transfer shm]
                   [--mtp-replicas K] [--model PATH] [--greedy]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from legato.cli_help import DefaultsFormatter

if TYPE_CHECKING:  # heavy imports stay out of `legato --help`
    from legato.models.qwen3_tts.loader import LoadedModel
    from legato.pipeline.client import EngineClient, SynthesisRequest

TEXTS = [
    "Please call Stella and ask her to bring these things with her from the store.",
    "The quick brown fox jumps over the lazy dog.",
    "Six spoons of fresh snow peas, five thick slabs of blue cheese.",
    "We also need a small plastic snake and a big toy frog for the kids.",
]


@dataclass
class RunResult:
    codes: list[np.ndarray]
    ttfp_s: list[float]
    reasons: list[str | None]
    wall_s: float


def probe_requests(loaded: LoadedModel, n: int, frames: int, greedy: bool) -> list[SynthesisRequest]:
    """Seeded requests in the model's own voice mode (a random x-vector for Base, a preset speaker for
    CustomVoice, an instruction for VoiceDesign)."""
    import torch

    from legato.models.qwen3_tts.inputs import SpeechInput
    from legato.models.qwen3_tts.sampling import SamplingParams
    from legato.pipeline.client import SynthesisRequest

    kind = loaded.config.tts_model_type
    hidden = loaded.config.talker_config.hidden_size
    reqs = []
    for i in range(n):
        text = TEXTS[i % len(TEXTS)]
        if kind == "base":
            emb = torch.randn(hidden, generator=torch.Generator().manual_seed(i))
            inp = SpeechInput(text, speaker_embedding=emb, x_vector_only=True)
        elif kind == "custom_voice":
            inp = SpeechInput(text, speaker=sorted(loaded.config.talker_config.spk_id)[i % 2])
        else:
            inp = SpeechInput(text, instructions="A calm, clear voice.")
        params = SamplingParams(seed=1000 + i, max_new_tokens=frames + 1, do_sample=not greedy,
                                subtalker_do_sample=not greedy)
        reqs.append(SynthesisRequest(f"probe-{i}", inp, params, max_frames=frames, ignore_eos=True))
    return reqs


async def run_client(client: EngineClient, reqs: list[SynthesisRequest], concurrencies: list[int]) -> list[RunResult]:
    """Starts `client` once and runs all of `reqs` at each concurrency in turn."""
    await client.start()

    async def one(req: SynthesisRequest, sem: asyncio.Semaphore):
        async with sem:
            t0 = time.perf_counter()
            ttfp, codes, reason = None, [], None
            async for chunk in client.generate(req):
                if chunk.codes is not None and chunk.codes.size:
                    codes.append(chunk.codes)
                if ttfp is None and chunk.audio.size:
                    ttfp = time.perf_counter() - t0
                reason = chunk.finish_reason
            return np.concatenate(codes) if codes else np.zeros((0, 16), np.int64), ttfp or float("nan"), reason

    results = []
    try:
        await one(reqs[0], asyncio.Semaphore(1))  # warm-up: lazy compilation stays out of the timings
        for conc in concurrencies:
            sem = asyncio.Semaphore(conc)
            t0 = time.perf_counter()
            out = await asyncio.gather(*(one(r, sem) for r in reqs))
            results.append(RunResult([o[0] for o in out], [o[1] for o in out], [o[2] for o in out],
                                     time.perf_counter() - t0))
    finally:
        await client.stop()
    return results


def probe(topology: str, model: str | None, device: str, n: int, concurrencies: list[int], frames: int,
          greedy: bool, workers: str = "thread", kv_backend: str = "shm", mtp_replicas: int = 1,
          memory: float = 0.2, batch_invariant: bool = False, invariant_rows: int = 32,
          launcher: str = "local", ray_options: dict | None = None) -> dict:
    """`single` (thread, one code-predictor group) against `topology` for the same seeded requests at each
    concurrency: code equality, TTFP p50 and frames/s side by side. `launcher="ray"` runs the topology's
    workers as Ray actors (`ray_options`: `RayOptions` fields), which implies process workers."""
    import torch

    from legato.engine.config import EngineConfig
    from legato.models.qwen3_tts.default import default_model_dir
    from legato.models.qwen3_tts.loader import load_model
    from legato.pipeline.launchers import make_launcher
    from legato.pipeline.topology import build_client, parse_topology

    path = model or default_model_dir()
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    config = EngineConfig(device=device, dtype=str(dtype).removeprefix("torch."),
                          max_num_seqs=max(max(concurrencies), 1), max_model_len=4096,
                          gpu_memory_utilization=memory, batch_invariant=batch_invariant,
                          invariant_rows=invariant_rows)

    def load(dev: str) -> LoadedModel:
        return load_model(path, device=dev, dtype=dtype)

    reference = load(device)
    reqs = probe_requests(reference, n, frames, greedy)
    single = asyncio.run(run_client(build_client(parse_topology("single"), lambda _: reference, config), reqs,
                                    concurrencies))
    other_cfg = dataclasses.replace(config, mtp_replicas=mtp_replicas)
    placer = None if launcher == "local" else make_launcher(launcher, ray_options)
    workers = "process" if placer is not None else workers
    other = asyncio.run(run_client(build_client(parse_topology(topology), load, other_cfg, workers=workers,
                                                model_path=str(path), kv_backend=kv_backend, launcher=placer),
                                   reqs, concurrencies))
    runs = []
    for conc, a, b in zip(concurrencies, single, other, strict=True):
        equal = [bool(np.array_equal(x, y)) for x, y in zip(a.codes, b.codes, strict=True)]
        frames_total = sum(len(c) for c in b.codes)
        runs.append({
            "concurrency": conc, "codes_identical": all(equal), "identical_per_request": equal,
            "finish_reasons": sorted(set(map(str, b.reasons))),
            "ttfp_p50_single_s": statistics.median(a.ttfp_s), "ttfp_p50_topology_s": statistics.median(b.ttfp_s),
            "ttfp_ratio": statistics.median(b.ttfp_s) / statistics.median(a.ttfp_s),
            "frames_per_s_single": sum(len(c) for c in a.codes) / a.wall_s,
            "frames_per_s_topology": frames_total / b.wall_s,
            "throughput_ratio": (frames_total / b.wall_s) / (sum(len(c) for c in a.codes) / a.wall_s),
        })
    return {"topology": topology, "workers": workers, "launcher": launcher, "kv_backend": kv_backend,
            "mtp_replicas": mtp_replicas,
            "batch_invariant": batch_invariant, "invariant_rows": invariant_rows if batch_invariant else None,
            "device": device, "model": str(path), "requests": n, "frames": frames, "greedy": greedy,
            "codes_identical": all(r["codes_identical"] for r in runs), "runs": runs}


def add_probe_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="compare a topology's codes and TTFP with `single` for seeded requests",
                       description="Run the same seeded requests through a topology and through `single`, and "
                                   "compare their codes and TTFP.", formatter_class=DefaultsFormatter)
    p.add_argument("--topology", required=True, help="the topology to check (as `legato serve --topology`)")
    p.add_argument("--model", default=None, help="model directory or hub id (default: the embedded tiny model)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--requests", type=int, default=8, help="seeded requests per concurrency")
    p.add_argument("--concurrency", default="4", help="comma list, e.g. 1,8,32 (each topology starts once)")
    p.add_argument("--frames", type=int, default=16, help="frames per request (EOS ignored)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding instead of seeded sampling")
    p.add_argument("--workers", choices=["thread", "process"], default="thread",
                   help="engines on threads of this process or in worker processes")
    p.add_argument("--kv-transfer", default="auto", choices=["shm", "cuda_ipc", "mooncake", "auto"],
                   help="KV backend of process MpNd, as `legato serve --kv-transfer` (auto: cuda_ipc between two GPU "
                        "workers on one host, shm for other pairs on one host, mooncake between nodes)")
    p.add_argument("--launcher", choices=["local", "ray"], default="local",
                   help="the topology's workers as children of this process, or as Ray actors (docs/ray.md; "
                        "implies --workers process)")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: a local one on 127.0.0.1)")
    p.add_argument("--ray-placement", choices=["pack", "spread"], default="pack", help="placement group strategy")
    p.add_argument("--ray-node-resource", action="append", default=[], metavar="WORKER=RESOURCE",
                   help="pin a role or worker to the nodes with this custom resource (repeatable)")
    p.add_argument("--mtp-replicas", type=int, default=1, help="code-predictor replicas of the topology's engines")
    p.add_argument("--memory", type=float, default=0.2, help="gpu_memory_utilization of each side")
    p.add_argument("--batch-invariant", action="store_true", help="both sides in batch-invariant mode")
    p.add_argument("--invariant-rows", type=int, default=32, help="decode chunk of --batch-invariant")
    p.add_argument("--out", default=None, help="also write the report (JSON) here")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import torch

    from legato.pipeline.launchers import LauncherError, parse_node_resources
    from legato.pipeline.topology import TopologyError

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        ray_options = {"address": args.ray_address, "placement": args.ray_placement,
                       "node_resources": parse_node_resources(args.ray_node_resource)}
        report = probe(args.topology, args.model, device, args.requests, concurrencies, args.frames,
                       args.greedy, args.workers, args.kv_transfer, args.mtp_replicas, args.memory,
                       args.batch_invariant, args.invariant_rows, args.launcher, ray_options)
    except (TopologyError, LauncherError, ValueError) as e:
        print(f"legato probe: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0 if report["codes_identical"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="legato")
    add_probe_parser(parser.add_subparsers(dest="command", required=True))
    a = parser.parse_args(["probe", *sys.argv[1:]])
    sys.exit(a.func(a))
