"""The topology sweep: fairness rules, server lifecycle, outputs (fake server), and one real end-to-end sweep."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import soundfile as sf
from bench_fake_server import FRAME_SAMPLES
from bench_helpers import write_prompt_dir

from legato.bench.sweep import (
    ServerProcess,
    SweepConfig,
    SweepError,
    fairness_problems,
    gpu_count,
    plan,
    with_controls,
)
from legato.cli import main

FAKE_SERVER = [sys.executable, str(Path(__file__).parent / "bench_fake_server.py")]
PNGS = ("throughput_vs_concurrency.png", "ttfp_vs_concurrency.png", "goodput_per_gpu.png")


def test_gpu_counts_and_the_replicas_control_is_added():
    assert gpu_count("single") == 1 and gpu_count("replicas:4") == 4
    assert gpu_count("1p1d", {"1p1d": 2}) == 2
    with pytest.raises(SweepError, match="--gpus 1p1d=N"):
        gpu_count("1p1d")
    assert with_controls(["1p1d"], {"1p1d": 2}) == ["replicas:2", "1p1d"]
    assert with_controls(["replicas:2", "1p1d"], {"1p1d": 2}) == ["replicas:2", "1p1d"]
    assert with_controls(["single"]) == ["single"]


def _base(**request) -> dict:
    return {"client": {"max_concurrency": 4, "request_rate": float("inf")},
            "dataset": {"path": "/x/en/meta.lst", "num_prompts": 8, "seed": 0},
            "request": {"mode": "voice", "max_new_tokens": None, "fixed_length": None, **request}}


def test_fairness_rules():
    a = {**_base(), "num_gpus": 2, "max_num_seqs": 4}
    assert fairness_problems({"a": a, "b": dict(a)}) == ([], [])
    problems, _ = fairness_problems({"a": a, "b": {**a, "num_gpus": 1}})
    assert problems == ["num_gpus differs: a=2, b=1"]
    problems, _ = fairness_problems({"a": a, "b": {**a, "max_num_seqs": 8}})
    assert problems == ["max_num_seqs differs: a=4, b=8"]
    fixed = {"frames_per_char": 0.5, "min_frames": 4, "max_frames": 12}
    problems, _ = fairness_problems({"a": a, "b": {**a, **_base(fixed_length=fixed), "num_gpus": 2,
                                                   "max_num_seqs": 4}})
    assert problems and problems[0].startswith("fixed_length differs")
    problems, warnings = fairness_problems({"a": a, "b": {**a, "max_num_seqs": None}})
    assert problems == [] and warnings[0].startswith("max_num_seqs unknown")


def test_plan_refuses_unfair_sweeps_unless_allowed(tmp_path):
    base = _base()
    cfg = SweepConfig(["single", "replicas:2"], [1], tmp_path, server_args=["--max-num-seqs", "4"])
    with pytest.raises(SweepError, match="num_gpus differs"):
        plan(cfg, base)
    cfg.allow_unfair = True
    topologies, notes = plan(cfg, base)
    assert topologies == ["single", "replicas:2"] and "UNFAIR" in notes[0]
    # Same GPU count, but one topology gets a bigger batch: refused.
    cfg = SweepConfig(["2p2d"], [1], tmp_path, gpus={"2p2d": 2}, server_args=["--max-num-seqs", "4"],
                      topology_args={"2p2d": ["--max-num-seqs=8"]})
    with pytest.raises(SweepError, match="max_num_seqs differs: replicas:2=4, 2p2d=8"):
        plan(cfg, base)
    cfg = SweepConfig(["replicas:4"], [1], tmp_path, devices=["0", "1"])
    with pytest.raises(SweepError, match="needs 4 GPUs"):
        plan(cfg, base)


def test_server_stop_escalates_to_sigkill_and_reaps_the_group(tmp_path):
    # The "server" ignores SIGTERM and leaves a child behind in its process group.
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('up', c.pid, "
            "flush=True); time.sleep(60)")
    server = ServerProcess([sys.executable, "-c", code], tmp_path / "s.log")
    server.start()
    deadline = time.monotonic() + 20
    while "up" not in server.log_tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(server.log_tail().split()[-1])
    t0 = time.monotonic()
    assert server.stop(grace_s=0.5) == -9
    assert time.monotonic() - t0 < 10
    stat = Path(f"/proc/{child}/stat")
    # The orphaned child is gone, or a zombie waiting for init to reap it (it holds nothing).
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_wait_ready_fails_fast_with_the_log_tail(tmp_path):
    server = ServerProcess([sys.executable, "-c", "import sys; print('bad flag'); sys.exit(3)"], tmp_path / "s.log")
    server.start()
    with pytest.raises(SweepError, match="exited with code 3") as e:
        server.wait_ready("http://127.0.0.1:9/health", timeout_s=30)
    assert "bad flag" in str(e.value)
    assert server.stop(1.0) == 3


def test_sweep_against_the_fake_server_writes_every_output(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("legato.bench.environment.gpus", lambda: ["Fake GPU, 80 GiB"])  # GPU rules, on any box
    root = write_prompt_dir(tmp_path / "prompts", n=6)
    out = tmp_path / "out"
    rc = main(["bench", "sweep", "--dataset-path", str(root), "--num-prompts", "6", "--voice", "ryan",
               "--fixed-length", "--frames-per-char", "0.1", "--min-frames", "2", "--max-frames", "4",
               "--topologies", "replicas:2,bad:2", "--gpus", "bad:2=2", "--topology-args", "bad:2=--no-such-flag",
               "--concurrency", "1,3", "--out-dir", str(out), "--server-cmd", shlex.join(FAKE_SERVER),
               "--server-args", "--max-num-seqs 4", "--num-warmups", "1", "--no-progress", "--label", "t",
               "--slo", "ttfp_ms=5000", "--startup-timeout", "30"])
    assert rc == 1  # the `bad:2` servers never started: reported, and the sweep still finished
    summary = json.loads((out / "summary.json").read_text())
    cells = {(c["topology"], c["concurrency"]): c for c in summary["cells"]}
    assert set(cells) == {("replicas:2", 1), ("replicas:2", 3), ("bad:2", 1), ("bad:2", 3)}
    # A failed cell names the error that stopped its server: the last line of its log, not a cut prefix.
    assert cells[("bad:2", 1)]["aggregates"] is None
    assert "unrecognized arguments: --no-such-flag" in cells[("bad:2", 1)]["error"]
    for conc in (1, 3):
        agg = cells[("replicas:2", conc)]["aggregates"]
        assert agg["completed"] == 6 and agg["num_gpus"] == 2
        assert agg["goodput"]["request_goodput_per_gpu"] == pytest.approx(agg["goodput"]["request_goodput"] / 2)
        run = json.loads((out / cells[("replicas:2", conc)]["result"]).read_text())
        assert run["config"]["topology"] == "replicas:2" and run["config"]["max_num_seqs"] == 4
        assert run["config"]["client"]["max_concurrency"] == conc
        assert (out / "runs" / f"t-replicas2-c{conc}-check.wav").is_file()
    md = (out / "SUMMARY.md").read_text()
    assert "| replicas:2 | 2 | 3 | 6/6 |" in md and "failed: " in md and "--no-such-flag" in md
    assert summary["meta"]["control"] == ["replicas:2"] and summary["meta"]["fairness_notes"] == []
    for png in PNGS:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "legato bench sweep" in capsys.readouterr().out
    assert summary["meta"]["environment"]["cpus"] >= 1  # where it ran is recorded

    # The same cells rebuilt from the run JSONs alone (a sweep cut short, or cells of several sweeps).
    again = tmp_path / "again"
    runs = sorted(str(p) for p in (out / "runs").glob("*.json"))
    assert main(["bench", "summarize", *runs, "--out-dir", str(again), "--env", "commit=abc"]) == 0
    redo = json.loads((again / "summary.json").read_text())
    assert redo["meta"]["environment"] == {"commit": "abc"}
    assert {(c["topology"], c["concurrency"]): c["aggregates"] for c in redo["cells"]} == \
        {k: c["aggregates"] for k, c in cells.items() if c["aggregates"] is not None}
    assert "| replicas:2 | 2 | 3 | 6/6 |" in (again / "SUMMARY.md").read_text()


def test_a_cpu_only_sweep_compares_one_host_topologies_as_equal_hardware(tmp_path, monkeypatch):
    """No GPUs here: `split` and `1p1d` need no --gpus, run beside `single` (the control) on this one host,
    and the summary says so; no per-GPU figures and, with no SLO, no goodput plot; the plots carry a caption
    and start at zero."""
    monkeypatch.setattr("legato.bench.environment.gpus", lambda: [])
    root = write_prompt_dir(tmp_path / "prompts", n=4)
    out = tmp_path / "out"
    rc = main(["bench", "sweep", "--dataset-path", str(root), "--num-prompts", "4", "--voice", "ryan",
               "--topologies", "split,1p1d", "--concurrency", "2", "--out-dir", str(out),
               "--server-cmd", shlex.join(FAKE_SERVER), "--num-warmups", "0", "--no-progress", "--label", "cpu",
               "--startup-timeout", "30"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [c["topology"] for c in summary["cells"]] == ["single", "split", "1p1d"]
    assert summary["meta"]["cpu_only"] and any("CPU only" in n for n in summary["meta"]["fairness_notes"])
    assert all("num_gpus" not in c["aggregates"] and "request_goodput_per_gpu" not in c["aggregates"]["goodput"]
               for c in summary["cells"])
    md = (out / "SUMMARY.md").read_text()
    assert "| split | cpu | 2 | 4/4 |" in md and "CPU only" in md
    assert (out / PNGS[0]).is_file() and (out / PNGS[1]).is_file() and not (out / PNGS[2]).exists()


def test_plots_start_at_zero_and_carry_a_caption(tmp_path):
    import matplotlib.pyplot as plt

    from legato.bench import report

    cells = [{"topology": "single", "gpus": 1, "concurrency": c, "aggregates": {
        "request_throughput": 10.0 + c, "audio_throughput": 30.0 + c, "ttfp_ms": {"median": 50.0, "p99": 90.0},
        "goodput": {"request_goodput_per_gpu": 1.0, "audio_goodput_per_gpu": 2.0}}} for c in (1, 4)]
    meta = {"model_path": "/m/Qwen3-TTS-12Hz-0.6B-Base", "dataset": "/d/en/meta.lst", "mode": "clone",
            "slo": {"per_request": {"ttfp_ms": 500}, "run": {}},
            "environment": {"commit": "abc123", "gpus": ["NVIDIA H200, 143771 MiB"]}}
    seen = []
    real = plt.Figure.savefig

    def spy(fig, *a, **kw):
        seen.append(([ax.get_ylim()[0] for ax in fig.axes], [t.get_text() for t in fig.texts]))
        return real(fig, *a, **kw)

    plt.Figure.savefig = spy
    try:
        paths = report.plot_sweep(cells, tmp_path, meta)
    finally:
        plt.Figure.savefig = real
    assert [p.name for p in paths] == list(PNGS)
    for bottoms, texts in seen:
        assert all(b == 0 for b in bottoms)
        assert texts[-1:] == ["model /m/Qwen3-TTS-12Hz-0.6B-Base | NVIDIA H200, 143771 MiB | "
                              "prompts meta.lst (clone) | commit abc123"]


@pytest.mark.slow
def test_end_to_end_sweep_of_the_real_server(tmp_path, monkeypatch):
    monkeypatch.setenv("LEGATO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny model on a 2-core box: threads only contend
    topologies = "single,replicas:2"
    server_cmd = [sys.executable, "-m", "legato.cli", "serve"]
    root = write_prompt_dir(tmp_path / "prompts", n=8)
    out = tmp_path / "sweep"
    t0 = time.monotonic()
    rc = main(["bench", "sweep", "--dataset-path", str(root), "--num-prompts", "8", "--voice", "ryan",
               "--fixed-length", "--frames-per-char", "0.2", "--min-frames", "4", "--max-frames", "12",
               "--topologies", topologies, "--concurrency", "1,4", "--server-args", "--max-num-seqs 4",
               "--server-cmd", shlex.join(server_cmd), "--out-dir", str(out), "--num-warmups", "1", "--no-progress",
               "--allow-unfair", "--label", "e2e", "--startup-timeout", "120", "--timeout", "120",
               "--slo", "ttfp_p50_ms=60000"])
    elapsed = time.monotonic() - t0
    assert rc == 0, (out / "SUMMARY.md").read_text() if (out / "SUMMARY.md").exists() else "no summary"
    summary = json.loads((out / "summary.json").read_text())
    expected = [(t, c) for t in topologies.split(",") for c in (1, 4)]
    assert [(c["topology"], c["concurrency"]) for c in summary["cells"]] == expected
    for cell in summary["cells"]:
        agg = cell["aggregates"]
        assert agg["completed"] == 8 and agg["failed"] == 0, agg["failures"]
        run = json.loads((out / cell["result"]).read_text())
        for r in run["requests"]:
            # The server honoured the fixed length: exactly num_frames frames of 80 ms came back.
            assert r["total_bytes"] == r["num_frames"] * FRAME_SAMPLES * 2
            assert 4 <= r["num_frames"] <= 12 and r["ttfp_s"] <= r["e2el_s"]
        stem = f"e2e-{cell['topology'].replace(':', '')}-c{cell['concurrency']}"
        audio, sr = sf.read(out / "runs" / f"{stem}-check.wav")
        assert sr == 24000 and len(audio) % FRAME_SAMPLES == 0 and len(audio) >= 4 * FRAME_SAMPLES
    md = (out / "SUMMARY.md").read_text()
    assert "num_frames = clamp(round(len(text) * 0.2), 4, 12)" in md
    # Per-GPU goodput is drawn only where there are GPUs (CI has none: one host, equal hardware).
    for png in PNGS[:2] if summary["meta"]["cpu_only"] else PNGS:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert elapsed < 900, f"the sweep took {elapsed:.0f} s"  # a hang guard, not a speed target


def test_the_recorded_commit_is_legatos_own_whatever_the_working_directory(tmp_path, monkeypatch):
    """A walkthrough ran `legato bench sweep` from a results folder: its summary recorded commit None, and run
    from another git repository it would have recorded that repository's commit as the code measured."""
    from legato.bench.environment import commit

    root = Path(__file__).resolve().parents[1]
    here = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True)
    if here.returncode != 0:
        pytest.skip("this copy of legato is not a git checkout")
    other = tmp_path / "results"
    git = ["git", "-C", str(other), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    other.mkdir()
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "results"], check=True)
    monkeypatch.delenv("LEGATO_COMMIT", raising=False)
    monkeypatch.chdir(other)
    assert commit() == here.stdout.strip()
    monkeypatch.chdir(tmp_path)  # not a repository at all
    assert commit() == here.stdout.strip()
    monkeypatch.setenv("LEGATO_COMMIT", "abc123")  # a copy without .git says which commit it is
    assert commit() == "abc123"
