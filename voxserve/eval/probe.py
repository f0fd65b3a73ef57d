"""`voxserve probe`: run the same seeded requests through a topology and through `single`, and report whether
the codes are identical and how the time to first audio compares.

    voxserve probe --topology 1p1d --requests 8 --concurrency 4 [--model PATH] [--greedy]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # heavy imports stay out of `voxserve --help`
    from voxserve.models.qwen3_tts.loader import LoadedModel
    from voxserve.pipeline.client import EngineClient, SynthesisRequest

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


def probe_requests(loaded: LoadedModel, n: int, frames: int, greedy: bool) -> list[SynthesisRequest]:
    """Seeded requests in the model's own voice mode (a random x-vector for Base, a preset speaker for
    CustomVoice, an instruction for VoiceDesign)."""
    import torch

    from voxserve.models.qwen3_tts.inputs import SpeechInput
    from voxserve.models.qwen3_tts.sampling import SamplingParams
    from voxserve.pipeline.client import SynthesisRequest

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


async def run_client(client: EngineClient, reqs: list[SynthesisRequest], concurrency: int) -> RunResult:
    await client.start()
    sem = asyncio.Semaphore(concurrency)

    async def one(req: SynthesisRequest):
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

    try:
        out = await asyncio.gather(*(one(r) for r in reqs))
    finally:
        await client.stop()
    return RunResult([o[0] for o in out], [o[1] for o in out], [o[2] for o in out])


def probe(topology: str, model: str | None, device: str, n: int, concurrency: int, frames: int,
          greedy: bool) -> dict:
    import torch

    from voxserve.engine.config import EngineConfig
    from voxserve.models.qwen3_tts.default import default_model_dir
    from voxserve.models.qwen3_tts.loader import load_model
    from voxserve.pipeline.topology import build_client, parse_topology

    path = model or default_model_dir()
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    config = EngineConfig(device=device, dtype=str(dtype).removeprefix("torch."), max_num_seqs=max(concurrency, 1),
                          max_model_len=4096, gpu_memory_utilization=0.4)

    def load(dev: str) -> LoadedModel:
        return load_model(path, device=dev, dtype=dtype)

    reference = load(device)
    reqs = probe_requests(reference, n, frames, greedy)
    single = asyncio.run(run_client(build_client(parse_topology("single"), lambda _: reference, config), reqs,
                                    concurrency))
    other = asyncio.run(run_client(build_client(parse_topology(topology), load, config), reqs, concurrency))
    equal = [bool(np.array_equal(a, b)) for a, b in zip(single.codes, other.codes, strict=True)]
    return {
        "topology": topology, "requests": n, "concurrency": concurrency, "frames": frames, "greedy": greedy,
        "codes_identical": all(equal), "identical_per_request": equal,
        "finish_reasons": other.reasons,
        "ttfp_p50_single_s": statistics.median(single.ttfp_s),
        "ttfp_p50_topology_s": statistics.median(other.ttfp_s),
        "ttfp_ratio": statistics.median(other.ttfp_s) / statistics.median(single.ttfp_s),
    }


def add_probe_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="compare a topology's codes and TTFP with `single` for seeded requests")
    p.add_argument("--topology", required=True)
    p.add_argument("--model", default=None, help="model directory or hub id (default: the embedded tiny model)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--greedy", action="store_true")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import torch

    from voxserve.pipeline.topology import TopologyError

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        report = probe(args.topology, args.model, device, args.requests, args.concurrency, args.frames,
                       args.greedy)
    except TopologyError as e:
        print(f"voxserve probe: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0 if report["codes_identical"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="voxserve")
    add_probe_parser(parser.add_subparsers(dest="command", required=True))
    a = parser.parse_args(["probe", *sys.argv[1:]])
    sys.exit(a.func(a))
