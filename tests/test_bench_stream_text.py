"""`legato bench serve --stream-text`: prompts cut into LLM-like tokens, sent over the streaming-text WebSocket at
a rate, TTFP from the first text, audio gaps told apart by cause (text that had not arrived, or the engine), and
the latency of a barge-in cancel; against a real uvicorn server on 127.0.0.1 with the tiny model."""

from __future__ import annotations

import asyncio
import math

import pytest
from server_helpers import LiveServer, local_client, server_settings, tiny_loaded

from legato.bench.client import ClientConfig
from legato.bench.datasets import BenchRequest
from legato.bench.metrics import RequestRecord
from legato.bench.stream_text import (
    StreamTextRecord,
    TextFeed,
    run_stream_text,
    split_stalls,
    stream_text_summary,
    summary_line,
    text_tokens,
)
from legato.server.app import build_app

pytest.importorskip("websockets")

TEXTS = ["Streaming text arrives word by word, while the voice speaks it.", "A second, shorter prompt."]


def test_tokens_are_short_pieces_that_join_to_the_text():
    for text in (*TEXTS, "  spaced  out  ", "Supercalifragilistic!", "", "x"):
        pieces = text_tokens(text, 4)
        assert "".join(pieces) == text
        assert all(len(p.strip()) <= 4 for p in pieces)
    assert text_tokens("Hello there", 4) == ["Hell", "o", " ther", "e"]


def _record(times: list[float], seconds: list[float], sample_rate: int = 1000) -> RequestRecord:
    rec = RequestRecord(0, "u", 10, chunk_times_s=times, chunk_bytes=[int(2 * sample_rate * s) for s in seconds],
                        status=200, end_s=times[-1])
    return rec.finalize(sample_rate)


def test_a_gap_is_a_text_stall_when_the_audio_had_covered_the_text_sent():
    # 4 s of audio for 100 characters; the player starts at 0.5 s with 1 s of audio and runs dry at 1.5 s.
    rec = _record([0.5, 2.0, 2.5], [1.0, 1.0, 2.0])
    assert rec.underrun_s == pytest.approx(0.5)
    waiting = StreamTextRecord([0.0, 1.8], [25, 100])  # at 1.5 s only 25 chars (1 s of audio) had been sent
    split_stalls(rec, waiting, 1000)
    assert (waiting.text_stall_s, waiting.engine_underrun_s) == (pytest.approx(0.5), 0.0)
    fed = StreamTextRecord([0.0, 0.1], [25, 100])  # all the text was there: the engine was late
    split_stalls(rec, fed, 1000)
    assert (fed.text_stall_s, fed.engine_underrun_s) == (0.0, pytest.approx(0.5))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    loaded = tiny_loaded(tmp_path_factory.mktemp("bench-st-models"), "custom_voice")
    client = local_client(loaded, frames_per_text_token=2.0)
    app = build_app(client, server_settings(loaded, default_max_new_tokens=40, max_new_tokens_limit=512))
    with LiveServer(app) as live:
        yield live, client.info.speakers[0]


def _requests(voice: str) -> list[BenchRequest]:
    return [BenchRequest(f"u{i}", {"input": t, "voice": voice, "seed": i, "max_new_tokens": 24}, len(t), None)
            for i, t in enumerate(TEXTS)]


def test_the_bench_streams_text_and_measures_from_the_first_token(server):
    live, voice = server
    cfg = ClientConfig(base_url=live.url, max_concurrency=2, num_warmups=1, timeout_s=120, progress=False)
    feed = TextFeed(tokens_per_s=200.0)
    out, extras = asyncio.run(run_stream_text(cfg, feed, _requests(voice)))
    assert [r.ok for r in out.records] == [True, True], [(r.error_kind, r.error) for r in out.records]
    for rec in out.records:
        ex = extras[rec.index]
        assert rec.ttfp_s is not None and rec.ttfp_s > 0 and rec.audio_s > 0
        assert ex.text_chars[-1] == len(TEXTS[rec.index]) and len(ex.text_times_s) == len(text_tokens(TEXTS[rec.index]))
        assert ex.text_times_s[-1] >= (len(ex.text_times_s) - 1) / 200.0 - 1e-3  # paced, not sent at once
        assert ex.text_stall_s + ex.engine_underrun_s == pytest.approx(rec.underrun_s, abs=1e-9)
    summary = stream_text_summary(feed, out.records, extras)
    assert summary["completed"] == 2 and summary["cancelled"] == 0


def test_fixed_lengths_go_in_the_session_and_every_context_runs_exactly_that_long(server):
    """`num_frames` with `ignore_eos` (what --fixed-length sends over HTTP) are session fields too: each context
    runs exactly that many frames, past its closed text, so streamed text compares with HTTP at equal lengths."""
    live, voice = server
    cfg = ClientConfig(base_url=live.url, max_concurrency=2, timeout_s=120, progress=False)
    reqs = [BenchRequest(f"f{i}", {"input": t, "voice": voice, "seed": i, "ignore_eos": True, "num_frames": n},
                         len(t), n) for i, (t, n) in enumerate(zip(TEXTS, (9, 30), strict=True))]
    out, _ = asyncio.run(run_stream_text(cfg, TextFeed(tokens_per_s=math.inf), reqs))
    assert [r.ok for r in out.records] == [True, True], [(r.error_kind, r.error) for r in out.records]
    for rec, n in zip(out.records, (9, 30), strict=True):
        assert rec.audio_s == pytest.approx(n * 0.08), rec.utt_id


def test_a_barge_in_cancel_is_acknowledged_and_timed(server):
    live, voice = server
    cfg = ClientConfig(base_url=live.url, max_concurrency=1, timeout_s=120, progress=False)
    feed = TextFeed(tokens_per_s=math.inf, cancel_after_s=0.0)  # cancel at the first audio
    out, extras = asyncio.run(run_stream_text(cfg, feed, _requests(voice)))
    assert all(r.ok for r in out.records), [(r.error_kind, r.error) for r in out.records]
    summary = stream_text_summary(feed, out.records, extras)
    assert summary["cancelled"] == 2 and summary["cancel_ack_ms"]["n"] == 2
    # Their stalls are not split by cause, and the summary says of how many requests it counts stalls
    assert summary["uncancelled"] == 0 and summary["requests_with_engine_underruns"] == 0
    assert "of 0 uncancelled requests" in summary_line(summary) and "not split" in summary_line(summary)
    assert all(extras[r.index].cancel_ack_s >= 0 for r in out.records)
    metrics = __import__("httpx").get(f"{live.url}/metrics", timeout=30).text
    assert "legato_ws_cancels_total 2.0" in metrics


def test_a_refused_session_fails_the_request_with_the_servers_reason(server):
    live, _ = server
    cfg = ClientConfig(base_url=live.url, max_concurrency=1, timeout_s=60, progress=False)
    bad = [BenchRequest("u0", {"input": "Hello there.", "voice": "nobody-by-this-name"}, 12, None)]
    out, _ = asyncio.run(run_stream_text(cfg, TextFeed(), bad))
    rec = out.records[0]
    assert not rec.ok and rec.error_kind.startswith("ws_") and "nobody-by-this-name" in rec.error


def test_a_session_at_another_sample_rate_than_the_benchs_fails_its_requests(server):
    """As over HTTP: a --sample-rate other than the session's (session.updated says it) would give audio seconds off
    by the ratio (an outside probe saw 0.36 s reported for 0.24 s)."""
    live, voice = server
    cfg = ClientConfig(base_url=live.url, max_concurrency=1, timeout_s=60, progress=False, sample_rate=16000)
    out, _ = asyncio.run(run_stream_text(cfg, TextFeed(), _requests(voice)))
    assert {r.error_kind for r in out.records} == {"sample_rate_mismatch"}
    assert "streams 24000 Hz PCM and --sample-rate is 16000" in out.records[0].error


def test_options_the_websocket_cannot_honour_are_refused_before_any_request(capsys):
    from legato.cli import main

    for extra in (["--client-procs", "2"],):
        # port 9 (discard): nothing listens, so reaching the server would fail differently
        code = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--stream-text", *extra, "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and "--stream-text" in err and "error" in err, err


def test_text_pace_options_without_stream_text_are_refused_not_ignored(capsys):
    """A walkthrough ran `bench serve --text-rate 10` without --stream-text: the HTTP run went ahead at no text
    pace and said nothing of the flag it had dropped (--cancel-after: test_bench_client)."""
    from legato.cli import main

    for extra, said in ((["--text-rate", "10"], "--text-rate applies"),
                        (["--token-chars", "3", "--text-rate", "inf"], "--text-rate and --token-chars apply")):
        # port 9 (discard): nothing listens, so reaching the server would fail differently
        code = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *extra, "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and f"{said} to streaming text only: add --stream-text" in err, err


def test_sessions_over_the_servers_message_cap_are_refused_before_any_request(server, tmp_path, capsys):
    """A walkthrough's `bench serve --stream-text` on a Base model failed every request (its clips inline, ~200 KB,
    against 64 KiB). The server says its cap in /v1/models; the bench compares before it sends anything."""
    import httpx

    from legato.cli import main

    live, voice = server
    assert httpx.get(f"{live.url}/v1/models", timeout=30).json()["data"][0]["ws_max_message_bytes"] == 65536
    big = '{"voice": "' + voice + '", "speaker_embedding_note": "' + "x" * 70_000 + '"}'
    code = main(["bench", "serve", "--base-url", live.url, "--stream-text", "--no-progress", "--num-prompts", "2",
                 "--voice", voice, "--extra-body", big, "--result-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "the server takes at most 65536 (--ws-max-message-bytes)" in err, err
    assert "--voice NAME" in err and not list(tmp_path.iterdir())
