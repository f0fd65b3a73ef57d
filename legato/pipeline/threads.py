"""The host-thread settings an engine loop runs with, shared by the server (`LocalEngineClient`, in the server
process or a worker) and the offline API (`TTS.generate`, `legato synth`), so both degrade alike when the
machine is busy.

1. The loop runs on a thread of its own, never on the caller's. On the CPU, torch's intra-op threads
   (OpenMP, libgomp) spin-wait between parallel regions; libgomp cuts the spinning short only when its
   threads outnumber the cores, which two teams (the caller's, from loading the model, and the engine
   thread's) always do. With the loop on the caller's thread the one team spins at full count, and beside
   other busy processes the spinning takes the cores the work needs: on a 2-core box at load ~5 a 70-frame
   utterance took 58-73 s that way and 10-12 s on an engine thread (issue 20; the server took 16-20 s).
2. The GIL switch interval is shortened (`set_gil_switch_interval`): the engine thread releases the GIL
   while it waits for the device and must win it back from the event loop and the admission thread.
3. torch's intra-op thread count is left as torch sets it (a worker applies its `torch_threads` when given).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

# The engine thread releases the GIL while it waits for the GPU and must win it back from the event loop and
# the admission thread, which hold it for up to Python's switch interval (5 ms by default) at a time: at a
# ~12 ms step that wait is a large share of the GPU's idle gap. A shorter interval bounds it.
# $LEGATO_GIL_SWITCH_MS overrides it (0: leave the interpreter's own).
DEFAULT_GIL_SWITCH_MS = 1.0
ENGINE_THREAD_NAME = "engine"
_INTERRUPT_POLL_S = 0.1  # how late a Ctrl-C that races a wait may be noticed


def set_gil_switch_interval() -> None:
    """Applies $LEGATO_GIL_SWITCH_MS (or the default); raises ValueError naming it when it is not a number >= 0."""
    raw = os.environ.get("LEGATO_GIL_SWITCH_MS", str(DEFAULT_GIL_SWITCH_MS))
    try:
        ms = float(raw)
    except ValueError:
        ms = float("nan")
    if not ms >= 0 or ms == float("inf"):
        raise ValueError(f"LEGATO_GIL_SWITCH_MS must be a number of milliseconds >= 0 (0: Python's own), got {raw!r}")
    if ms > 0:
        sys.setswitchinterval(ms / 1000.0)


def name_native_thread(name: str | None = None) -> None:
    """Gives the calling thread its Python name (or `name`) at the OS level too (Linux: 15 characters), so `top -H`,
    py-spy's native view and the CPU census of the benchmarks (`legato.bench.cpu_census`) can tell the engine thread
    from the admission thread and the event loop. Python 3.12 leaves every thread named after the process."""
    name = (name or threading.current_thread().name)[:15]
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name)
    except OSError:  # not Linux, or /proc not writable: the name is only for observers
        pass


def raise_engine_thread_priority() -> None:
    """Applies $LEGATO_ENGINE_NICE (a nice value, e.g. -5) to the calling thread, so that on a busy host the
    scheduler runs the engine thread ahead of the event loops and bench clients beside it; unset: nothing. A
    value the process may not set (a negative one needs CAP_SYS_NICE) is logged and left."""
    raw = os.environ.get("LEGATO_ENGINE_NICE")
    if not raw:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), int(raw))
    except (ValueError, OSError, AttributeError) as e:
        logging.getLogger(__name__).warning("LEGATO_ENGINE_NICE=%s not applied: %s", raw, e)


def run_on_engine_thread(loop: Callable[[threading.Event], T]) -> T:
    """Runs `loop(stop)` on an engine thread with the server's settings and returns what it returns (or raises
    what it raises). The caller waits; if the wait is interrupted (Ctrl-C), `stop` is set so the loop can end
    early, and the interruption goes on. The GIL switch interval is the caller's again afterwards."""
    stop = threading.Event()
    outcome: dict[str, object] = {}

    def target() -> None:
        name_native_thread()
        try:
            outcome["result"] = loop(stop)
        except BaseException as e:  # handed to the caller's thread, which raises it
            outcome["error"] = e

    previous = sys.getswitchinterval()
    set_gil_switch_interval()
    thread = threading.Thread(target=target, name=ENGINE_THREAD_NAME, daemon=True)
    try:
        thread.start()
        # Joined in short waits: a Ctrl-C that lands just before a blocking wait starts is noticed only when
        # the wait returns (CPython runs signal handlers between bytecodes), so one long join could sit out the
        # whole loop. Seen in tests/test_engine_thread.py under CPU load, about one run in four.
        while thread.is_alive():
            thread.join(timeout=_INTERRUPT_POLL_S)
    except BaseException:
        stop.set()
        raise
    finally:
        sys.setswitchinterval(previous)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["result"]  # type: ignore[return-value]


def side_stream_thread(device: torch.device | str, name: str | None = None) -> None:
    """A thread initializer for work that never feeds the engine's stream (voice encodes, whose results go to the
    host): the thread gets its OS name and, on a CUDA device, a CUDA stream of its own as its current stream.

    Why: the engine queues its steps on the device's legacy default stream, one or two ahead. Work another thread
    queues there runs only after those steps, and its copy back to the host waits for them: on an H100 at 64
    streams the 8 new voices of a burst waited ~150 ms one after another (their own kernels take ~3 ms each). A
    stream of its own (PyTorch makes them non-blocking) runs beside the steps. It waits once, here, for what the
    default stream already holds, such as the weights' upload."""
    name_native_thread(name)
    device = torch.device(device)
    if device.type != "cuda":
        return
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.default_stream(device))
    torch.cuda.set_stream(stream)
