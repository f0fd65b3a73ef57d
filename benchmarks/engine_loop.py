"""The engine alone under a closed loop of streaming requests: what the GPU step allows before any server.

`concurrency` requests are kept live; each that finishes is replaced by a new one until `--requests` have
run. Each request streams audio (the codec runs, as in the server) and has a fixed length drawn from
`--frames` (EOS masked: random weights carry no speech). Per variant it reports audio-s/s, the engine's
step timers (host time per step, device time per step, the device's idle gap between steps, GPU busy) and
the host time of each phase of `step()`, and, with `--trace-steps`, a torch.profiler window: the compute
stream's idle gaps, with the phase the host was in when each began.

Comparing this with `serving_speed.py` at the same concurrency splits the served figure into what the
engine loop costs and what the server around it costs.

    python3 benchmarks/engine_loop.py --concurrency 64 --requests 256 --variants default,no-audio,sync \\
        --trace-steps 40 --out /tmp/loop.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from collections import defaultdict

import torch

from legato.bench.steady import Sample, steady_summary
from legato.engine.config import EngineConfig
from legato.engine.engine import Engine, EngineRequest
from legato.models.qwen3_tts.config import SpeechTokenizerConfig, preset
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.models.qwen3_tts.testing import random_model

TEXTS = [
    "Please call Stella and ask her to bring these things with her from the store.",
    "The quick brown fox jumps over the lazy dog near the riverbank at dawn.",
    "A serving engine is only as fast as the slowest thing on its critical path.",
    "Six spoons of fresh snow peas, five thick slabs of blue cheese, and a snack for Bob.",
]

# Phases of Engine.step() timed on the host (a wrapper per method; the harness's own, not the engine's).
PHASES = ("_launch", "_collect", "_audio")


class PhaseTimer:
    def __init__(self, engine: Engine, annotate: bool) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.annotate = annotate
        for name in PHASES:
            self._wrap(engine, name)
        if engine.codec is not None:
            self._wrap(engine.codec, "queue", "codec.queue")
        self._wrap(engine.copies, "submit", "copies.submit")
        self._wrap(engine.runner, "decode", "runner.decode")
        self._wrap(engine.runner, "prefill", "runner.prefill")

    def _wrap(self, obj, name: str, label: str | None = None) -> None:
        fn, label = getattr(obj, name), label or name

        def timed(*args, **kwargs):
            started = time.perf_counter()
            ctx = torch.profiler.record_function(label) if self.annotate else None
            if ctx is not None:
                ctx.__enter__()
            try:
                return fn(*args, **kwargs)
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
                self.seconds[label] += time.perf_counter() - started

        setattr(obj, name, timed)


def make_request(lm, i: int, mode: str, frames: int, ref_frames: int) -> EngineRequest:
    g = torch.Generator().manual_seed(i)
    hidden = lm.config.talker_config.hidden_size
    text = TEXTS[i % len(TEXTS)]
    if mode == "clone":
        inp = SpeechInput(text, language="english", speaker_embedding=torch.randn(hidden, generator=g),
                          ref_code=torch.randint(0, 2048, (ref_frames, 16), generator=g),
                          ref_text="Six spoons of fresh snow peas.")
    else:
        inp = SpeechInput(text, language="english", speaker_embedding=torch.randn(hidden, generator=g))
    return EngineRequest(f"r{i}", build_spec(lm, inp), SamplingParams(seed=i, max_new_tokens=frames + 1),
                         max_frames=frames, ignore_eos=True)


def gpu_gaps(prof, min_gap_us: float = 20.0) -> dict:
    """Idle time of the stream that ran the most kernel time (the talker's), within the window, and the
    host phase (innermost annotation) open when each idle gap began."""
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0]
    if not kernels:
        return {}
    by_stream: dict[int, list] = defaultdict(list)
    for e in kernels:
        by_stream[getattr(e, "device_resource_id", 0)].append(e)
    busy = {s: sum(e.time_range.elapsed_us() for e in ks) for s, ks in by_stream.items()}
    main = max(busy, key=busy.get)
    ks = sorted(by_stream[main], key=lambda e: e.time_range.start)
    ranges = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name in
              (*PHASES, "codec.queue", "copies.submit", "runner.decode", "runner.prefill", "loop.outside")]
    gaps, by_phase = [], defaultdict(float)
    end = ks[0].time_range.end
    for e in ks[1:]:
        gap = e.time_range.start - end
        if gap >= min_gap_us:
            open_now = [r for r in ranges if r.time_range.start <= end <= r.time_range.end]
            phase = min(open_now, key=lambda r: r.time_range.elapsed_us()).name if open_now else "between"
            by_phase[phase] += gap
            gaps.append(gap)
        end = max(end, e.time_range.end)
    span = end - ks[0].time_range.start
    return {
        "window_us": span, "main_stream_busy_us": busy[main], "main_stream_busy_frac": busy[main] / span,
        "other_streams_busy_us": {str(s): v for s, v in busy.items() if s != main},
        "idle_gaps": len(gaps), "idle_us": sum(gaps), "idle_by_host_phase_us": dict(by_phase),
        "largest_gaps_us": sorted(gaps, reverse=True)[:10],
    }


def run(lm, args, variant: str) -> dict:
    """One engine for `variant`: default | no-audio (codec off) | sync (no step in flight), with flags after
    `+`: `trace` profiles a window of steps (the profiler's overhead then inflates the run's own timers),
    `prio` runs the talker on a high-priority CUDA stream (the codec's stays at the default priority),
    `codec-bf16` / `codec-fp32` run the codec decoder in that dtype (default: the engine's, bf16 on CUDA),
    `chunked` decodes each chunk when due (`codec_decode_every_step=False`)."""
    name = variant
    variant, *flags = variant.split("+")
    traced = "trace" in flags and args.trace_steps > 0
    codec_dtype = "bfloat16" if "codec-bf16" in flags else "float32" if "codec-fp32" in flags else "auto"
    if "prio" in flags:
        torch.cuda.set_stream(torch.cuda.Stream(priority=-100))  # clamped to the device's highest
    cfg = EngineConfig(device=args.device, dtype="bfloat16" if args.size != "tiny" else "float32",
                       max_num_seqs=args.max_num_seqs,
                       gpu_memory_utilization=0.6, async_scheduling=variant != "sync",
                       codec_decode_every_step="chunked" not in flags, codec_dtype=codec_dtype)
    engine = Engine(lm, cfg)
    engine.warm_up()
    audio_on = variant != "no-audio"
    rng = random.Random(0)
    lo, hi = (int(x) for x in args.frames.split(","))
    # Prompts are built before the loop, as the server's admission thread builds them off the engine's.
    todo = []
    for i in range(args.requests):
        er = make_request(lm, i, args.mode, rng.randint(lo, hi), args.ref_frames)
        er.stream_audio = audio_on
        er.prompt = engine.prepare_prompt(er.spec)
        todo.append(er)
    next_id, live, started_at, ttfp = 0, set(), {}, []
    audio_samples, frames_done = 0, 0

    def add() -> None:
        nonlocal next_id
        er = todo[next_id]
        engine.add_request(er)
        live.add(er.request_id)
        started_at[er.request_id] = time.perf_counter()
        next_id += 1

    timer = PhaseTimer(engine, annotate=traced)
    for _ in range(args.concurrency):
        add()
    if args.ready_file:  # tells a sampling profiler outside that the measured loop begins
        open(args.ready_file, "w").close()
    t0 = time.perf_counter()
    times0 = (engine.times.steps, engine.times.host_s, engine.times.gpu_s, engine.times.gap_s)
    outside = 0.0
    prof, step_no, trace = None, 0, None
    samples: list[Sample] = []  # the engine's counters after each step, for the rates over the steady middle
    last = time.perf_counter()
    while live:
        if traced and step_no == args.trace_after:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        s = time.perf_counter()
        outside += s - last
        outs = engine.step()
        now = engine.times
        samples.append(Sample(time.perf_counter(), {"decode_rows": now.decode_rows, "steps": now.steps,
                                                    "gpu_s": now.gpu_s, "gap_s": now.gap_s}))
        for o in outs:
            if o.audio is not None and o.audio.size:
                audio_samples += o.audio.size
                if o.request_id in started_at:
                    ttfp.append(time.perf_counter() - started_at.pop(o.request_id))
            if o.finished:
                frames_done += o.num_frames
                live.discard(o.request_id)
                if next_id < args.requests:
                    add()
        step_no += 1
        if prof is not None and step_no == args.trace_after + args.trace_steps:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            trace = gpu_gaps(prof)
            if args.trace_out:
                prof.export_chrome_trace(f"{args.trace_out}-{variant}.json")
            prof = None
        last = time.perf_counter()
    wall = time.perf_counter() - t0
    t = engine.times
    steps = t.steps - times0[0]
    gpu, gap = t.gpu_s - times0[2], t.gap_s - times0[3]
    ttfp.sort()
    row = {
        "variant": name, "mode": args.mode, "concurrency": args.concurrency,
        "requests": next_id,
        "wall_s": wall, "steps": steps, "audio_s_per_s": audio_samples / 24000 / wall,
        "frames_per_s": frames_done / wall,
        "host_ms_per_step": 1000 * (t.host_s - times0[1]) / steps, "gpu_ms_per_step": 1000 * gpu / steps,
        "gap_ms_per_step": 1000 * gap / steps, "gpu_busy": gpu / (gpu + gap) if gpu + gap else None,
        "outside_step_ms_per_step": 1000 * outside / steps,
        "phase_ms_per_step": {k: 1000 * v / steps for k, v in timer.seconds.items()},
        "ttfp_p50_ms": 1000 * ttfp[len(ttfp) // 2] if ttfp else None,
        "ttfp_p99_ms": 1000 * ttfp[min(len(ttfp) - 1, int(0.99 * len(ttfp)))] if ttfp else None,
        "trace": trace,
        "steady": steady_summary(samples),
    }
    if "prio" in flags:
        torch.cuda.synchronize()
        torch.cuda.set_stream(torch.cuda.default_stream())
    return row


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The closed loop's shape and the model (shared with loop_diag.py and voice_first_use.py)."""
    ap.add_argument("--size", default="0.6B", help="0.6B or 1.7B (random weights), or tiny (a CPU smoke run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--frames", default="25,50", help="min,max frames per request (2-4 s of audio)")
    ap.add_argument("--mode", default="xvec", choices=("xvec", "clone"))
    ap.add_argument("--ref-frames", type=int, default=60)


def emit_json(out: dict, path: str | None) -> None:
    """Prints a benchmark's result, with the tree it measured (the `legato` on PYTHONPATH) and that tree's commit
    where it is a git checkout, and writes it to `path` when given."""
    import subprocess
    import sys
    from pathlib import Path

    tree = Path(sys.modules["legato"].__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    text = json.dumps({"tree": str(tree), "commit": commit, **out}, indent=1)
    print(text)
    if path:
        Path(path).write_text(text)


def random_base_model(size: str, device: str):
    """A Base model of `size` with random weights in bf16; `tiny`: the tests' config in fp32."""
    if size == "tiny":
        from legato.models.qwen3_tts.tiny import tiny_config, tiny_speech_tokenizer_config

        return random_model(tiny_config(), tiny_speech_tokenizer_config(), device=device, dtype=torch.float32)
    return random_model(preset(size, "base"), SpeechTokenizerConfig(), device=device, dtype=torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--variants", default="default,no-audio,sync,default+trace")
    ap.add_argument("--trace-steps", type=int, default=0, help="profile this many steps (0: none)")
    ap.add_argument("--trace-after", type=int, default=150, help="steps before the profiled window")
    ap.add_argument("--trace-out", default=None, help="path prefix for chrome traces")
    ap.add_argument("--out", default=None)
    ap.add_argument("--ready-file", default=None, help="created when the measured loop starts")
    args = ap.parse_args()
    lm = random_base_model(args.size, args.device)
    result = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "commit": os.environ.get("LEGATO_COMMIT", "?"), "args": vars(args), "rows": []}
    for variant in args.variants.split(","):
        row = run(lm, args, variant)
        gc.collect()  # the phase timers' wrappers tie the engine in a cycle: free its KV cache before the next
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
