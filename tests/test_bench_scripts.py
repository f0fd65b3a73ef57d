"""Helpers of the GPU benchmark scripts in benchmarks/ that read their runs' output (a server log, a py-spy
profile): they run on the CPU, so a script that reads them wrong fails here, not in a scarce device call."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import frame_tiles  # noqa: E402
import pyspy_summary  # noqa: E402
import serving_speed  # noqa: E402


def test_server_stages_reads_the_logged_stage_times_after_the_offset(tmp_path):
    log = tmp_path / "server.log"
    old = "x speech done status=200 ttfp_s=9.0 prepare_s=9.0 inbox_s=9.0 engine_s=9.0\n"
    new = "".join(f"x speech done status=200 ttfp_s=0.5 prepare_s={p} inbox_s=0.001 engine_s=0.04\n"
                  for p in (0.1, 0.2, 0.3))
    log.write_text(old + new)
    stages = serving_speed.server_stages(log, len(old))
    assert stages["prepare"]["p50_ms"] == 200.0 and stages["prepare"]["p99_ms"] == 300.0
    assert stages["inbox"]["p50_ms"] == 1.0 and stages["engine"]["p50_ms"] == 40.0
    assert abs(stages["front"]["p50_ms"] - 259.0) < 1e-6 and abs(stages["front"]["p99_ms"] - 359.0) < 1e-6
    assert serving_speed.server_stages(log, log.stat().st_size)["engine"] == {"p50_ms": None, "p99_ms": None}
    assert stages["hops"]["p50_ms"] is None  # no front stamps in these lines


def test_server_stages_splits_the_front_by_its_own_stamps(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("".join(f"x speech done ttfp_s=0.5 prepare_s=0.1 inbox_s=0.01 engine_s=0.04 front_in_s={i} "
                           f"reply_s={r}\n" for i, r in ((0.05, 0.4), (0.1, 0.35), (0.2, 0.25))))
    stages = serving_speed.server_stages(log, 0)
    assert abs(stages["front_in"]["p50_ms"] - 100.0) < 1e-6
    assert abs(stages["hops"]["p50_ms"] - 200.0) < 1e-6 and abs(stages["hops"]["p99_ms"] - 250.0) < 1e-6
    assert stages["link"]["p50_ms"] is None  # no worker stamp in these lines


def test_server_stages_splits_the_hops_by_the_worker_s_stamp(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("".join(f"x speech done ttfp_s=0.5 prepare_s=0.1 inbox_s=0.01 engine_s=0.04 front_in_s=0.05 "
                           f"reply_s={r} worker_s={w}\n" for r, w in ((0.4, 0.2), (0.35, 0.16), (0.25, 0.17))))
    stages = serving_speed.server_stages(log, 0)
    # worker less prepare+inbox+engine (0.15): 50, 10, 20 ms; reply less worker: 200, 190, 80 ms
    assert abs(stages["in_worker"]["p50_ms"] - 20.0) < 1e-6 and abs(stages["in_worker"]["p99_ms"] - 50.0) < 1e-6
    assert abs(stages["link"]["p50_ms"] - 190.0) < 1e-6 and abs(stages["link"]["p99_ms"] - 200.0) < 1e-6


def test_server_stages_takes_split_s_codec_stage_out_of_the_hops(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("".join(f"x speech done ttfp_s=0.5 prepare_s=0.1 inbox_s=0.01 engine_s=0.04 front_in_s=0.05 "
                           f"reply_s=0.4 worker_s=0.2 codec_s={c} codec_worker_s={w}\n"
                           for c, w in ((0.1, 0.06), (0.12, 0.1), (0.2, 0.11))))
    stages = serving_speed.server_stages(log, 0)
    assert abs(stages["codec"]["p50_ms"] - 120.0) < 1e-6 and abs(stages["codec_worker"]["p99_ms"] - 110.0) < 1e-6
    # the talker's stages (0.15) and codec leave the hops: 150, 130, 50 ms; codec less codec_worker: 40, 20, 90 ms
    assert abs(stages["hops"]["p50_ms"] - 130.0) < 1e-6 and abs(stages["codec_link"]["p99_ms"] - 90.0) < 1e-6
    # the worker's stage is the talker's: less its stages only (50 ms); the link leaves codec out (200 - codec)
    assert abs(stages["in_worker"]["p50_ms"] - 50.0) < 1e-6 and abs(stages["link"]["p50_ms"] - 80.0) < 1e-6


def test_pyspy_summary_counts_samples_by_thread_and_functions_once_per_sample(tmp_path):
    raw = tmp_path / "profile.txt"
    raw.write_text(
        'process 7:"python -m legato.cli serve";thread (8): engine;run (legato/pipeline/local.py:1);'
        "step (legato/engine/engine.py:2);step (legato/engine/engine.py:3) 5\n"
        'process 7:"python -m legato.cli serve";thread (9): admission_0;build (legato/models/prompt.py:4) 2\n'
        "not a stack line\n")
    text = pyspy_summary.summarise(str(raw), threads=2, top=5)
    assert "7 samples" in text
    engine = text.index("engine (")
    assert "5  step" in text[engine:] and "5  run" in text[engine:]  # recursion counted once per sample
    assert "2  build" in text[text.index("admission_0 ("):]
    assert "innermost frames" in text and "5  step (engine.py)" in text


def test_pyspy_summary_reads_native_frames_as_innermost(tmp_path):
    raw = tmp_path / "profile.txt"
    raw.write_text('process 7:"python -m legato.pipeline.worker";thread (8): engine;'
                   "step (legato/engine/engine.py:2);cuLaunchKernel (libcuda.so.1);"
                   "pthread_mutex_lock (libc.so.6) 3\n")
    text = pyspy_summary.summarise(str(raw), threads=1, top=5)
    assert "3  step" in text and "3  pthread_mutex_lock (libc.so.6)" in text


def test_admission_burst_runs_a_burst_through_the_client_and_reports_its_stages(tmp_path):
    """benchmarks/admission_burst.py end to end on the tests' tiny model: every request of the burst streams, each
    reports its prepare stage, and the process exits cleanly (its threads stopped)."""
    import json
    import subprocess

    out = tmp_path / "burst.json"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "admission_burst.py"
    done = subprocess.run([sys.executable, str(script), "--size", "tiny", "--device", "cpu", "--burst", "6",
                           "--background", "1", "--frames", "2", "--background-frames", "400", "--rounds", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rounds"]
    assert row["burst"] == 6 and row["failed"] == 0
    assert row["prepare_p50_ms"] is not None and row["prepare_p50_ms"] <= row["ttfp_p50_ms"]


def test_metrics_poller_reads_the_engine_counters_and_gives_the_steady_rates():
    """serving_speed.py's poller against a stand-in /metrics whose counters rise by one step of 100 rows a read."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    reads = {"n": 0}

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            n = reads["n"] = reads["n"] + 1
            body = (f"legato_engine_steps_total {n}.0\nlegato_engine_decode_rows_total {100 * n}.0\n"
                    f"legato_engine_step_gpu_seconds_total {0.008 * n}\nlegato_engine_step_gap_seconds_total "
                    f"{0.002 * n}\nlegato_engine_step_host_seconds_total {0.006 * n}\n"
                    f"legato_engine_loop_other_seconds_total {0.001 * n}\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    poller = serving_speed.MetricsPoller(f"http://127.0.0.1:{server.server_address[1]}", every=0.005)
    try:
        poller.start()
        deadline = time.monotonic() + 30
        while len(poller.samples) < 12 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        poller.stop.set()
        poller.join(10)
        server.shutdown()
        server.server_close()
    assert len(poller.samples) >= 12
    st = poller.steady()
    assert abs(st["rows_per_step"] - 100.0) < 1e-9 and abs(st["gpu_busy"] - 0.8) < 1e-9
    assert st["decode_rows_per_s"] > 0 and "-" != serving_speed.steady_cols(st)
    assert serving_speed.steady_cols(None) == "-"
    # The engine thread's time per step, and the CPU census of this process's threads over the same window.
    assert abs(st["host_ms_per_step"] - 6.0) < 1e-6 and abs(st["loop_other_ms_per_step"] - 1.0) < 1e-6
    assert st["cpu_count"] == os.cpu_count() and isinstance(st["cpu"], dict)
    assert serving_speed.cpu_line(st).startswith("host ") and serving_speed.cpu_line(None) == "-"


def test_the_paced_stand_in_serves_through_the_local_client(tiny_checkpoint, monkeypatch):
    """paced_serve.py's engine stand-in (the CPU proxy of the served host path) against today's LocalEngineClient,
    and split's two stand-ins (a talker-only engine sending codes every step, a codec decoding nothing) against
    today's SplitClient: a client change that reads something a stand-in lacks fails here, not at the next CPU
    profile."""
    import asyncio

    import numpy as np
    import paced_serve
    import torch

    import legato.pipeline.codec_worker as codec_worker
    import legato.pipeline.local as local
    from legato.engine.config import EngineConfig
    from legato.models.qwen3_tts.inputs import SpeechInput
    from legato.models.qwen3_tts.loader import load_model
    from legato.models.qwen3_tts.sampling import SamplingParams
    from legato.pipeline.client import SynthesisRequest
    from legato.pipeline.split import build_split_client

    # install() replaces both: put them back after the test (the tests after it build real engines and codecs)
    monkeypatch.setattr(local, "Engine", local.Engine)
    monkeypatch.setattr(codec_worker, "CodecEngine", codec_worker.CodecEngine)
    monkeypatch.setattr(paced_serve.PacedEngine, "step_s", paced_serve.PacedEngine.step_s)
    monkeypatch.setattr(paced_serve.PacedEngine, "host_ops", paced_serve.PacedEngine.host_ops)
    paced_serve.install(step_ms=1.0, real_prompts=False, host_ops=3)
    loaded = load_model(tiny_checkpoint)
    inp = SpeechInput("Hello there.", language="english", speaker_embedding=torch.zeros(64), x_vector_only=True)

    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, first_chunk_frames=1, chunk_frames=3)

    async def main(client):
        await client.start()
        try:
            req = SynthesisRequest("p", inp, SamplingParams(seed=1), max_frames=7, ignore_eos=True)
            return [c async for c in client.generate(req)], client.stats()
        finally:
            await client.stop()

    for client in (local.LocalEngineClient(loaded, config), build_split_client(lambda device: loaded, config)):
        chunks, stats = asyncio.run(main(client))
        assert chunks[-1].finished and chunks[-1].num_frames == 7
        assert np.concatenate([c.audio for c in chunks]).shape == (7 * 1920,)
        assert stats.decode_rows == 7 and stats.steps >= 7
    assert isinstance(client.codec.engine, paced_serve.PacedCodec) and client.codec.stats().frames_decoded == 7


def test_pyspy_command_and_a_delayed_profile(tmp_path):
    import argparse
    import sys as _sys

    args = argparse.Namespace(profile_seconds=4, profile_native=True, profile_gil=False, profile_idle=True)
    cmd = serving_speed.pyspy_command(args, 123, tmp_path / "p.txt")
    assert "--native" in cmd and "--idle" in cmd and "--nonblocking" not in cmd  # native needs the pauses
    args.profile_native = False
    assert "--nonblocking" in serving_speed.pyspy_command(args, 123, tmp_path / "p.txt")
    marker = tmp_path / "started"
    late = serving_speed.DelayedProfile([_sys.executable, "-c", f"open({str(marker)!r}, 'w')"], 0.05)
    late.wait(30)
    assert marker.exists()
    never = serving_speed.DelayedProfile([_sys.executable, "-c", "raise SystemExit(3)"], 3600)
    never.wait(0.01)  # the cell ended first: the profiler never starts
    assert never.proc is None


def test_frame_tiles_variants_replace_one_row_entries_the_tile_table_has(tmp_path):
    """benchmarks/frame_tiles.py: each variant file is one the few-row GEMM's table loader reads, and names only
    one-row entries of weights the table already has (a mistyped shape would add an entry no frame reads)."""
    from legato.layers import small_matmul

    for size in frame_tiles.VARIANTS:
        paths = frame_tiles.write(tmp_path / size, size)
        assert len(paths) == len(frame_tiles.VARIANTS[size])
        for path in paths:
            entries = small_matmul._load_table(str(path))
            assert entries and all(key in small_matmul.TABLE and key[0] == 1 for key in entries), path.name
            assert all(t is not None and t != small_matmul.TABLE[key] for key, t in entries.items()), path.name


def test_codec_worker_hop_moves_every_stream_s_frames_through_the_worker(tmp_path):
    """benchmarks/codec_worker_hop.py against this tree: every frame of every stream comes back as a chunk, and the
    figures it reports are there."""
    import json
    import subprocess

    out = tmp_path / "hop.json"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "codec_worker_hop.py"
    done = subprocess.run([sys.executable, str(script), "--streams", "6", "--steps", "12", "--step-ms", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.read_text())
    assert row["frames"] == 6 * 12 and row["cpu_ms_per_step"] > 0
    assert 0 < row["hop_ms_p50"] <= row["hop_ms_p99"] <= row["hop_ms_max"]
