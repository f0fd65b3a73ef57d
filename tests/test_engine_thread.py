"""`run_on_engine_thread`, the offline API's engine loop runner: a result or an error comes back to the caller,
and an interrupted caller stops the loop instead of leaving it running."""

from __future__ import annotations

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
    """SIGINT reaches the waiting caller (the main thread) once the loop runs; the loop then sees `stop` and
    ends, so nothing keeps stepping behind the KeyboardInterrupt. Events, not sleeps, order it."""
    running, ended = threading.Event(), threading.Event()
    saw_stop: list[bool] = []

    def loop(stop):
        running.set()
        saw_stop.append(stop.wait(timeout=30.0))  # bounded: a broken runner must not hang the suite
        ended.set()

    def interrupt():
        if running.wait(timeout=30.0):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run_on_engine_thread(loop)
    assert ended.wait(timeout=30.0) and saw_stop == [True]
