"""Soak: `legato bench soak` (the command operators run for ten minutes, `--duration 600`) for two minutes
against a real `legato serve` on the tiny model: mixed formats and modes, a fifth of the requests left
mid-stream by their client (seeded), two windows of 60 s compared.

Asserted: every response was 200 (whole), 429/503 (with a reason) or a deliberate disconnect; the engine
drains with no leaked KV block; the server's peak RSS in the last minute is within 20 % of the first's.

The latency p99 is printed but only loosely asserted (last < 3x first, a hang guard): on a shared 2-core CI
box the p99 of a minute is set by whatever else runs on the machine in that minute (other test processes,
the CI's own jobs), not by the server, so a 20 % bound would fail on noise. The printed ratio is the
figure; the operators' ten-minute run on a quiet machine is where a 20 % bound means something."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from serve_process import ServeProcess

pytestmark = pytest.mark.slow

DURATION_S = 120
DIRTY = ("Traceback", "Exception in ASGI application", "returned without completing")


def test_two_minute_soak_leaks_nothing_and_holds_its_memory(tmp_path):
    out = tmp_path / "soak.json"
    with ServeProcess(tmp_path, "--max-num-seqs", "4") as srv:
        cmd = [sys.executable, "-m", "legato.cli", "bench", "soak", "--url", srv.url, "--pid", str(srv.proc.pid),
               "--duration", str(DURATION_S), "--windows", "2", "--concurrency", "6", "--disconnect-rate", "0.2",
               "--min-frames", "6", "--max-frames", "16", "--seed", "1", "--out", str(out)]
        # hang guard: the load, then each request's deadline (120 s) and the drain (60 s), with room to spare
        done = subprocess.run(cmd, env=srv.env, capture_output=True, text=True, timeout=DURATION_S + 420)
        log = srv.log_text()
    print("\n" + done.stdout + done.stderr[-2000:])
    result = json.loads(out.read_text())
    totals, fl, drain = result["totals"], result["first_last"], result["drain"]

    assert totals["bad"] == 0 and totals["warmup_bad"] == 0, result["bad"]
    assert set(totals["by_status"]) <= {"200", "429", "503", "none"}, totals["by_status"]  # none: left first
    assert totals["ok"] > 0 and totals["disconnected"] > 0, totals
    assert result["aborted_during_run"].get("client disconnected", 0) > 0  # the server saw them leave
    assert drain["drained"] and drain["leaked_blocks"] == 0, drain
    assert drain["running"] == drain["waiting"] == 0 and drain["free_kv_blocks"] == drain["num_kv_blocks"]
    assert fl["rss_first_mb"] and fl["rss_last_mb"], fl
    assert 0.8 <= fl["rss_ratio"] <= 1.2, fl
    assert fl["p99_first_s"] and fl["p99_last_s"], fl
    assert fl["p99_last_s"] < 3 * fl["p99_first_s"], fl  # loose on purpose: see the module doc
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [d for d in DIRTY if d in log], log[-3000:]
