"""What a reference clip costs the admission thread the first time it is seen, and after (issue 22's first
burst): `build_spec` through a `VoiceCache` for the bench corpus's voices, in order, twice over, then again
with an empty cache (each voice's features recomputed, its shapes no longer new to the process).
`--warm-elsewhere` first encodes one clip on another thread (what the server's warm-up did before it ran on
the admission thread); `--no-cudnn` runs the encoders' convolutions without cuDNN.

    python3 benchmarks/voice_first_use.py --mode xvec --out /tmp/voices.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import threading
import time

import soundfile as sf
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_loop import random_base_model  # noqa: E402

from legato.models.qwen3_tts.inputs import SpeechInput, VoiceCache, build_spec, extract_voice  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="0.6B")
    ap.add_argument("--mode", default="xvec", choices=("xvec", "clone"))
    ap.add_argument("--voices", default=".bench-data/prompts/en/prompt-wavs")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warm-elsewhere", action="store_true")
    ap.add_argument("--no-cudnn", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.no_cudnn:
        torch.backends.cudnn.enabled = False
    lm = random_base_model(args.size, args.device)
    clips = [(os.path.basename(p), *sf.read(p, dtype="float32")) for p in sorted(glob.glob(f"{args.voices}/*.wav"))]
    warm_s = None
    if args.warm_elsewhere:
        noise = (torch.randn(24000, generator=torch.Generator().manual_seed(0)) * 0.1).numpy()
        t = time.perf_counter()
        worker = threading.Thread(target=extract_voice, args=(lm, noise, 24000))
        worker.start()
        worker.join()
        warm_s = time.perf_counter() - t
        print(f"warmed up on another thread in {1000 * warm_s:.1f} ms")
    rows, seen = [], VoiceCache()
    for rnd, cache in (("first", seen), ("cached", seen), ("recomputed", VoiceCache())):
        for name, x, sr in clips:
            inp = SpeechInput("A sentence to say in the voice of the clip.", ref_audio=x, ref_sample_rate=sr,
                              x_vector_only=args.mode == "xvec",
                              ref_text=None if args.mode == "xvec" else "The clip's own words.")
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            build_spec(lm, inp, extract=cache)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            rows.append({"round": rnd, "voice": name, "samples": len(x), "ms": 1000 * (time.perf_counter() - t)})
    print("\n".join(f"{r['round']:>10} {r['voice']} {r['samples']:>7} {r['ms']:8.1f} ms" for r in rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "warm_elsewhere_s": warm_s, "commit": os.environ.get("LEGATO_COMMIT", "?"),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
