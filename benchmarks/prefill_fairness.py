"""A 2-frame request's latency beside a long prompt, fair prefill on and off (CPU, the embedded tiny model).

The outside probe's case: 4,096 emoji (16,394 prompt tokens) stalled a concurrent 2-frame request for 47 s.
Each cell admits the long prompt, runs one engine step (it is prefilling), admits the short request, and
steps until both end. It reports the short request's steps and seconds to its end, and the long one's.
The emoji prompt is what --max-prompt-tokens now refuses (12304 on this model); it is run here with the
engine's limit off, to show what fairness alone would do. Results are recorded in docs/benchmarks.md.

    python benchmarks/prefill_fairness.py                   # the default budget (4096) and 512
    python benchmarks/prefill_fairness.py --budgets 4096 --no-emoji --out r.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from legato.engine.config import EngineConfig
from legato.engine.engine import Engine, EngineRequest
from legato.models.qwen3_tts.default import DEFAULT_SPEAKER, default_model_dir
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.loader import LoadedModel, load_model
from legato.models.qwen3_tts.sampling import SamplingParams

PLAIN = ("The weather report says it will rain heavily over the coast this evening. " * 60)[:4096]
PROMPTS: dict[str, str | None] = {
    "emoji x4096": "😀" * 4096,
    "plain x4096": PLAIN,  # the largest ordinary input: 4,096 characters of English
    "ids x4096": None,  # 4,096 text tokens (PLAIN's, repeated): a prompt at the limit, as dense CJK text gives
}


def speech_input(loaded: LoadedModel, text: str | None) -> SpeechInput:
    if text is None:
        ids = loaded.text_tokenizer.encode(PLAIN)
        return SpeechInput(text_ids=(ids * (4096 // len(ids) + 1))[:4096], speaker=DEFAULT_SPEAKER)
    return SpeechInput(text, speaker=DEFAULT_SPEAKER)


def request(loaded: LoadedModel, rid: str, text: str | None, seed: int) -> EngineRequest:
    spec = build_spec(loaded, speech_input(loaded, text))
    return EngineRequest(rid, spec, SamplingParams(seed=seed), max_frames=2, ignore_eos=True)


def cell(loaded: LoadedModel, text: str | None, budget: int, fair: bool) -> dict:
    config = EngineConfig(device="cpu", dtype="float32", max_num_batched_tokens=budget, max_model_len=32768,
                          num_kv_blocks=2048, fair_prefill=fair)
    engine = Engine(loaded, config)
    engine.add_request(request(loaded, "long", text, 1))
    prompt_tokens = engine.live["long"].req.prompt_len
    t0 = time.perf_counter()
    engine.step()
    engine.add_request(request(loaded, "short", "Hi there.", 2))
    t_short, steps, done = time.perf_counter(), 1, {}
    while engine.has_unfinished():
        outputs = engine.step()
        steps += 1
        for o in outputs:
            if o.finished:
                done[o.request_id] = (steps, time.perf_counter())
    return {
        "prompt_tokens": prompt_tokens, "budget": budget, "fair_prefill": fair,
        "short_steps": done["short"][0] - 1, "short_s": round(done["short"][1] - t_short, 3),
        "long_steps": done["long"][0], "long_s": round(done["long"][1] - t0, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="4096,512", help="max_num_batched_tokens values, comma-separated")
    ap.add_argument("--no-emoji", action="store_true", help="skip the 16k-token emoji prompt (slow on a CPU)")
    ap.add_argument("--prompts", default=",".join(PROMPTS), help=f"which prompts, comma-separated: {list(PROMPTS)}")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", default=None, help="write the cells as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(default_model_dir())
    engine = Engine(loaded, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64))
    engine.warm_up()  # first-use costs out of the first cell
    rows = []
    for name, text in PROMPTS.items():
        if (args.no_emoji and name.startswith("emoji")) or name not in args.prompts.split(","):
            continue
        for budget in (int(b) for b in args.budgets.split(",")):
            for fair in (False, True):
                row = {"prompt": name, **cell(loaded, text, budget, fair)}
                rows.append(row)
                print(f"{name:12} {row['prompt_tokens']:6d} tok  budget {budget:5d}  fair {str(fair):5}  "
                      f"short: {row['short_steps']:3d} steps {row['short_s']:7.2f} s   "
                      f"long: {row['long_steps']:3d} steps {row['long_s']:7.2f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "torch": torch.__version__, "cells": rows}, f, indent=1)


if __name__ == "__main__":
    main()
