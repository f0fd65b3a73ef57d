"""The serving process's heap after warm-up: frozen out of the collector's passes (unless LEGATO_GC_FREEZE=0), and a
collection that pauses the process long enough to show in a stream is logged."""

from __future__ import annotations

import gc
import logging

from legato.pipeline import heap


def test_freeze_heap_moves_what_is_alive_out_of_the_collector_s_passes(monkeypatch):
    monkeypatch.delenv("LEGATO_GC_FREEZE", raising=False)
    kept = [[i] for i in range(1000)]  # alive: frozen
    try:
        frozen = heap.freeze_heap()
        assert frozen == gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()
        heap.unwatch_pauses()  # freezing watches pauses too; later tests' logs stay free of them
    assert gc.get_freeze_count() == 0


def test_the_freeze_s_own_full_collection_is_not_logged_as_a_pause(monkeypatch, caplog):
    """It runs before the process serves (a GPU run logged it at 120-300 ms as if a stream had stalled); the passes
    after it are watched."""
    monkeypatch.delenv("LEGATO_GC_FREEZE", raising=False)
    monkeypatch.setattr(heap, "PAUSE_WARNING_S", 0.0)  # every pass counts as long
    try:
        with caplog.at_level(logging.WARNING, logger="legato.pipeline.heap"):
            heap.freeze_heap()
            assert not caplog.records
            gc.collect(2)
        assert len(caplog.records) == 1 and "paused the process" in caplog.records[0].getMessage()
    finally:
        gc.unfreeze()
        heap.unwatch_pauses()


def test_freezing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("LEGATO_GC_FREEZE", "0")
    try:
        assert heap.freeze_heap() == 0 and gc.get_freeze_count() == 0
    finally:
        heap.unwatch_pauses()


def test_a_long_collection_pause_is_logged_with_its_generation(monkeypatch, caplog):
    heap.watch_pauses()
    heap.watch_pauses()  # once per process, however often called
    try:
        assert gc.callbacks.count(heap._on_collection) == 1
        monkeypatch.setattr(heap, "PAUSE_WARNING_S", 0.0)  # every pass counts as long
        with caplog.at_level(logging.WARNING, logger="legato.pipeline.heap"):
            gc.collect(2)
        assert any("garbage collection paused the process" in r.getMessage() and "generation 2" in r.getMessage()
                   for r in caplog.records)
        caplog.clear()
        monkeypatch.setattr(heap, "PAUSE_WARNING_S", 3600.0)
        with caplog.at_level(logging.WARNING, logger="legato.pipeline.heap"):
            gc.collect(2)
        assert not caplog.records  # a short pause says nothing
    finally:
        heap.unwatch_pauses()  # later tests' logs stay free of this process's pauses
    assert heap._on_collection not in gc.callbacks


def test_a_server_that_serves_from_a_gpu_freezes_its_heap_once_started():
    """`legato serve` on a GPU sets `freeze_heap`: the app freezes the heap after its engine client started (here a
    stand-in client; the CPU default leaves the heap alone)."""
    from fastapi.testclient import TestClient
    from server_helpers import FakeClient, frames_chunk, server_settings

    from legato.server.app import build_app

    for freeze in (False, True):
        settings = server_settings()
        settings.freeze_heap = freeze
        app = build_app(FakeClient(lambda req: [frames_chunk(2, 2, True, "stop")]), settings, None)
        try:
            with TestClient(app) as c:
                assert c.get("/health").status_code == 200
                assert (gc.get_freeze_count() > 0) == freeze
        finally:
            gc.unfreeze()
            heap.unwatch_pauses()


def test_a_bad_gc_freeze_setting_is_refused_in_one_line_before_the_server_loads(monkeypatch, tmp_path):
    import os
    import subprocess
    import sys

    import pytest

    for good, want in (("1", True), (" 0 ", False)):
        monkeypatch.setenv("LEGATO_GC_FREEZE", good)
        assert heap.freeze_enabled() is want
    monkeypatch.setenv("LEGATO_GC_FREEZE", "off")
    with pytest.raises(ValueError, match="LEGATO_GC_FREEZE must be 1"):
        heap.freeze_heap()
    heap.unwatch_pauses()
    assert gc.get_freeze_count() == 0
    proc = subprocess.run([sys.executable, "-m", "legato.cli", "serve", "--host", "127.0.0.1", "--port", "0"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LEGATO_GC_FREEZE": "off", "LEGATO_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("legato serve: error: LEGATO_GC_FREEZE must be 1 (freeze the heap "
                                                    "after warm-up) or 0, got 'off'")
    assert "Traceback" not in proc.stderr and not (tmp_path / "cache").exists()
