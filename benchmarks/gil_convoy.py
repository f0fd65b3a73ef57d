"""What another Python thread's work costs an engine-like thread that releases the GIL at every op (as the engine
does at every torch call): the median time of a "step" of N small torch ops alone, then beside a thread that runs
Python in bursts of B ms every P ms, at the interpreter's GIL switch interval (ms, the first argument).

    python3 benchmarks/gil_convoy.py 1.0        # legato's engine thread runs at 1 ms (pipeline/threads.py)
"""

from __future__ import annotations

import sys
import threading
import time

import torch

BURSTS = ((0.2, 2.0), (0.5, 2.0), (1.0, 4.0), (0.05, 0.5), (0.02, 0.2))  # (burst ms, pause ms)


def step_ms(ops: int = 2000, steps: int = 200) -> float:
    """The median time of `steps` steps of `ops` GIL-releasing torch ops on 16 floats."""
    a, b, out = torch.ones(16), torch.ones(16), torch.empty(16)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        for _ in range(ops):
            torch.add(a, b, out=out)
        times.append(time.perf_counter() - t)
    times.sort()
    return 1000 * times[len(times) // 2]


def python_bursts(stop: threading.Event, burst_ms: float, pause_ms: float) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < burst_ms / 1000:
            sum(range(200))
        time.sleep(pause_ms / 1000)


def main() -> None:
    torch.set_num_threads(1)
    switch_ms = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    sys.setswitchinterval(switch_ms / 1000)
    alone = step_ms()
    print(f"switch interval {switch_ms} ms; step alone {alone:.2f} ms")
    for burst, pause in BURSTS:
        stop = threading.Event()
        other = threading.Thread(target=python_bursts, args=(stop, burst, pause))
        other.start()
        beside = step_ms()
        stop.set()
        other.join()
        print(f"beside {burst} ms bursts every {pause} ms (duty {burst / (burst + pause):.2f}): {beside:.2f} ms "
              f"({beside / alone:.2f}x)")


if __name__ == "__main__":
    main()
