"""`run_on_engine_thread`, the offline API's engine loop runner: a result or an error comes back to the caller,
and an interrupted caller stops the loop instead of leaving it running."""

from __future__ import annotations

import _thread
import signal
import sys
import threading

import pytest

from legato.pipeline.threads import (
    ENGINE_THREAD_NAME,
    name_native_thread,
    raise_engine_thread_priority,
    run_on_engine_thread,
    side_stream_thread,
)


def test_the_loop_runs_on_an_engine_thread_and_its_result_comes_back(monkeypatch):
    monkeypatch.setenv("LEGATO_GIL_SWITCH_MS", "2")
    before = sys.getswitchinterval()
    where = run_on_engine_thread(lambda stop: (threading.current_thread().name, sys.getswitchinterval()))
    assert where == (ENGINE_THREAD_NAME, 0.002) and sys.getswitchinterval() == before


def test_an_error_of_the_loop_is_raised_in_the_caller():
    def loop(stop):
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        run_on_engine_thread(loop)


def test_an_interrupted_caller_stops_the_loop():
    """A Ctrl-C reaching the waiting caller (the main thread) once the loop runs makes the loop see `stop` and
    end, so nothing keeps stepping behind the KeyboardInterrupt. Events, not sleeps, order it.

    The interrupt is raised the way Python delivers a SIGINT to its main thread (`_thread.interrupt_main`: the
    signal is marked pending and the handler runs at the next bytecode), with Python's default handler in place
    for the test: a kernel-sent SIGINT (`pthread_kill`) also depends on the main thread's signal mask and on
    which handler earlier code in this process left, which made the test fail in the full suite only."""
    running, ended = threading.Event(), threading.Event()
    saw_stop: list[bool] = []

    def loop(stop):
        running.set()
        saw_stop.append(stop.wait(timeout=30.0))  # bounded: a broken runner must not hang the suite
        ended.set()

    def interrupt():
        if running.wait(timeout=30.0):
            _thread.interrupt_main(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            run_on_engine_thread(loop)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ended.wait(timeout=30.0), "the loop did not end after the interrupt"
    assert saw_stop == [True], "the loop ended without seeing stop"


def _on_a_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.update(result=fn()), name="probe-thread")
    t.start()
    t.join(30)
    return out["result"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="native thread names and priorities: Linux")
def test_the_engine_thread_has_its_name_at_the_os_level_too():
    def named():
        name_native_thread()
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            return f.read().strip()

    assert _on_a_thread(named) == "probe-thread"
    assert run_on_engine_thread(lambda stop: open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip()
                                ) == ENGINE_THREAD_NAME


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="native thread names: Linux")
def test_a_side_stream_thread_on_the_cpu_is_only_named():
    """The voice encoder's initializer on a CPU engine: the OS name, and no CUDA call (this box has no GPU; the
    stream part is tested in test_gpu.py)."""
    def initialised():
        side_stream_thread("cpu")
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            return f.read().strip()

    assert _on_a_thread(initialised) == "probe-thread"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values: Linux")
def test_legato_engine_nice_sets_the_calling_thread_s_priority_only(monkeypatch, caplog):
    import os

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    wanted = min(base + 3, 19)  # lowering the priority needs no privilege
    monkeypatch.setenv("LEGATO_ENGINE_NICE", str(wanted))

    def applied():
        raise_engine_thread_priority()
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    assert _on_a_thread(applied) == wanted
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the caller's thread keeps its own
    monkeypatch.setenv("LEGATO_ENGINE_NICE", "fast")
    with caplog.at_level("WARNING"):
        assert _on_a_thread(applied) == base  # a bad value is logged, not raised
    assert "LEGATO_ENGINE_NICE=fast not applied" in caplog.text
