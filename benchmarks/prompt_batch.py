"""Host time and device launches of building talker prompts, one at a time against batches (issue 22, admission).

The admission thread builds every request's prompt. This times `build_prompt` per request and, where the tree
has it, `build_prompts` over batches of several sizes, for x-vector requests on a random-weight model, and counts
the kernels (CUDA) or operators (CPU) one request costs. The tree on PYTHONPATH is the one measured; an older tree
(no `prompt_build`) is timed one request at a time only:

    PYTHONPATH=.base python3 benchmarks/prompt_batch.py --size 0.6B --device cuda --out /tmp/base.json
    python3 benchmarks/prompt_batch.py --size 0.6B --device cuda --out /tmp/new.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from legato.models.qwen3_tts.inputs import SpeechInput, build_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_loop import TEXTS, emit_json, random_base_model  # noqa: E402

try:
    from legato.models.qwen3_tts.prompt_build import build_prompt, build_prompts
except ImportError:  # a tree from before batched prompts
    from legato.models.qwen3_tts.prompt import build_prompt
    build_prompts = None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def per_request_us(fn, n: int, device: str, repeats: int) -> float:
    """Best of `repeats` runs of `fn()` (which builds `n` prompts), in µs of wall time per prompt, device included."""
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 1e6 * best / n


def launches_per_request(fn, n: int, device: str) -> float:
    """Device kernels (CUDA) or aten operators (CPU) that `fn()` runs, per prompt."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    if device == "cuda":
        count = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    else:
        count = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
    return count / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", help="tiny (the tests' config, fp32) | 0.6B | 1.7B (random weights)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--batches", default="8,64,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    lm = random_base_model(args.size, args.device)
    hidden = lm.config.talker_config.hidden_size
    g = torch.Generator().manual_seed(0)
    specs = [build_spec(lm, SpeechInput(f"{TEXTS[i % len(TEXTS)]} Request {i}.", language="english",
                                        speaker_embedding=torch.randn(hidden, generator=g)))
             for i in range(args.requests)]
    talker, cfg, n = lm.talker, lm.config, len(specs)

    def alone():
        for s in specs:
            build_prompt(s, talker, cfg)

    alone()  # first use: cached pieces, kernels loaded
    rows = {"alone": {"us_per_request": per_request_us(alone, n, args.device, args.repeats),
                      "launches_per_request": launches_per_request(alone, n, args.device)}}
    if build_prompts is not None:
        for size in (int(b) for b in args.batches.split(",")):
            def batched(size=size):
                for i in range(0, n, size):
                    build_prompts(specs[i:i + size], talker, cfg)

            batched()
            rows[f"batch{size}"] = {"us_per_request": per_request_us(batched, n, args.device, args.repeats),
                                    "launches_per_request": launches_per_request(batched, n, args.device)}
    emit_json({"size": args.size, "device": args.device, "batched": build_prompts is not None,
               "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
