"""Where a kernel's warps wait: Nsight Compute's warp-stall samples per SASS instruction (the CSV of
`ncu -i report --page source --csv --print-source sass`), the instructions holding most samples first, then the
samples by opcode and by stall reason.

    python benchmarks/stall_ledger.py stack-sass.csv --top 45
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the source page's table (ncu may print lines before it)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    for i, row in enumerate(rows):
        if any("Source" == c.strip() for c in row) and any("Sampling" in c for c in row):
            return row, rows[i + 1:]
    raise SystemExit(f"{path}: no table with a Source column and warp-stall samples")


def ledger(header: list[str], rows: list[list[str]], top: int) -> str:
    source = header.index("Source")
    address = header.index("Address") if "Address" in header else None
    samples = next(i for i, c in enumerate(header) if "Sampling (All" in c)
    reasons = [i for i, c in enumerate(header) if re.search(r"stall|Stall", c) and i != samples
               and "Sampling" not in c]
    rows = [r for r in rows if len(r) > samples]
    total = sum(_number(r[samples]) for r in rows) or 1.0
    out = [f"{len(rows)} instructions, {total:.0f} warp-stall samples"]
    seen = 0.0
    for r in sorted(rows, key=lambda r: -_number(r[samples]))[:top]:
        n = _number(r[samples])
        seen += n
        why = sorted(((header[i], _number(r[i])) for i in reasons if _number(r[i]) > 0), key=lambda kv: -kv[1])[:3]
        where = r[address] if address is not None else ""
        out.append(f"{100 * n / total:5.1f}% {100 * seen / total:5.1f}% {where:>8} {r[source].strip()[:70]:70} "
                   + ", ".join(f"{k.split('_')[-1] if '_' in k else k}={v:.0f}" for k, v in why))
    by_op, by_reason = Counter(), Counter()
    for r in rows:
        op = r[source].strip().split()
        op = [t for t in op if not t.startswith("@")]
        by_op[op[0].split(".")[0] if op else "?"] += _number(r[samples])
        for i in reasons:
            by_reason[header[i]] += _number(r[i])
    out.append("by opcode: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_op.most_common(14)))
    out.append("by reason: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_reason.most_common(10) if v))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    print(ledger(*read(args.csv), args.top))


if __name__ == "__main__":
    main()
