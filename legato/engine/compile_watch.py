"""Compiles after warm-up, logged: each one is a first use the warm-up missed.

A Triton kernel compiles once per specialisation (its constexprs, and each int argument that equals 1 or is a
multiple of 16), and a `torch.compile`d function again for a shape, stride or dtype its guards did not cover. The
engine's warm-up runs every path it knows of before the server says ready; what it missed compiles on the thread
that first needs it, mid-burst. With a warm on-disk cache that costs milliseconds. On a fresh machine it costs
seconds: a c=64 burst on an H100 once saw one request wait 3 s after its first chunk, with the engine thread's
inbox p99 at 2.1 s, while the second burst on the same server saw nothing of it (docs/benchmarks.md, session of
2026-12-07 (6)). Each warm-up runs inside `warming()`; once every warm-up of the process is done (a thread-worker
`split` warms its talker and codec up side by side), every compile is one WARNING line with its kernel, its
specialisation and how long the compiling thread was held, so the next run names what the warm-up should cover.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class CompileCounts:
    """Compiles seen since the watch was armed (this process): Triton kernels, and `torch.compile` graphs."""

    triton: int = 0
    dynamo: int = 0
    seconds: float = 0.0  # the compiling threads' time in them
    kernels: list[str] = field(default_factory=list)  # the Triton kernels' names, in order


class _Watch:
    def __init__(self) -> None:
        self.armed = False
        self.warming = 0  # warm-ups of this process under way
        self.counts = CompileCounts()
        self._lock = threading.Lock()
        self._started = threading.local()  # per thread: when its Triton compile (or dynamo frame) began
        self._installed = False

    def install(self) -> None:
        """Hooks into Triton and dynamo once per process (they run before and after each compile)."""
        if self._installed:
            return
        self._installed = True
        try:
            from triton import knobs

            before_cache, after_compile = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook

            def on_lookup(*args, **kwargs):  # about to compile: remember when (and let the compile happen)
                self._started.triton = time.perf_counter()
                return before_cache(*args, **kwargs) if before_cache else None

            def on_compiled(*args, **kwargs):
                spec = _specialisation(kwargs.get("compile")) or kwargs.get("repr", "")
                self._triton_compiled(kwargs.get("fn"), spec)
                return after_compile(*args, **kwargs) if after_compile else None

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = on_lookup, on_compiled
        except (ImportError, AttributeError):  # no Triton (the CPU build), or one without these hooks
            pass
        try:
            from torch._dynamo.callback import on_compile_end, on_compile_start

            # Callbacks take a CallbackArgs in recent torch releases and nothing in older ones.
            on_compile_start(lambda *args: setattr(self._started, "dynamo", time.perf_counter()))
            on_compile_end(lambda *args: self._dynamo_compiled(getattr(args[0], "compile_id", None) if args else None))
        except (ImportError, AttributeError):
            pass

    def _held(self, key: str) -> float:
        started = getattr(self._started, key, None)
        return 0.0 if started is None else time.perf_counter() - started

    def _triton_compiled(self, fn, spec: str) -> None:
        if not self.armed:
            return
        held = self._held("triton")
        name = getattr(fn, "name", None) or spec.split("[", 1)[0]
        with self._lock:
            self.counts.triton += 1
            self.counts.seconds += held
            self.counts.kernels.append(name)
        log.warning("Triton kernel %s compiled after warm-up (%.0f ms on thread %s; a first use the warm-up "
                    "missed): %s", name, 1000 * held, threading.current_thread().name, spec)

    def _dynamo_compiled(self, compile_id) -> None:
        if not self.armed:
            return
        held = self._held("dynamo")
        with self._lock:
            self.counts.dynamo += 1
            self.counts.seconds += held
        log.warning("torch.compile compiled graph %s after warm-up (%.0f ms on thread %s; a first use the warm-up "
                    "missed; TORCH_LOGS=recompiles gives the guard that failed)", compile_id, 1000 * held,
                    threading.current_thread().name)


def _specialisation(compile_args: dict | None) -> str:
    """What set this compile apart, from Triton's compile arguments: the arguments taken as 16-byte aligned (or
    divisible by 16), and the constants (constexprs, and ints specialised to 1). Empty where they are missing."""
    try:
        names = list(compile_args["signature"])
        attrs = compile_args["configs"][0]
        aligned = [names[k[0]] for k in attrs if k and k[0] < len(names)]
        constants = {names[k[0]]: v for k, v in compile_args["constants"].items() if k and k[0] < len(names)}
        return f"aligned or divisible by 16: {', '.join(aligned) or 'none'}; constants: {constants}"[:800]
    except (KeyError, IndexError, TypeError, AttributeError):
        return ""


_WATCH = _Watch()


@contextmanager
def warming() -> Iterator[None]:
    """Around a warm-up: its compiles are expected. When the last warm-up under way in this process ends, every
    later compile is logged."""
    with _WATCH._lock:
        _WATCH.warming += 1
        _WATCH.armed = False
    try:
        yield
    finally:
        _WATCH.install()
        with _WATCH._lock:
            _WATCH.warming -= 1
            _WATCH.armed = _WATCH.warming == 0


def counts() -> CompileCounts:
    """A copy of what the watch has seen since it was armed."""
    c = _WATCH.counts
    with _WATCH._lock:
        return CompileCounts(c.triton, c.dynamo, c.seconds, list(c.kernels))
