"""Where a reference clip of a new length spends its first encode, and what cuts it (issue 22's first burst).

`voice_first_use.py` showed a clip of a length the process has not seen costing 20-40 ms more than one of a seen
length. This splits that cost and tries cuts, each on lengths no earlier part of the process used:
- `mel` and `net`: the log-mel front end (an STFT, planned per frame count) and the speaker network (cuDNN
  convolutions, planned per length), each timed on new lengths and again on the same lengths;
- `net_cudnn` against `net_gemm`: the network's convolutions through cuDNN (the default), and as one GEMM each
  (`SameConv.gemm`); and each one's embeddings against fp32 math;
- `codec_cudnn` against `codec_gemm`: an in-context clone's codec encoder on new and seen lengths, both paths, and
  each one's codes against exact fp32 math;
- `threads`: the bench corpus's voices at new lengths encoded one after another, then on 4 threads at once
  (what a burst of new voices waits for), on the default path.

    python3 benchmarks/voice_shapes.py --out /tmp/voice_shapes.json
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import soundfile as sf
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_loop import random_base_model  # noqa: E402

from legato.models.qwen3_tts.inputs import extract_voice  # noqa: E402
from legato.models.qwen3_tts.mimi_layers import CausalStridedConv  # noqa: E402
from legato.models.qwen3_tts.speaker_encoder import SameConv  # noqa: E402

HOP = 256


def _ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="0.6B")
    ap.add_argument("--voices", default=".bench-data/prompts/en/prompt-wavs")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lm = random_base_model(args.size, args.device)
    enc = lm.model.speaker_encoder
    clips = [sf.read(p, dtype="float32")[0] for p in sorted(glob.glob(f"{args.voices}/*.wav"))]
    extract_voice(lm, (torch.randn(24000) * 0.1).numpy(), 24000, codes=False)  # the server's warm-up
    cut = iter(range(3, 10_000, 3))  # every part takes lengths no earlier part used: hops off each clip's end

    def fresh() -> list[torch.Tensor]:
        k = next(cut)
        return [torch.from_numpy(c[: len(c) - k * HOP]).cuda().unsqueeze(0) for c in clips]

    out: dict = {"commit": os.environ.get("LEGATO_COMMIT", "?"), "clips": len(clips)}
    convs = [m for m in enc.modules() if isinstance(m, SameConv)]
    dtype = next(enc.parameters()).dtype
    wavs = fresh()
    out["mel_new_ms"] = [_ms(lambda w=w: enc.mel(w)) for w in wavs]
    out["mel_seen_ms"] = [_ms(lambda w=w: enc.mel(w)) for w in wavs]
    for label, gemm in (("cudnn", False), ("gemm", True)):
        for m in convs:
            m.gemm = gemm
        mels = [enc.mel(w).to(dtype) for w in fresh()]
        out[f"net_{label}_new_ms"] = [_ms(lambda m=m: enc(m)) for m in mels]
        out[f"net_{label}_seen_ms"] = [_ms(lambda m=m: enc(m)) for m in mels]
    codec_encoder_part(lm, clips, fresh, out)
    # Fidelity on the corpus's own clips: each half-precision path against fp32 math (cuDNN, no TF32).
    ref = copy.deepcopy(enc).float()
    for m in ref.modules():
        if isinstance(m, SameConv):
            m.gemm = False
    whole = [torch.from_numpy(c).cuda().unsqueeze(0) for c in clips]
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    want = [ref.embed(w).float() for w in whole]
    for label, gemm in (("cudnn", False), ("gemm", True)):
        for m in convs:
            m.gemm = gemm
        got = [enc.embed(w).float() for w in whole]
        out[f"embedding_rel_err_vs_fp32_{label}"] = max(
            float((g - r).norm() / r.norm()) for g, r in zip(got, want, strict=True))
    del ref
    for m in convs:
        m.gemm = None  # the rest on the default path (GEMM on CUDA)
    for label, workers in (("serial", 1), ("threads", args.threads)):
        batch = [w[0].cpu().numpy() for w in fresh()]
        with ThreadPoolExecutor(workers) as pool:
            t = time.perf_counter()
            list(pool.map(lambda x: extract_voice(lm, x, 24000, codes=False), batch))
            torch.cuda.synchronize()
            out[f"{label}_new_voices_ms"] = 1000 * (time.perf_counter() - t)
        with ThreadPoolExecutor(workers) as pool:
            t = time.perf_counter()
            list(pool.map(lambda x: extract_voice(lm, x, 24000, codes=False), batch))
            torch.cuda.synchronize()
            out[f"{label}_seen_voices_ms"] = 1000 * (time.perf_counter() - t)
    for key in [k for k in out if k.endswith("_ms") and isinstance(out[k], list)]:
        out[key.replace("_ms", "_median_ms")] = round(statistics.median(out[key]), 2)
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items()
                      if not isinstance(v, list)}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def codec_encoder_part(lm, clips, fresh, out: dict) -> None:
    """In-context clones' second encode: the codec encoder (fp32, as served) on new and seen lengths, through
    cuDNN and as matrix products (`CausalStridedConv.gemm`); and each path's codes against exact fp32 math (cuDNN
    without TF32) on the whole clips: the share of codes equal, and the latents' relative error."""
    codec = lm.speech_tokenizer.encoder
    convs = [m for m in codec.modules() if isinstance(m, CausalStridedConv)]
    for label, gemm in (("cudnn", False), ("gemm", True)):
        for m in convs:
            m.gemm = gemm
        wavs = [w[0] for w in fresh()]
        out[f"codec_{label}_new_ms"] = [_ms(lambda w=w: codec.encode(w)) for w in wavs]
        out[f"codec_{label}_seen_ms"] = [_ms(lambda w=w: codec.encode(w)) for w in wavs]
    whole = [torch.from_numpy(c).cuda() for c in clips]
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    for m in convs:
        m.gemm = False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    with torch.inference_mode():
        want = [(codec.latents(w[None]), codec.encode(w)) for w in whole]
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags  # as served from here
    for label, gemm in (("cudnn", False), ("gemm", True)):
        for m in convs:
            m.gemm = gemm
        with torch.inference_mode():
            got = [(codec.latents(w[None]), codec.encode(w)) for w in whole]
        out[f"codec_{label}_latent_rel_err_vs_fp32"] = max(
            float((g[0] - r[0]).norm() / r[0].norm()) for g, r in zip(got, want, strict=True))
        equal = sum(int((g[1] == r[1]).sum()) for g, r in zip(got, want, strict=True))
        out[f"codec_{label}_codes_equal_share"] = equal / sum(r[1].numel() for r in want)
    for m in convs:
        m.gemm = None


if __name__ == "__main__":
    main()
