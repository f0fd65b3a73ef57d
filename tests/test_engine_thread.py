"""`run_on_engine_thread`, the offline API's engine loop runner: a result or an error comes back to the caller,
and an interrupted caller stops the loop instead of leaving it running."""

from __future__ import annotations

import _thread
import signal
import sys
import threading

import pytest

from legato.pipeline.threads import ENGINE_THREAD_NAME, run_on_engine_thread


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
