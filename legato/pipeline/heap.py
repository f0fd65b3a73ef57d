"""The Python heap of a process that serves from a GPU: frozen out of the collector once its warm-up is done, and
every long collection pause logged.

CPython's cyclic collector stops the whole process, every thread, while it walks the objects of the generations it
collects, and a full (generation 2) pass walks all of them. After a model load, `torch.compile` and Triton's
compiles that is a large, never-freed heap, and serving engines have measured full passes of 100-300 ms at a time
(sglang #9241: stalls of that size every 1.5 s; vllm #14902, #24008 and ROCm/ATOM #1991, which found the passes
reclaiming nothing). A stream waits that long for its next chunk. `freeze_heap` moves everything alive after the
warm-up to the collector's permanent generation (`gc.freeze`), so later passes walk only what serving allocates;
objects of the frozen heap are still freed by reference counting, and only cycles among them are never collected.
`LEGATO_GC_FREEZE=0` keeps the collector as it is. `watch_pauses` logs each collection that held the process
`PAUSE_WARNING_S` or more, as one WARNING with its generation, so a stall in a run can be told from one.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time

log = logging.getLogger(__name__)

PAUSE_WARNING_S = 0.02  # a pause this long shows in a stream's chunk timing at 64 streams
_state = threading.local()  # when the collection under way began (the collecting thread's)
_watching = False


def freeze_heap() -> int:
    """Collects once, then freezes what is left (unless $LEGATO_GC_FREEZE is 0), and either way watches the
    collector's pauses from then on (`watch_pauses`). Returns the objects frozen. Its own full collection (120-300 ms
    after a GPU warm-up) is not one of the pauses logged: it comes before the process serves."""
    if not freeze_enabled():
        watch_pauses()
        return 0
    gc.collect()
    gc.freeze()
    watch_pauses()
    frozen = gc.get_freeze_count()
    log.info("froze %d objects of the heap out of the garbage collector's passes (LEGATO_GC_FREEZE=0 keeps them in)",
             frozen)
    return frozen


def freeze_enabled() -> bool:
    """$LEGATO_GC_FREEZE: 1 (the default) or 0; anything else raises ValueError naming it (`legato serve` checks it
    before it loads anything, not after a warm-up)."""
    raw = os.environ.get("LEGATO_GC_FREEZE", "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"LEGATO_GC_FREEZE must be 1 (freeze the heap after warm-up) or 0, got {raw!r}")
    return raw == "1"


def watch_pauses() -> None:
    """Logs, from now on in this process, every collection that paused it for PAUSE_WARNING_S or more."""
    global _watching
    if not _watching:
        _watching = True
        gc.callbacks.append(_on_collection)


def unwatch_pauses() -> None:
    global _watching
    if _watching:
        _watching = False
        gc.callbacks.remove(_on_collection)


def _on_collection(phase: str, info: dict) -> None:
    if phase == "start":
        _state.started = time.perf_counter()
        return
    started = getattr(_state, "started", None)
    if started is None:
        return
    paused = time.perf_counter() - started
    _state.started = None
    if paused >= PAUSE_WARNING_S:
        log.warning("garbage collection paused the process %.0f ms (generation %s, %s objects collected, %d frozen)",
                    1000 * paused, info.get("generation"), info.get("collected"), gc.get_freeze_count())
