"""The bench client against a fake streaming server: timings, limits, and failures that are counted."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf
from bench_fake_server import FRAME_SAMPLES, FakeSpeechServer
from bench_helpers import write_prompt_dir

from legato.bench.client import ClientConfig, arrival_offsets, run_benchmark
from legato.bench.datasets import BenchRequest
from legato.bench.metrics import aggregate
from legato.bench.sweep import free_port
from legato.cli import main

FRAME_S = FRAME_SAMPLES / 24000


def reqs(texts: list[str], frames: int = 3) -> list[BenchRequest]:
    return [BenchRequest(f"u{i}", {"input": t, "voice": "ryan", "num_frames": frames, "ignore_eos": True}, len(t),
                         frames) for i, t in enumerate(texts)]


def bench(texts: list[str], frame_delay: float = 0.01, **cfg):
    async def go():
        server = await FakeSpeechServer(frame_delay).start()
        try:
            out = await run_benchmark(ClientConfig(base_url=server.url, progress=False, **cfg), reqs(texts))
        finally:
            await server.close()
        return server, out

    return asyncio.run(go())


def test_streams_are_timed_and_bodies_carry_the_transport_fields():
    server, out = bench(["hello there", "second one", "third"], frame_delay=0.02, model="m1", max_concurrency=2)
    assert len(out.records) == 3 and not out.warmups
    for r in out.records:
        assert r.ok, r.error
        assert r.status == 200 and len(r.chunk_bytes) == 3 and r.total_bytes == 3 * FRAME_SAMPLES * 2
        assert r.audio_s == pytest.approx(3 * FRAME_S)
        assert 0.02 <= r.ttfp_s <= r.e2el_s and r.e2el_s >= 0.06
        assert r.rtf == pytest.approx(r.e2el_s / r.audio_s)
        assert r.chunk_times_s == sorted(r.chunk_times_s)
    body = server.bodies[0]
    assert body["stream"] is True and body["stream_format"] == "audio" and body["response_format"] == "pcm"
    assert body["model"] == "m1" and body["voice"] == "ryan" and body["num_frames"] == 3
    assert out.check_pcm is not None and len(out.check_pcm) == 3 * FRAME_SAMPLES * 2
    assert out.duration_s >= max(r.sent_s + r.e2el_s for r in out.records) - 1e-6


def test_failures_and_timeouts_are_counted_not_dropped():
    texts = ["ok one", "fail please", "hang forever", "cut short", "json instead", "empty stream", "ok two"]
    _, out = bench(texts, timeout_s=1.0)
    kinds = {r.utt_id: r.error_kind for r in out.records}
    assert kinds == {"u0": None, "u1": "http_500", "u2": "timeout", "u3": "stream_cut", "u4": "bad_content_type",
                     "u5": "no_audio", "u6": None}
    assert "engine exploded" in out.records[1].error
    assert out.records[2].end_s == pytest.approx(1.0, abs=0.3)  # ended by the deadline
    assert out.records[3].total_bytes == 2 * FRAME_SAMPLES * 2  # what arrived before the cut is kept
    agg = aggregate(out.records, out.duration_s)
    assert (agg["num_requests"], agg["completed"], agg["failed"]) == (7, 2, 5)
    assert agg["failures"] == {"bad_content_type": 1, "http_500": 1, "no_audio": 1, "stream_cut": 1, "timeout": 1}
    assert agg["continuity_rate"] <= 2 / 7
    # the console report says each kind's first cause, not only the counts (a newcomer's walkthrough)
    from legato.bench.report import first_failures

    lines = first_failures([r.to_json() for r in out.records])
    assert len(lines) == 5 and any(ln.startswith("first http_500 failure:") and "engine exploded" in ln
                                   for ln in lines)


def test_a_server_streaming_another_sample_rate_than_the_benchs_fails_its_requests():
    """--sample-rate turns bytes into audio seconds: a server streaming another rate (its X-Sample-Rate) would give
    figures off by the ratio, silently (an outside probe saw 2,332 audio-s/s with --sample-rate 7)."""
    _, out = bench(["hello there", "second one"], sample_rate=16000)
    assert {r.error_kind for r in out.records} == {"sample_rate_mismatch"}
    assert "the server streamed 24000 Hz PCM and --sample-rate is 16000" in out.records[0].error
    assert out.records[0].error.endswith("(give --sample-rate 24000)")
    assert aggregate(out.records, out.duration_s)["completed"] == 0


@pytest.mark.parametrize("flag", [["--sample-rate", "0"], ["--sample-rate", "-24000"], ["--num-prompts", "-1"]])
def test_bench_serve_refuses_counts_below_one_in_one_line(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--no-progress", *flag])
    assert exit_.value.code == 2 and "must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [
    ["serve", "--timeout", "nan"], ["serve", "--timeout", "0"], ["serve", "--frames-per-char", "nan"],
    ["serve", "--frames-per-char", "inf"], ["sweep", "--startup-timeout", "-1"], ["soak", "--duration", "inf"],
    ["soak", "--duration", "nan"], ["soak", "--timeout", "0"], ["soak", "--drain-timeout", "-1"],
])
def test_bench_refuses_seconds_and_rates_that_are_not_finite_and_positive_in_one_line(flag, capsys):
    """NaN passed `<= 0` checks (`serve --timeout nan` failed every request "within nan s"), `soak --duration inf`
    was a traceback and `soak --timeout 0` a misleading ConnectTimeout: all are refused before any request."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *flag])
    assert exit_.value.code == 2 and "must be a finite number > 0" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "said"), [
    (["serve", "--base-url", "http://127.0.0.1:8000/v1"], "drop the /v1 (http://127.0.0.1:8000)"),
    (["serve", "--base-url", "http://127.0.0.1:8000/v1/"], "drop the /v1 (http://127.0.0.1:8000)"),
    (["soak", "--url", "http://127.0.0.1:8000/v1"], "drop the /v1 (http://127.0.0.1:8000)"),
    (["serve", "--base-url", "127.0.0.1:8000"], "must be the server's http:// or https:// URL"),
])
def test_bench_refuses_a_server_url_its_routes_cannot_follow_in_one_line(args, said, capsys):
    """The OpenAI SDK's base URL (`.../v1`, as the README's example has it) made the bench read `/v1/v1/models`, a
    404 answered with "give --mode", which could not help; a URL without a scheme got the same advice."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and said in err and "give --mode" not in err


@pytest.mark.parametrize("flag", [["--text-rate", "0"], ["--request-rate", "-1"], ["--text-rate", "nan"]])
def test_bench_serve_rates_name_themselves_when_refused(flag, capsys):
    """`--text-rate 0` answered "request rate must be > 0": the rate the user gave is named, not another's."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--no-progress", *flag])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag[0]}: must be a rate > 0 a second, or inf, got '{flag[1]}'" in err
    assert "request rate" not in err


def test_bench_serve_refuses_cancel_after_without_stream_text(capsys):
    """Cancels are the streaming-text socket's: over HTTP the flag measured nothing, without a word."""
    assert main(["bench", "serve", "--no-progress", "--cancel-after", "1", "--base-url", "http://127.0.0.1:9"]) == 2
    assert "--cancel-after cancels streaming-text contexts: add --stream-text" in capsys.readouterr().err


def test_summarize_env_pairs_are_named_keys_not_topologies():
    from legato.bench.cli import _pairs

    assert _pairs(["commit=abc"], "--env", "KEY") == {"commit": "abc"}
    with pytest.raises(SystemExit, match="--env 'bogus': expected KEY=VALUE"):
        _pairs(["bogus"], "--env", "KEY")


def test_connection_refused_is_a_transport_failure():
    async def go():
        cfg = ClientConfig(base_url=f"http://127.0.0.1:{free_port()}", progress=False, timeout_s=5)
        return await run_benchmark(cfg, reqs(["a", "b"]))

    out = asyncio.run(go())
    assert [r.error_kind for r in out.records] == ["transport", "transport"]


def test_max_concurrency_caps_requests_in_flight_and_warmups_are_separate():
    server, out = bench(["x"] * 6, frame_delay=0.02, max_concurrency=2, num_warmups=2)
    assert server.max_in_flight == 2
    assert len(server.bodies) == 8 and len(out.warmups) == 2 and len(out.records) == 6
    assert all(r.ok for r in out.records + out.warmups)
    _, unbounded = bench(["x"] * 5, frame_delay=0.05)
    # With no cap (rate inf) all requests go out at once.
    assert max(r.sent_s for r in unbounded.records) < 0.05


def test_poisson_arrivals_are_seeded_and_respected():
    offs = arrival_offsets(2000, rate=50.0, seed=3)
    assert offs[0] == 0.0 and offs == arrival_offsets(2000, 50.0, 3) and offs != arrival_offsets(2000, 50.0, 4)
    gaps = [b - a for a, b in zip(offs, offs[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.1)
    assert arrival_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
    _, out = bench(["x"] * 5, request_rate=20.0, seed=1)
    for r, planned in zip(out.records, arrival_offsets(5, 20.0, 1), strict=True):
        assert r.scheduled_s == planned and r.sent_s >= planned - 1e-3


def _fake_server_proc(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "bench_fake_server.py"), "--port", str(port)],
                            stdout=subprocess.PIPE, text=True)
    assert "fake server" in proc.stdout.readline()
    return proc


def test_a_short_prompt_list_names_the_flag_that_asked_for_more(tmp_path, capsys):
    """A walkthrough gave `--dataset-path` a list of 2 prompts and no `--num-prompts`: "asked for 100 prompts but
    the list has 2" named neither the flag nor its default, which had asked for those 100."""
    port = free_port()
    proc = _fake_server_proc(port)
    try:
        root = write_prompt_dir(tmp_path / "prompts", n=2)
        assert main(["bench", "serve", "--dataset-path", str(root), "--voice", "ryan", "--max-concurrency", "1",
                     "--base-url", f"http://127.0.0.1:{port}", "--no-progress"]) == 2
    finally:
        proc.terminate()
        proc.wait(10)
    err = capsys.readouterr().err
    assert "asked for 100 prompts (--num-prompts, 100 by default) but the list has 2" in err, err
    assert "--num-prompts 2 or fewer" in err, err


def test_cli_serve_writes_json_and_check_wav_then_compare(tmp_path, capsys):
    port = free_port()
    proc = _fake_server_proc(port)
    try:
        root = write_prompt_dir(tmp_path / "prompts", n=4)
        common = ["bench", "serve", "--dataset-path", str(root), "--num-prompts", "4", "--voice", "ryan",
                  "--fixed-length", "--frames-per-char", "0.1", "--min-frames", "2", "--max-frames", "5",
                  "--base-url", f"http://127.0.0.1:{port}", "--num-warmups", "1", "--no-progress",
                  "--result-dir", str(tmp_path / "res"), "--slo", "ttfp_ms=5000", "--num-gpus", "1"]
        assert main([*common, "--label", "a", "--max-concurrency", "2"]) == 0
        assert main([*common, "--label", "b", "--max-concurrency", "2", "--topology", "other"]) == 0
        assert main([*common, "--label", "c", "--max-concurrency", "4"]) == 0
    finally:
        proc.terminate()
        proc.wait(10)
    result = json.loads((tmp_path / "res" / "a-server-c2.json").read_text())
    assert len(result["requests"]) == 4 and len(result["warmups"]) == 1
    assert result["aggregates"]["completed"] == 4 and result["aggregates"]["goodput"]["good_requests"] == 4
    assert result["config"]["request"]["fixed_length"]["rule"].startswith("ignore_eos=true, num_frames = clamp(")
    assert result["config"]["client"]["request_rate"] == "inf" and result["config"]["num_gpus"] == 1
    assert [r["num_frames"] for r in result["requests"]] == [min(5, max(2, round(r["text_chars"] * 0.1)))
                                                             for r in result["requests"]]
    audio, sr = sf.read(tmp_path / "res" / "a-server-c2-check.wav")
    assert sr == 24000 and len(audio) % FRAME_SAMPLES == 0 and len(audio) > 0
    assert result["check_wav"] == "a-server-c2-check.wav"
    capsys.readouterr()
    assert main(["bench", "compare", str(tmp_path / "res" / "a-server-c2.json"),
                 str(tmp_path / "res" / "b-other-c2.json")]) == 0
    out = capsys.readouterr().out
    assert "B/A" in out and "ttfp_ms.p99" in out and "request_throughput" in out
    # Different max concurrency: refused unless --allow-unfair.
    c_json = str(tmp_path / "res" / "c-server-c4.json")
    assert main(["bench", "compare", str(tmp_path / "res" / "a-server-c2.json"), c_json]) == 2
    assert "max_concurrency differs" in capsys.readouterr().err
    assert main(["bench", "compare", str(tmp_path / "res" / "a-server-c2.json"), c_json, "--allow-unfair"]) == 0
    assert "UNFAIR: max_concurrency differs" in capsys.readouterr().out


def test_bench_serve_from_a_fresh_clone_needs_no_dataset_and_follows_the_model(tmp_path, tmp_path_factory):
    """No --dataset-path, no --mode, against a CustomVoice server: the packaged prompts, sent with a preset
    voice the server has (not clone requests, which a CustomVoice model answers with 400)."""
    from server_helpers import LiveServer, local_client, server_settings, tiny_loaded

    from legato.server.app import build_app

    loaded = tiny_loaded(tmp_path_factory.getbasetemp(), "custom_voice")
    app = build_app(local_client(loaded, name="cv"), server_settings(loaded, max_new_tokens_limit=64), None)
    with LiveServer(app) as srv:  # a base URL written with a trailing slash read //v1/models: 404, "give --mode"
        rc = main(["bench", "serve", "--base-url", srv.url + "/", "--num-prompts", "3", "--fixed-length",
                   "--frames-per-char", "0.05", "--min-frames", "2", "--max-frames", "3", "--num-warmups", "0",
                   "--no-progress", "--result-dir", str(tmp_path / "res"), "--label", "fresh"])
    assert rc == 0
    result = json.loads((tmp_path / "res" / "fresh-server-cinf.json").read_text())
    assert result["aggregates"]["completed"] == 3 and result["aggregates"]["failed"] == 0
    assert result["config"]["request"]["mode"] == "voice" and result["config"]["request"]["voice"] == "ryan"
    assert result["config"]["dataset"]["path"].endswith("legato/bench/data/en/meta.lst")


def test_summarize_takes_the_output_of_bench_serve(tmp_path, capsys):
    """`bench serve` records `server_args: null` (it did not start the server), and an uncapped run no
    concurrency: summarize read both as a sweep's and crashed (issue 20, item 5)."""
    port = free_port()
    proc = _fake_server_proc(port)
    try:
        root = write_prompt_dir(tmp_path / "prompts", n=3)
        common = ["bench", "serve", "--dataset-path", str(root), "--num-prompts", "3", "--voice", "ryan",
                  "--fixed-length", "--frames-per-char", "0.1", "--min-frames", "2", "--max-frames", "3",
                  "--base-url", f"http://127.0.0.1:{port}", "--num-warmups", "0", "--no-progress",
                  "--result-dir", str(tmp_path / "res")]
        assert main([*common, "--label", "a", "--max-concurrency", "2"]) == 0
        assert main([*common, "--label", "a"]) == 0  # the fake server gives no limit: uncapped
    finally:
        proc.terminate()
        proc.wait(10)
    runs = sorted(str(p) for p in (tmp_path / "res").glob("a-server-*.json"))
    assert [Path(r).name for r in runs] == ["a-server-c2.json", "a-server-cinf.json"]
    assert json.loads(Path(runs[0]).read_text())["config"]["server_args"] is None
    capsys.readouterr()
    assert main(["bench", "summarize", *runs, "--out-dir", str(tmp_path / "sum")]) == 0
    summary = json.loads((tmp_path / "sum" / "summary.json").read_text())
    assert sorted(c["concurrency"] for c in summary["cells"]) == [2, 3]  # uncapped: all 3 requests in flight
    md = (tmp_path / "sum" / "SUMMARY.md").read_text()
    assert "| server | 1 | 3 | 3/3 |" in md
    # its own title, and the run files it read rather than a `runs/` it never wrote (a newcomer's walkthrough)
    assert md.startswith("# legato bench summary") and "`runs/`" not in md and runs[0] in md


def test_bench_serve_takes_its_concurrency_from_the_server(tmp_path):
    """`legato serve --topology replicas:2 --max-num-seqs 4` decodes 8 requests at once and says so on
    /v1/models; `bench serve` without --max-concurrency then runs 8 at a time (issue 20, item 4: unbounded, 48
    requests at once timed out on a CPU server)."""
    import httpx
    from serve_process import ServeProcess

    with ServeProcess(tmp_path, "--topology", "replicas:2") as srv:
        card = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]
        rc = main(["bench", "serve", "--base-url", srv.url, "--num-prompts", "3", "--fixed-length",
                   "--frames-per-char", "0.05", "--min-frames", "2", "--max-frames", "3", "--num-warmups", "0",
                   "--no-progress", "--result-dir", str(tmp_path / "res"), "--label", "slots"])
    assert card["max_num_seqs"] == 4 and card["decode_slots"] == 8
    assert rc == 0
    result = json.loads((tmp_path / "res" / "slots-server-c8.json").read_text())
    assert result["config"]["client"]["max_concurrency"] == 8 and result["config"]["max_num_seqs"] == 4
    assert result["aggregates"]["completed"] == 3 and result["warnings"] == []


def test_compare_and_summarize_refuse_a_file_that_is_no_run_in_one_line(tmp_path, capsys):
    from legato.cli import main

    empty, text = tmp_path / "empty.json", tmp_path / "notes.json"
    empty.write_text("{}")
    text.write_text("not json")
    assert main(["bench", "compare", str(empty), str(text)]) == 2
    err = capsys.readouterr().err
    assert "empty.json: not a bench result" in err and "Traceback" not in err
    assert main(["bench", "summarize", "--out-dir", str(tmp_path / "sum"), str(text)]) == 2
    assert "notes.json: not a bench result (not JSON" in capsys.readouterr().err
