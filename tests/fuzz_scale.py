"""How many examples each property-based fuzz test draws, and a tally of the cases actually run.

`LEGATO_FUZZ_EXAMPLES` sets the per-test example count: unset, it is the CI share (`CI_EXAMPLES`); the
reliability issue's full run sets it high enough for >= 2,000 cases over every endpoint. Hypothesis may stop
a test early once its space is exhausted (a route with no parameters), so the tally, printed at exit, is
the count to report, not examples x tests."""

from __future__ import annotations

import atexit
import collections
import os
import sys

CI_EXAMPLES = 60
CASES: collections.Counter[str] = collections.Counter()


def fuzz_examples() -> int:
    """The per-test example count: `LEGATO_FUZZ_EXAMPLES` if set (>= 1), else the CI share."""
    raw = os.environ.get("LEGATO_FUZZ_EXAMPLES", "").strip()
    return max(1, int(raw)) if raw else CI_EXAMPLES


def count_case(label: str) -> None:
    CASES[label] += 1


@atexit.register
def _report() -> None:
    if CASES:
        lines = [f"  {n:6d}  {label}" for label, n in sorted(CASES.items())]
        print(f"fuzz cases run: {sum(CASES.values())} (per-test examples {fuzz_examples()})", *lines,
              sep="\n", file=sys.stderr)
