"""`--mps`: a private CUDA MPS daemon for worker processes sharing a GPU. The control program is faked here (a
script that behaves as nvidia-cuda-mps-control does towards us: `-d` daemonizes and opens a control pipe, `quit`
on stdin ends it); on a GPU host `benchmarks/h200_topologies.sh` runs the real one."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from legato.pipeline import launchers
from legato.pipeline.launchers import LocalLauncher
from legato.pipeline.mps import LOG_ENV, PIPE_ENV, MpsDaemon, MpsError, shared_gpus, start_for
from legato.pipeline.topology import parse_topology, worker_devices

FAKE_CONTROL = """#!{python}
import os, sys, time
from pathlib import Path
pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
if sys.argv[1:] == ["-d"]:
    if os.environ.get("FAKE_MPS_FAIL"):
        print("An instance of this daemon is already running", file=sys.stderr)
        sys.exit(1)
    if os.fork():
        sys.exit(0)  # the parent returns at once, as -d does
    os.setsid()
    (pipe / "nvidia-cuda-mps-control.pid").write_text(str(os.getpid()))
    if not os.environ.get("FAKE_MPS_MUTE"):
        (pipe / "control").write_text("")
    else:
        Path(os.environ["CUDA_MPS_LOG_DIRECTORY"], "control.log").write_text("[ERROR] no CUDA-capable device")
    deadline = time.monotonic() + 60  # never outlives a test run
    while not (pipe / "quit").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    os._exit(0)
said = sys.stdin.read().strip()
if said == "get_server_list" and os.environ.get("FAKE_MPS_DEAD"):
    sys.exit(1)  # no daemon behind this pipe
if said == "quit":
    (pipe / "control").unlink(missing_ok=True)
    (pipe / "quit").write_text("")
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    path = tmp_path / "bin" / "nvidia-cuda-mps-control"
    path.parent.mkdir()
    path.write_text(FAKE_CONTROL.format(python=sys.executable))
    path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{path.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(PIPE_ENV, raising=False)
    return str(path)


def _gone(pid: int, deadline_s: float = 10.0) -> bool:
    until = time.monotonic() + deadline_s
    while time.monotonic() < until:
        try:
            os.kill(pid, 0)
        except OSError:
            return True
        try:  # reap it if it is our child (the fake's -d parent is; its daemon is not)
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.02)
    return False


def test_the_gpus_that_hold_two_workers_are_the_shared_ones():
    assert shared_gpus(["cuda:0", "cuda:0"]) == ["cuda:0"]
    assert shared_gpus(["cuda", "cuda:0", "cuda:1"]) == ["cuda:0"]  # "cuda" is cuda:0
    assert shared_gpus(["cuda:0", "cuda:1"]) == [] and shared_gpus(["cpu", "cpu"]) == []
    assert worker_devices(parse_topology("replicas:3"), ["cuda:0", "cuda:1"]) == ["cuda:0", "cuda:1", "cuda:0"]
    assert worker_devices(parse_topology("1p1d"), ["cuda:0"]) == ["cuda:0", "cuda:0"]
    assert worker_devices(parse_topology("split"), ["cuda:0"]) == ["cuda:0", "cuda:0"]
    assert worker_devices(parse_topology("split"), ["cuda:0", "cuda:1"]) == ["cuda:0", "cuda:1"]
    assert worker_devices(parse_topology("single"), ["cuda:0"]) == ["cuda:0"]


def test_the_daemon_starts_in_a_directory_of_its_own_and_quits_with_its_files(fake_control):
    daemon = MpsDaemon.start()
    pipe = Path(daemon.env[PIPE_ENV])
    assert pipe.joinpath("control").exists() and Path(daemon.env[LOG_ENV]).is_dir()
    assert pipe.parent == daemon.root and daemon.root.name.startswith("legato-mps-")
    pid = int(pipe.joinpath("nvidia-cuda-mps-control.pid").read_text())
    daemon.stop()
    assert _gone(pid), "the daemon outlived stop()"
    assert not daemon.root.exists()
    daemon.stop()  # a second stop is harmless


def test_a_daemon_that_refuses_to_start_is_one_line_naming_why(fake_control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    with pytest.raises(MpsError, match="already running"):
        MpsDaemon.start()


def test_a_daemon_that_never_opens_its_pipe_fails_at_the_deadline_and_is_killed(fake_control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_MUTE", "1")
    before = set(Path("/tmp").glob("legato-mps-*"))
    with pytest.raises(MpsError, match="did not open its control pipe.*its log ends: .*no CUDA-capable device"):
        MpsDaemon.start(deadline_s=0.5)
    assert set(Path("/tmp").glob("legato-mps-*")) <= before  # its directory went with it


def test_mps_starts_only_for_worker_processes_sharing_a_gpu(fake_control):
    shared, apart = ["cuda:0", "cuda:0"], ["cuda:0", "cuda:1"]
    assert start_for("off", shared, process_workers=True, local=True) is None
    assert start_for("on", apart, process_workers=True, local=True) is None  # nothing to share
    assert start_for("auto", ["cpu", "cpu"], process_workers=True, local=True) is None
    with pytest.raises(MpsError, match="thread workers"):
        start_for("on", shared, process_workers=False, local=True)
    with pytest.raises(MpsError, match="Ray"):
        start_for("on", shared, process_workers=True, local=False)
    assert start_for("auto", shared, process_workers=False, local=True) is None
    with pytest.raises(MpsError, match="--mps takes"):
        start_for("yes", shared, process_workers=True, local=True)
    for mode in ("on", "auto"):
        daemon = start_for(mode, shared, process_workers=True, local=True)
        try:
            assert daemon is not None and Path(daemon.env[PIPE_ENV], "control").exists()
        finally:
            daemon.stop()


def test_without_the_control_program_on_fails_and_auto_leaves_the_gpu_time_sliced(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control here
    monkeypatch.delenv(PIPE_ENV, raising=False)
    with pytest.raises(MpsError, match="needs nvidia-cuda-mps-control"):
        start_for("on", ["cuda:0", "cuda:0"], process_workers=True, local=True)
    assert start_for("auto", ["cuda:0", "cuda:0"], process_workers=True, local=True) is None
    assert "take turns" in caplog.text


def test_auto_that_cannot_start_the_daemon_warns_and_on_fails(fake_control, monkeypatch, caplog):
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    assert start_for("auto", ["cuda:0", "cuda:0"], process_workers=True, local=True) is None
    assert "already running" in caplog.text
    with pytest.raises(MpsError):
        start_for("on", ["cuda:0", "cuda:0"], process_workers=True, local=True)


def test_a_daemon_already_running_where_workers_look_is_joined_not_doubled(fake_control, tmp_path, monkeypatch):
    pipe = tmp_path / "system-mps"
    pipe.mkdir()
    (pipe / "control").write_text("")
    monkeypatch.setenv(PIPE_ENV, str(pipe))
    assert start_for("on", ["cuda:0", "cuda:0"], process_workers=True, local=True) is None


def test_a_pipe_no_daemon_answers_on_is_not_joined(fake_control, tmp_path, monkeypatch, caplog):
    pipe = tmp_path / "stale-mps"
    pipe.mkdir()
    (pipe / "control").write_text("")
    monkeypatch.setenv(PIPE_ENV, str(pipe))
    monkeypatch.setenv("FAKE_MPS_DEAD", "1")
    daemon = start_for("on", ["cuda:0", "cuda:0"], process_workers=True, local=True)
    try:
        assert daemon is not None and daemon.env[PIPE_ENV] != str(pipe)
        assert "answers nothing" in caplog.text
    finally:
        daemon.stop()


def test_the_local_launcher_gives_each_worker_the_daemons_environment(monkeypatch):
    seen = {}
    monkeypatch.setattr(launchers, "spawn_worker", lambda spec, env: seen.update(env) or "proc")
    env = {PIPE_ENV: "/tmp/legato-mps-x/pipe", LOG_ENV: "/tmp/legato-mps-x/log"}
    assert asyncio.run(LocalLauncher(env=env).spawn("replica0", "{}", 2)) == "proc"
    assert seen[PIPE_ENV] == env[PIPE_ENV] and seen["OMP_NUM_THREADS"] == "2" and "PYTHONPATH" in seen
    seen.clear()
    asyncio.run(LocalLauncher().spawn("replica0", "{}", None))
    assert PIPE_ENV not in seen or seen[PIPE_ENV] == os.environ.get(PIPE_ENV)


def test_serve_takes_mps_off_by_default_and_refuses_an_unknown_mode(capsys):
    from legato.cli import build_parser

    assert build_parser().parse_args(["serve"]).mps == "off"
    assert build_parser().parse_args(["serve", "--mps", "auto"]).mps == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--mps", "yes"])
    assert "--mps" in capsys.readouterr().err


def test_the_code_predictor_stack_is_refused_where_engines_would_share_a_gpu_side_by_side(tmp_path, monkeypatch):
    """`--code-predictor-stack` with two code-predictor engines on one GPU at once (threads, or processes under
    MPS: asked for, `auto` with the control program found, or a daemon already answering) is refused in one line;
    processes taking turns, engines on GPUs of their own, split's codec worker and Ray workers are left alone."""
    from legato.server.cli import check_stack_sharing

    no_daemon = tmp_path / "no-daemon"
    no_daemon.mkdir()
    monkeypatch.setenv(PIPE_ENV, str(no_daemon))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no nvidia-cuda-mps-control

    def check(topology, devices, workers="process", mps="off", launcher="local", stack=True):
        check_stack_sharing(stack, parse_topology(topology), devices, workers, mps, launcher)

    for topology in ("replicas:2", "1p1d"):
        with pytest.raises(ValueError, match=r"--code-predictor-stack: the engines sharing cuda:0 would run as "
                                             r"threads of one process.*--mps off"):
            check(topology, ["cuda:0"], workers="thread")
        with pytest.raises(ValueError, match="would run under MPS"):
            check(topology, ["cuda:0"], mps="on")
        check(topology, ["cuda:0"], mps="auto")  # no control program: the workers take turns
        check(topology, ["cuda:0"])
        check(topology, ["cuda:0", "cuda:1"], mps="on")  # a GPU each
        check(topology, ["cuda:0"], mps="on", launcher="ray")
        check(topology, ["cuda:0"], workers="thread", stack=False)
    check("split", ["cuda:0"], mps="on")  # the codec worker runs no code predictor
    check("single", ["cuda:0"], workers="thread", mps="on")

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text("#!/bin/sh\nexit 0\n")
    control.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(ValueError, match="under MPS"):
        check("replicas:2", ["cuda:0"], mps="auto")
    check("replicas:2", ["cuda:0"])  # --mps off, no daemon answering

    running = tmp_path / "running"
    running.mkdir()
    (running / "control").write_text("")
    monkeypatch.setenv(PIPE_ENV, str(running))
    with pytest.raises(ValueError, match="under MPS"):  # a daemon already there: its clients share the SMs
        check("replicas:2", ["cuda:0"])


def test_serve_refuses_the_stack_for_thread_replicas_on_one_gpu_before_anything_loads():
    """In a process of its own: `serve` sets up logging and a SIGTERM handler that would outlive it here."""
    import subprocess

    script = ("import sys; from legato.cli import build_parser; from legato.server import serve; "
              "serve.check_devices = lambda devices: None; "  # this box has no CUDA device to name
              "sys.exit(serve.serve(build_parser().parse_args(['serve', '--device', 'cuda:0', '--topology', "
              "'replicas:2', '--workers', 'thread', '--code-predictor-stack', '--port', '0', "
              "'--host', '127.0.0.1'])))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--code-predictor-stack: the engines sharing cuda:0 would run as threads" in done.stderr
