"""Which requests of a bench run had a gap in their audio, and where: for split's continuity below 1.00 (issue 22).

For each request whose never-pausing player ran dry (`underrun_s` > 0, legato/bench/metrics.py), one line: its
TTFP, chunk count, the chunks that came late (index, how late, the gap since the chunk before, the audio that
chunk before carried), so a late second chunk (the first-chunk hand-over) can be told from a stall mid-stream or a
late tail.

    python3 benchmarks/underruns.py /tmp/topo-split/runs/*.json [--top 20]
"""

from __future__ import annotations

import argparse
import json
import sys


def late_chunks(times_s: list[float], nbytes: list[int], bytes_per_s: float) -> list[tuple[int, float, float, float]]:
    """(index, deficit s, gap since the chunk before s, audio s of the chunk before) of each late chunk."""
    out, received, t0 = [], 0, times_s[0]
    for i, (t, b) in enumerate(zip(times_s, nbytes, strict=True)):
        if i > 0:
            deficit = (t - t0) - received / bytes_per_s
            if deficit > 1e-9:
                out.append((i, deficit, t - times_s[i - 1], nbytes[i - 1] / bytes_per_s))
        received += b
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="bench run JSON files (legato bench --result-dir)")
    ap.add_argument("--top", type=int, default=20, help="requests listed per run, worst first")
    args = ap.parse_args()
    for path in args.runs:
        try:
            requests = json.load(open(path))["requests"]
        except (OSError, ValueError, KeyError) as e:
            print(f"{path}: unreadable ({e})")
            continue
        gapped = [r for r in requests if (r.get("underrun_s") or 0) > 0 and r.get("chunk_times_s")]
        print(f"{path}: {len(gapped)} of {len(requests)} requests with a gap")
        hist: dict[int, int] = {}
        for r in sorted(gapped, key=lambda r: -r["underrun_s"]):
            rate = r["total_bytes"] / r["audio_s"] if r.get("audio_s") else 48000.0
            late = late_chunks(r["chunk_times_s"], r["chunk_bytes"], rate)
            for i, *_ in late:
                hist[i] = hist.get(i, 0) + 1
            if args.top > 0:
                args.top -= 1
                parts = ", ".join(f"#{i} {1000 * d:.1f} ms late (gap {1000 * g:.1f} ms after "
                                  f"{1000 * a:.0f} ms of audio)" for i, d, g, a in late[:4])
                print(f"  ttfp {1000 * r['chunk_times_s'][0]:.0f} ms, {len(r['chunk_times_s'])} chunks, "
                      f"{r['audio_s']:.2f} s audio: {parts}")
        if hist:
            print("  late chunks by index:", dict(sorted(hist.items())))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
