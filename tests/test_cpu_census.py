"""The CPU census the served benchmarks take of the server's and the client's threads (`legato.bench.cpu_census`)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from legato.bench.cpu_census import busiest, census, process_tree, role_of, thread_group
from legato.pipeline.threads import name_native_thread

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")


def test_roles_come_from_the_command_line():
    assert role_of("/usr/bin/python3 -P -m legato.pipeline.worker {...}") == "worker"
    assert role_of("python3 -m legato.server.fronts") == "front"
    assert role_of("python3 -m legato.cli bench serve --base-url http://127.0.0.1:1") == "client"
    assert role_of("python3 -m legato.cli serve --model x") == "server"
    assert role_of("python3 benchmarks/serving_speed.py --ckpt x") == "serving_speed.py"
    assert role_of("") == "?"


def test_a_pool_is_one_group_and_a_process_s_first_thread_is_main():
    assert thread_group("worker", 10, 10, "python3\n") == "worker/main"
    assert thread_group("front", 10, 11, "uvloop_12\n") == "front/uvloop"
    assert thread_group("server", 10, 12, "worker-io-1779-\n") == "server/worker-io"
    assert thread_group("worker", 10, 13, "engine\n") == "worker/engine"


def test_busiest_orders_groups_and_drops_the_idle_and_the_host_total():
    rates = {"cpu:a/x": 0.5, "runq:a/x": 0.1, "cpu:b/y": 0.9, "cpu:c/z": 0.001, "cpu:host": 3.0}
    assert list(busiest(rates)) == ["b/y", "a/x"]
    assert busiest(rates)["a/x"] == {"cpu": 0.5, "runq": 0.1} and busiest(rates)["b/y"]["runq"] == 0.0
    assert list(busiest(rates, top=1)) == ["b/y"]


@linux_only
def test_a_named_busy_thread_is_counted_under_its_name():
    stop = threading.Event()

    def spin():
        name_native_thread("censusspin-7")
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        before = census()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the spinning thread has run 50 ms more than at the first read
            now = census()
            key = next((k for k in now if k.startswith("cpu:") and k.endswith("/censusspin")), None)
            if key is not None and now[key] - before.get(key, 0.0) > 0.05:
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"no CPU counted for the named thread: {sorted(now)}")
        assert now[key.replace("cpu:", "runq:", 1)] >= 0.0
        assert now["cpu:host"] >= before["cpu:host"]
    finally:
        stop.set()
        t.join(10)


@linux_only
def test_the_tree_holds_this_process_and_a_child():
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 30
        while child.pid not in process_tree() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert child.pid in process_tree()
    finally:
        child.kill()
        child.wait()


@linux_only
def test_the_tree_by_parents_finds_the_same_child():
    """The fallback for kernels without /proc/<pid>/task/<tid>/children."""
    import subprocess

    from legato.bench.cpu_census import _tree_by_parents

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        import os

        assert child.pid in _tree_by_parents(os.getpid()) and os.getpid() in _tree_by_parents(os.getpid())
    finally:
        child.kill()
        child.wait()
