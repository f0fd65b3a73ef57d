"""Offline engine throughput/latency on a GPU with a full-size config and random weights.

Output length is fixed (EOS masked, `--frames` frames per request): random weights carry no speech, so
frames/s, not audio quality, is what this measures. Prompts are in-context clones of a `--ref-frames`
reference (~130 prompt tokens by default).

    python benchmarks/offline.py --size 0.6B --batch-sizes 1,8,32,64,128,256 --frames 128 --out r.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import time

import torch

from legato.engine.config import EngineConfig
from legato.engine.engine import Engine, EngineRequest
from legato.models.qwen3_tts.config import SpeechTokenizerConfig, preset
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.prompt_build import build_prompt
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.models.qwen3_tts.testing import random_model


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


TEXT = "Please call Stella and ask her to bring these things with her from the store, and a snack for Bob."


def make_requests(lm, n: int, frames: int, ref_frames: int, tag: str) -> list[EngineRequest]:
    g = torch.Generator().manual_seed(0)
    hidden = lm.config.talker_config.hidden_size
    spec = build_spec(lm, SpeechInput(TEXT, language="english", speaker_embedding=torch.randn(hidden, generator=g),
                                      ref_code=torch.randint(0, 2048, (ref_frames, 16), generator=g),
                                      ref_text="Six spoons of fresh snow peas."))
    return [EngineRequest(f"{tag}-{i}", spec, SamplingParams(seed=i, max_new_tokens=frames + 1), max_frames=frames,
                          ignore_eos=True, stream_audio=False) for i in range(n)]


def run_batch(engine: Engine, lm, batch: int, frames: int, ref_frames: int, tag: str) -> dict:
    """Runs `batch` requests to completion. Steady-state decode steps (every request decoding, one frame
    each) are timed apart from the steps that prefill."""
    reqs = make_requests(lm, batch, frames, ref_frames, tag)
    prompt_tokens = build_prompt(reqs[0].spec, lm.talker, lm.config).length
    for r in reqs:
        engine.add_request(r)
    sync()
    t0 = time.perf_counter()
    decode_steps, decode_time, other_time = 0, 0.0, 0.0
    codes: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished():
        running = engine.scheduler.num_running
        s = time.perf_counter()
        outs = engine.step()  # returns host tensors: the step is synchronised
        dt = time.perf_counter() - s
        for o in outs:
            codes[o.request_id].append(o.codes)
        if running == batch and sum(o.codes.shape[0] for o in outs) == batch:
            decode_steps += 1
            decode_time += dt
        else:
            other_time += dt
    total = time.perf_counter() - t0
    step_s = decode_time / max(decode_steps, 1)
    return {
        "batch": batch, "frames": frames, "prompt_tokens": prompt_tokens, "decode_steps": decode_steps,
        "decode_ms_per_step": 1000 * step_s, "decode_frames_per_s": batch / step_s if decode_steps else None,
        "rtf_per_stream": step_s / 0.08, "prefill_and_tail_s": other_time, "total_s": total,
        "end_to_end_frames_per_s": batch * frames / total,
        # The codes of every request, in order: two runs of the same tree and weights that differ only in how
        # kernels launch (--pdl) must give the same digest.
        "codes_sha1": hashlib.sha1(b"".join(torch.cat(c).numpy().tobytes() for c in codes.values())).hexdigest(),
    }


def profile_decode(engine: Engine, lm, batch: int, ref_frames: int, path: str | None) -> str:
    """Kernel-time table of a few steady decode steps (on an eager engine; a graph replay's kernels show only
    where the profiler traces CUDA graphs)."""
    from torch.profiler import ProfilerActivity, profile

    for r in make_requests(lm, batch, 24, ref_frames, f"prof-{batch}"):
        engine.add_request(r)
    while engine.scheduler.num_running < batch or any(r.in_prefill for r in engine.scheduler._running.values()):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        sync()
    while engine.has_unfinished():
        engine.step()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    table += "\n" + kernels_by_grid(prof, steps=5)
    if path:
        with open(path, "w") as f:
            f.write(table)
    return table


def kernels_by_grid(prof, steps: int, rows: int = 40) -> str:
    """Device time per step by (kernel, grid): one kernel name serves layers of different shapes (the talker's
    attention and the code predictor's share `_fused_decode_kernel`), and the grid tells them apart."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    total: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e.get("cat") != "kernel":
            continue
        key = (e["name"][:60], str(e.get("args", {}).get("grid")))
        total.setdefault(key, []).append(e["dur"])
    out = [f"{'kernel':60s} {'grid':>16s} {'us/step':>9s} {'n/step':>7s} {'us each':>8s}"]
    for (name, grid), d in sorted(total.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        out.append(f"{name:60s} {grid:>16s} {sum(d) / steps:9.1f} {len(d) / steps:7.1f} {sum(d) / len(d):8.2f}")
    out.append(f"all kernels: {sum(sum(d) for d in total.values()) / steps:.1f} us/step, "
               f"{sum(len(d) for d in total.values()) / steps:.0f} launches/step")
    return "\n".join(out)


def bench_codec(lm, dtype: torch.dtype, batches: list[int], chunk: int, steps: int) -> list[dict]:
    dec = lm.speech_tokenizer.decoder.to(dtype)
    rows = []
    for b in batches:
        state = dec.new_stream_state(b)
        codes = torch.randint(0, 2048, (b, chunk, 16), device=next(dec.parameters()).device)
        with torch.inference_mode():
            for _ in range(2):
                _, state = dec.stream_step(codes, state)
            sync()
            t = time.perf_counter()
            for _ in range(steps):
                _, state = dec.stream_step(codes, state)
            sync()
            dt = time.perf_counter() - t
        rows.append({"dtype": str(dtype).replace("torch.", ""), "batch": b, "chunk_frames": chunk,
                     "ms_per_chunk": 1000 * dt / steps, "frames_per_s": b * chunk * steps / dt})
        print(json.dumps(rows[-1]), flush=True)
    lm.speech_tokenizer.decoder.to(torch.float32)
    return rows


# Switches to the path before a change, each measured against the default in the same call: flag -> what it runs.
PATHS_BEFORE = {
    "--unfused-attention": "decode attention as separate norm, rotary, cache-write and attention kernels (the path "
                           "before layers/fused_attention.py), to measure the kernel's share",
    "--cublas-linear": "every matmul through cuBLAS (the path before layers/skinny_linear.py), to measure the "
                       "few-row kernel's share",
    "--no-small-matmul": "few-row matmuls through the one-row kernel and cuBLAS (the path before "
                         "layers/small_matmul.py), to measure its share",
    "--no-fused-norm": "a split few-row product's sum, residual add and norm as two kernels (the path before "
                       "small_matmul.FUSED_NORM)",
    "--no-lookup-norm": "a code-predictor pass's embedding lookup and first norm as two kernels (the path before "
                        "layers/lookup_norm.py)",
    "--no-pdl": "the decode step's kernels without programmatic dependent launch (layers/pdl.py; the path before it)",
    "--bisection-draw": "the fused draw's top-k value by 32 halvings (the path before draw_kernel.PACKED_SEARCH)",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="0.6B")
    ap.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    ap.add_argument("--frames", type=int, default=128)
    ap.add_argument("--ref-frames", type=int, default=120)
    ap.add_argument("--modes", default="graphs,eager")
    ap.add_argument("--eager-batch-sizes", default="1,8,64,256")
    ap.add_argument("--codec-batches", default="1,16,64,128,256", help="'none': skip the old codec's table")
    ap.add_argument("--codec-chunk", type=int, default=25)
    ap.add_argument("--codec-steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile-batch", type=int, default=0, help="profile eager decode at this batch size")
    ap.add_argument("--profile-graphs", action="store_true",
                    help="profile the graphs mode's decode too (--profile-batch): whether the replay's kernels show "
                         "depends on the profiler's CUDA graph tracing")
    for flag, what in PATHS_BEFORE.items():
        ap.add_argument(flag, action="store_true", help=what)
    ap.add_argument("--pdl", action="store_true", help="(the default since 2026-12-07; kept for older commands)")
    ap.add_argument("--stack-lookup", action="store_true",
                    help="with --stack, the launch looks up a codebook's embedding row (code_predictor.STACK_LOOKUP)")
    ap.add_argument("--stack", action="store_true",
                    help="the code predictor's one-launch pass for one-row passes (EngineConfig.code_predictor_stack)")
    ap.add_argument("--projected-lookup", action="store_true", help="(the default since 2026-12-07 (5))")
    ap.add_argument("--no-projected-lookup", action="store_true",
                    help="a projected code predictor's (1.7B) passes gather, project and norm apart, not from "
                         "projected tables through the lookup-and-norm kernel (code_predictor.PROJECTED_LOOKUP off)")
    ap.add_argument("--philox-per-block", action="store_true",
                    help="the fused draw's Philox once per four-word block (draw_kernel.PHILOX_PER_BLOCK)")
    ap.add_argument("--draw-warps", type=int, default=None,
                    help="warps a fused draw's program runs (draw_kernel.WARPS)")
    ap.add_argument("--compiled-sampler", action="store_true",
                    help="draws through torch.compile (the path before engine/draw_kernel.py)")
    ap.add_argument("--attn-splits", type=int, default=None,
                    help="fused_attention.SPLITS (programs a paged row's positions split over below "
                         "ONE_SPLIT_ROWS rows; 1: no split)")
    ap.add_argument("--attn-split-all", action="store_true",
                    help="split a paged row's positions at any row count (the path before ONE_SPLIT_ROWS)")
    ap.add_argument("--attn-block-n", type=int, default=None, help="fused_attention.BLOCK_N (positions per loop)")
    ap.add_argument("--attn-reductions", action="store_true",
                    help="fused attention's scores and sums as CUDA-core reductions (fused_attention.DOT off)")
    ap.add_argument("--profile-out", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    if args.stack_lookup:
        from legato.models.qwen3_tts import code_predictor

        code_predictor.STACK_LOOKUP = True
    if args.unfused_attention:
        from legato.layers import fused_attention

        fused_attention.ENABLED = False
    if args.no_projected_lookup:
        from legato.models.qwen3_tts import code_predictor

        code_predictor.PROJECTED_LOOKUP = False
    if args.no_lookup_norm:
        from legato.layers import lookup_norm

        lookup_norm.ENABLED = False
    if args.attn_splits or args.attn_block_n or args.attn_reductions or args.attn_split_all:
        from legato.layers import fused_attention

        fused_attention.DOT = not args.attn_reductions
        fused_attention.SPLITS = args.attn_splits or fused_attention.SPLITS
        fused_attention.BLOCK_N = args.attn_block_n or fused_attention.BLOCK_N
        if args.attn_split_all:
            fused_attention.ONE_SPLIT_ROWS = 1 << 30
    if args.compiled_sampler or args.bisection_draw or args.philox_per_block or args.draw_warps:
        from legato.engine import draw_kernel

        draw_kernel.ENABLED = not args.compiled_sampler
        draw_kernel.PACKED_SEARCH = not args.bisection_draw
        draw_kernel.PHILOX_PER_BLOCK = args.philox_per_block
        draw_kernel.WARPS = args.draw_warps
    if args.pdl or args.no_pdl:
        from legato.layers import pdl

        pdl.ENABLED = not args.no_pdl
    if args.no_fused_norm:
        from legato.layers import small_matmul

        small_matmul.FUSED_NORM = False
    if args.cublas_linear or args.no_small_matmul:
        from legato.layers import skinny_linear, small_matmul

        small_matmul.ENABLED = False
        skinny_linear.ENABLED = not args.cublas_linear
    if args.size == "tiny":  # a CPU smoke run of this script
        from legato.models.qwen3_tts.tiny import tiny_config, tiny_speech_tokenizer_config

        lm = random_model(tiny_config(), tiny_speech_tokenizer_config(), device=args.device, dtype=torch.float32)
    else:
        lm = random_model(preset(args.size, "base"), SpeechTokenizerConfig(), device=args.device, dtype=torch.bfloat16)
    batches = [int(x) for x in args.batch_sizes.split(",")]
    result = {
        "model": f"Qwen3-TTS-12Hz-{args.size}-Base config, random weights, talker bf16",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "host": platform.node(),
        # The device copy of the tree has no .git: pass the commit in LEGATO_COMMIT there.
        "commit": os.environ.get("LEGATO_COMMIT")
        or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "engine": {}, "codec": [], "fused_attention": not args.unfused_attention,
        "skinny_linear": not args.cublas_linear, "small_matmul": not (args.cublas_linear or args.no_small_matmul),
        "matmul_tiles": os.environ.get("LEGATO_MATMUL_TILES"), "attn_splits": args.attn_splits,
        "attn_split_all": args.attn_split_all,
        "attn_block_n": args.attn_block_n,
        "attn_reductions": args.attn_reductions,
        "fused_draw": not args.compiled_sampler, "decoder_stack": args.stack, "fused_norm": not args.no_fused_norm,
        "lookup_norm": not args.no_lookup_norm, "projected_lookup": not args.no_projected_lookup,
        "pdl": not args.no_pdl,
        "stack_lookup": args.stack_lookup, "packed_draw": not args.bisection_draw,
        "philox_per_block": args.philox_per_block, "draw_warps": args.draw_warps,
    }
    for mode in args.modes.split(","):
        eager = mode == "eager"
        sizes = [int(x) for x in args.eager_batch_sizes.split(",")] if eager else batches
        cfg = EngineConfig(device=args.device, dtype="bfloat16" if args.size != "tiny" else "float32",
                           max_num_seqs=max(sizes), cuda_graph_max_batch=max(sizes),
                           max_num_batched_tokens=8192, max_model_len=2048, enforce_eager=eager,
                           gpu_memory_utilization=0.6, code_predictor_stack=args.stack)
        t = time.perf_counter()
        engine = Engine(lm, cfg)
        setup = time.perf_counter() - t
        print(f"[{mode}] engine ready in {setup:.1f}s, {cfg.num_kv_blocks} KV blocks", flush=True)
        run_batch(engine, lm, 2, 8, args.ref_frames, f"warm-{mode}")
        rows = []
        for b in sizes:
            row = run_batch(engine, lm, b, args.frames, args.ref_frames, f"{mode}-{b}")
            rows.append(row)
            print(f"[{mode}] " + json.dumps(row), flush=True)
        result["engine"][mode] = {"setup_s": setup, "rows": rows}
        if args.profile_batch and (eager or args.profile_graphs):
            path = args.profile_out and args.profile_out.replace(".txt", f"-{mode}.txt")
            print(profile_decode(engine, lm, args.profile_batch, args.ref_frames, path), flush=True)
        del engine
        torch.cuda.empty_cache()
    for dtype in (torch.float32, torch.bfloat16) if args.codec_batches != "none" else ():
        result["codec"] += bench_codec(lm, dtype, [int(x) for x in args.codec_batches.split(",")],
                                       args.codec_chunk, args.codec_steps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
