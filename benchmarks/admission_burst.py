"""A burst of requests through the engine client's admission while the engine thread is busy (issue 22).

At c=256 the served engine held about 100 live streams, not 256, because a request spent ~0.5 s before its
first audio; a load test's first wave (and any crowd arriving at once) reaches the admission thread as a burst,
which prepared one request at a time. This starts `LocalEngineClient` on a random-weight model, keeps
`--background` long streams running (the engine thread stepping, holding the GIL as it does when serving), then
sends `--burst` x-vector requests at once and reports, per request: the `prepare` stage (call -> engine inbox:
voice, tokens, prompt, and the wait behind the burst), the TTFP, and when the last request of the burst reached
the engine. Stage times need a tree with `StreamChunk.stages` (b9b44f8 on).

The tree on PYTHONPATH is the one measured, so the same script measures an older tree for a before/after:

    PYTHONPATH=.base python3 benchmarks/admission_burst.py --size 0.6B --device cuda --out /tmp/base.json
    python3 benchmarks/admission_burst.py --size 0.6B --device cuda --out /tmp/new.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline.client import SynthesisRequest
from legato.pipeline.local import LocalEngineClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_loop import TEXTS, emit_json, random_base_model  # noqa: E402


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def request(lm, rid: str, i: int, frames: int) -> SynthesisRequest:
    g = torch.Generator().manual_seed(i)
    emb = torch.randn(lm.config.talker_config.hidden_size, generator=g)
    inp = SpeechInput(f"{TEXTS[i % len(TEXTS)]} Request {i}.", language="english", speaker_embedding=emb)
    return SynthesisRequest(rid, inp, SamplingParams(seed=i, max_new_tokens=frames + 1), max_frames=frames,
                            ignore_eos=True)


async def first_audio(client: LocalEngineClient, req: SynthesisRequest, t0: float) -> dict:
    """Runs `req` to its end; its TTFP from `t0` and its first audio chunk's stages (where the tree has them)."""
    row: dict = {"ttfp_s": None, "stages": None}
    async for chunk in client.generate(req):
        if chunk.error:
            row["error"] = chunk.error
        if row["ttfp_s"] is None and chunk.audio.size:
            row["ttfp_s"] = time.perf_counter() - t0
            row["stages"] = getattr(chunk, "stages", None)
    return row


async def one_round(client, lm, args, round_no: int) -> dict:
    background = [asyncio.create_task(first_audio(client, request(lm, f"bg{round_no}-{i}", 10_000 + i,
                                                                  args.background_frames), time.perf_counter()))
                  for i in range(args.background)]
    deadline = time.monotonic() + 120
    while client.stats().running < args.background:  # the engine thread is stepping them all
        if time.monotonic() > deadline:
            raise RuntimeError("the background streams did not start within 120 s")
        await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    burst = await asyncio.gather(*(first_audio(client, request(lm, f"b{round_no}-{i}", i, args.frames), t0)
                                   for i in range(args.burst)))
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    errors = [r["error"] for r in burst if r.get("error")]
    ttfp = [r["ttfp_s"] for r in burst if r["ttfp_s"] is not None]
    stages = [r["stages"] for r in burst if r["stages"]]
    prepare = [s["prepare"] for s in stages if "prepare" in s]
    engine = [s["engine"] for s in stages if "engine" in s]
    ms = lambda v: None if v is None else round(1000 * v, 2)  # noqa: E731
    return {
        "round": round_no, "burst": args.burst, "background": args.background, "errors": errors[:3],
        "failed": len(errors), "ttfp_p50_ms": ms(percentile(ttfp, 0.5)), "ttfp_p99_ms": ms(percentile(ttfp, 0.99)),
        "ttfp_max_ms": ms(max(ttfp) if ttfp else None),
        "prepare_p50_ms": ms(percentile(prepare, 0.5)), "prepare_p99_ms": ms(percentile(prepare, 0.99)),
        "prepare_max_ms": ms(max(prepare) if prepare else None),
        "engine_p50_ms": ms(percentile(engine, 0.5)),
    }


async def main_async(args) -> dict:
    lm = random_base_model(args.size, args.device)
    cfg = EngineConfig(device=args.device, dtype="bfloat16" if args.size != "tiny" else "float32",
                       max_num_seqs=args.background + args.burst, gpu_memory_utilization=0.5)
    client = LocalEngineClient(lm, cfg)
    await client.start()
    try:
        await one_round(client, lm, argparse.Namespace(**{**vars(args), "burst": 8}), -1)  # warm-up
        rounds = [await one_round(client, lm, args, r) for r in range(args.rounds)]
    finally:
        await client.stop(5.0)
    return {"rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", help="tiny (the tests' config, fp32) | 0.6B | 1.7B (random weights)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--burst", type=int, default=256, help="requests sent at once")
    ap.add_argument("--frames", type=int, default=4, help="frames each burst request makes (EOS ignored)")
    ap.add_argument("--background", type=int, default=32, help="long streams keeping the engine thread busy")
    ap.add_argument("--background-frames", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    result = asyncio.run(main_async(args))
    emit_json({"label": args.label, "args": vars(args),
               "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, **result}, args.out)


if __name__ == "__main__":
    main()
