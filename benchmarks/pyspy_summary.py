"""Summarises a py-spy raw profile (`py-spy record --format raw --threads [--subprocesses] [--native]`): samples by
process and thread, then, for the busiest threads, the project's functions by inclusive samples (a function counted
once per sample, however deep it recurses) and the innermost frames (with --native: a driver call, a lock).

    python benchmarks/pyspy_summary.py PROFILE.txt [--threads 4] [--top 15] [--match legato]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

# A Python frame is `name (file:line)`; a native one (`py-spy --native`) `name (library)`, its line optional.
_FUNC = re.compile(r"^(?P<name>[^ ]+) \((?P<file>[^:)]+)(?::\d+)?\)$")


def parse(path: str) -> list[tuple[str, str, list[tuple[str, str]], int]]:
    """[(process, thread, [(function, file), ...] outermost first, samples)] of a raw profile."""
    out = []
    for line in open(path, encoding="utf-8", errors="replace"):
        line = line.rstrip("\n")
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        process, thread, frames = "", "", []
        for frame in stack.split(";"):
            if frame.startswith("process "):
                process = frame
            elif frame.startswith("thread "):
                thread = frame
            elif (m := _FUNC.match(frame)) is not None:
                frames.append((m["name"], m["file"]))
        out.append((process, thread, frames, int(count)))
    return out


def summarise(path: str, threads: int = 4, top: int = 15, match: str = "legato") -> str:
    rows = parse(path)
    by_thread: Counter[tuple[str, str]] = Counter()
    funcs: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    leaves: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for process, thread, frames, n in rows:
        key = (process[:60], thread)
        by_thread[key] += n
        seen = {name for name, file in frames if match in file}
        for name in seen:
            funcs[key][name] += n
        if frames:  # where the thread was: its innermost frame, native ones included (a lock, a driver call)
            name, file = frames[-1]
            leaves[key][f"{name} ({file.rsplit('/', 1)[-1]})"] += n
    lines = [f"{path}: {sum(by_thread.values())} samples", "Samples by process and thread:"]
    lines += [f"  {n:6d}  {p}  {t}" for (p, t), n in by_thread.most_common()]
    for key, n in by_thread.most_common(threads):
        lines.append(f"{key[1]} ({key[0]}), {n} samples; '{match}' functions by inclusive samples:")
        lines += [f"  {c:6d}  {name}" for name, c in funcs[key].most_common(top)]
        lines.append("  innermost frames by samples:")
        lines += [f"  {c:6d}  {name}" for name, c in leaves[key].most_common(top)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", nargs="+")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--match", default="legato")
    args = ap.parse_args()
    for path in args.profiles:
        print(summarise(path, args.threads, args.top, args.match))


if __name__ == "__main__":
    main()
