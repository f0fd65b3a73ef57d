"""The codec step alone: device time per frame and kernels per call, old decoder beside new, and the fidelity
of each reduced-precision path against fp32 on the same codes.

- `old`: `CodecDecoder.stream_step` over rows gathered from a state bank and scattered back (the decoder
  before the time-major rewrite), in the given dtype.
- `new`: `StreamingCodecDecoder.step`, the state in place in its slots (Triton kernels below fp32; the
  PyTorch path in fp32, TF32 off).
- `plain`: `new` without split-K; `fused`: `new` with the one-kernel residual units (layers/conv_kernels.py);
  `nofeed`: `new` with every staged conv's input built by the staging kernel (codec_stages.FEED_NEXT off).
Each (variant, dtype, streams B, frames per call n) is one CUDA graph of one call; the time is the median of
`--replays` replays between CUDA events, divided by B x n. Kernels per call are counted by the profiler on
an eager call. The fidelity part decodes `--fidelity-frames` frames per stream at several B and n, with
well-conditioned random weights (every parameter random) and with the engine benchmarks' random model's.

    python3 benchmarks/codec_step.py --device cuda --out /tmp/codec.json
    python3 benchmarks/codec_step.py --device cpu --size tiny      # a CPU smoke run (wall clock, no graphs)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

import torch

from legato.eval.fidelity import compare
from legato.layers import conv_kernels
from legato.models.qwen3_tts import codec_stages
from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.models.qwen3_tts.config import CodecDecoderConfig
from legato.models.qwen3_tts.streaming_codec import StreamingCodecDecoder
from legato.models.qwen3_tts.testing import randomize_, randomize_codec_decoder_
from legato.models.qwen3_tts.tiny import tiny_speech_tokenizer_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def old_step(decoder: CodecDecoder, b: int, n: int, device):
    bank = decoder.new_stream_state(b + 1, device=device)
    rows = torch.arange(b, device=device)
    codes = torch.randint(0, 2048, (b, n, 16), device=device)

    def step():
        wav, new = decoder.stream_step(codes, bank.select(rows))
        bank.position.index_copy_(0, rows, new.position)
        for key, buf in bank.buffers.items():
            buf.index_copy_(0, rows, new.buffers[key])
        return wav

    return step


def new_step(codec: StreamingCodecDecoder, b: int, n: int, device):
    slots = torch.arange(1, b + 1, device=device)
    codes = torch.randint(0, 2048, (b, n, 16), device=device)
    codec.reset(slots)
    return lambda: codec.step(slots, codes)


def count_kernels(step) -> int | None:
    if not torch.cuda.is_available():
        return None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def kernel_profile(step, top: int = 25) -> list[dict]:
    """Device time by kernel name over one eager call (no launch gaps: where the call's device time goes)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    rows = [{"kernel": k[:90], "calls": len(v), "us": sum(v)} for k, v in by_name.items()]
    return sorted(rows, key=lambda r: -r["us"])[:top]


def time_step(step, device: str, replays: int) -> dict:
    if device != "cuda":
        step()
        times = []
        for _ in range(max(3, replays // 10)):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return {"median_ms": 1000 * statistics.median(times), "graph": False}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return {"median_ms": statistics.median(times), "p10_ms": sorted(times)[len(times) // 10], "graph": True}


# Variant suffixes: "+name" switches a codec_stages knob on for that variant, "-name" off ("new+group-tr").
KNOBS = {"group": "GROUP_RESTAGE", "tr": "FUSED_TRANSFORMER", "dead": "SKIP_DEAD_OUTPUT"}


def set_knobs(variant: str) -> str:
    """Sets the module knobs a variant names (from the tree's defaults) and returns its base name."""
    base, *parts = re.split(r"(?=[+-])", variant)
    for attr, value in DEFAULTS.items():
        setattr(codec_stages, attr, value)
    # "plain": without split-K; "fused": with the one-kernel residual units too; "nofeed": every staged conv's
    # input through the staging kernel, none written by the conv before
    conv_kernels.SPLIT_K = base != "plain"
    codec_stages.FUSE_UNITS = base == "fused"
    codec_stages.FEED_NEXT = base != "nofeed"
    for part in parts:
        setattr(codec_stages, KNOBS[part[1:]], part[0] == "+")
    return base


DEFAULTS = {attr: getattr(codec_stages, attr) for attr in KNOBS.values()}


def speed(args, cfg: CodecDecoderConfig) -> list[dict]:
    """Every (variant, dtype, cell) timed once a round; rounds repeat the whole set in the same order, so a
    variant's median over rounds is compared with the others' under the same drift."""
    rows = []
    base = randomize_codec_decoder_(CodecDecoder(cfg).eval(), seed=1).to(args.device)
    cells = [tuple(int(v) for v in c.split("x")) for c in args.cells.split(",")]
    for rnd in range(args.rounds):
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            for b, n in cells:
                for variant in args.variants.split(","):
                    torch.manual_seed(0)
                    if variant == "old":
                        decoder = CodecDecoder(cfg).to(args.device)
                        decoder.load_state_dict(base.state_dict())
                        decoder = decoder.to(dtype).eval()
                        step = old_step(decoder, b, n, args.device)
                    else:
                        set_knobs(variant)
                        decoder = StreamingCodecDecoder(base, b + 1, dtype=dtype)
                        step = new_step(decoder, b, n, args.device)
                    try:
                        with torch.inference_mode():
                            kernels = count_kernels(step)
                            timing = time_step(step, args.device, args.replays)
                            profile = (kernel_profile(step) if args.device == "cuda" and rnd == 0 and f"{b}x{n}" in
                                       args.profile_cells.split(",") else None)
                    except torch.OutOfMemoryError:
                        rows.append({"variant": variant, "dtype": dtype_name, "streams": b, "frames": n,
                                     "round": rnd, "error": "OOM"})
                        print(json.dumps(rows[-1]), flush=True)
                        continue
                    finally:
                        del step, decoder
                        set_knobs("new")
                        if args.device == "cuda":
                            torch.cuda.empty_cache()
                    row = {"variant": variant, "dtype": dtype_name, "streams": b, "frames": n, "round": rnd,
                           "kernels": kernels, **timing, "us_per_frame": 1000 * timing["median_ms"] / (b * n)}
                    if profile is not None:
                        row["profile"] = profile
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


@torch.inference_mode()
def decode(codec: StreamingCodecDecoder, codes: torch.Tensor, n: int) -> torch.Tensor:
    b = codes.shape[0]
    slots = torch.arange(1, b + 1, device=codes.device)
    codec.reset(slots)
    return torch.cat([codec.step(slots, codes[:, i: i + n]) for i in range(0, codes.shape[1], n)], dim=1)


def fidelity(args, cfg: CodecDecoderConfig) -> list[dict]:
    """Each reduced-precision path of the new decoder (and the old decoder cast to bf16) against the new fp32
    path, same codes; the new fp32 path against the old fp32 decoder."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    out = []
    for weights in ("conditioned", "engine-random"):
        base = CodecDecoder(cfg).eval()
        if weights == "conditioned":
            randomize_codec_decoder_(base, seed=3)
        else:
            randomize_(base, seed=4)
        base = base.to(args.device)
        frames = args.fidelity_frames
        for b in (1, 8, 64):
            codes = torch.randint(0, 2048, (b, frames, 16), generator=torch.Generator().manual_seed(b)).to(args.device)
            ref = decode(StreamingCodecDecoder(base, b + 1, dtype=torch.float32), codes, 4)
            with torch.inference_mode():
                old = base(codes)[:, 0]
            out.append({"weights": weights, "path": "new fp32 vs old fp32", "streams": b, "frames_per_call": 4,
                        **compare(old, ref), "ref_rms": ref.pow(2).mean().sqrt().item()})
            print(json.dumps(out[-1]), flush=True)
            for dtype_name in args.dtypes.split(","):
                if dtype_name == "float32":
                    continue
                for n in (1, 4, 25):
                    got = decode(StreamingCodecDecoder(base, b + 1, dtype=DTYPES[dtype_name]), codes, n)
                    out.append({"weights": weights, "path": f"new {dtype_name}", "streams": b, "frames_per_call": n,
                                **compare(ref, got)})
                    print(json.dumps(out[-1]), flush=True)
                old_cast = CodecDecoder(cfg).to(args.device)
                old_cast.load_state_dict(base.state_dict())
                with torch.inference_mode():
                    got = old_cast.to(DTYPES[dtype_name]).eval()(codes)[:, 0].float()
                out.append({"weights": weights, "path": f"old {dtype_name} (whole forward)", "streams": b,
                            "frames_per_call": frames, **compare(ref, got)})
                print(json.dumps(out[-1]), flush=True)
                del old_cast
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="full", choices=("full", "tiny"))
    ap.add_argument("--variants", default="old,new")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--cells", default="64x1,64x4,64x25,256x4", help="streams x frames per call")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=1, help="times the whole set of variants is timed, in turn")
    ap.add_argument("--profile-cells", default="64x1", help="cells whose eager call is profiled by kernel")
    ap.add_argument("--fidelity", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--fidelity-frames", type=int, default=60)
    ap.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = CodecDecoderConfig() if args.size == "full" else tiny_speech_tokenizer_config().decoder_config
    result = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "commit": os.environ.get("LEGATO_COMMIT", "?"), "args": vars(args)}
    if args.speed:
        result["speed"] = speed(args, cfg)
    if args.fidelity:
        result["fidelity"] = fidelity(args, cfg)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    by_cell: dict[tuple, list[dict]] = {}
    for r in result.get("speed", []):
        if "us_per_frame" in r:
            by_cell.setdefault((r["variant"], r["dtype"], r["streams"], r["frames"]), []).append(r)
    for (variant, dtype_name, b, n), rs in by_cell.items():
        us = sorted(r["us_per_frame"] for r in rs)
        print(f"{variant:24} {dtype_name:9} B={b:<4} n={n:<3} {statistics.median(us):9.2f} us/frame (median of "
              f"{len(us)}: {', '.join(f'{u:.2f}' for u in us)})  {rs[0]['kernels']} kernels")


if __name__ == "__main__":
    main()
