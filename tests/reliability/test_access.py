"""Who may call the server: API keys (401 in OpenAI's shape; the OpenAI SDK's `api_key=` works unchanged),
the Host a request names (DNS rebinding), web origins (cross-site form posts, CORS off unless configured),
and one request per request id (409)."""

from __future__ import annotations

import argparse
import asyncio

import openai
import pytest
from fastapi.testclient import TestClient
from server_helpers import FakeClient, frames_chunk, server_settings

from legato.server.access import load_api_keys
from legato.server.app import build_app
from legato.server.cli import access_settings

KEY = "sk-test-0123456789"
SPEECH = {"input": "Hello there.", "voice": "ryan", "stream": False}


def one_frame(req):
    return [frames_chunk(1, 1, True, "stop")]


def app(script=one_frame, **settings) -> TestClient:
    return TestClient(build_app(FakeClient(script), server_settings(**settings), None))


def assert_error(resp, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code and err["message"] and err["type"], err


def test_api_key_on_every_route_but_health_and_metrics():
    with app(api_keys=(KEY, "sk-second")) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200  # as vLLM: scrapers send no key (--protect-metrics closes it)
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/audio/speech"),
                             ("GET", "/v1/audio/voices"), ("GET", "/docs"), ("GET", "/nowhere")):
            resp = c.request(method, path, json=SPEECH if method == "POST" else None)
            assert_error(resp, 401, "invalid_api_key")
            assert resp.headers["www-authenticate"] == "Bearer"
        for bad in ("Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x", "Bearer "):
            assert_error(c.get("/v1/models", headers={"Authorization": bad}), 401, "invalid_api_key")
        for good in (KEY, "sk-second"):
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {good}"}).status_code == 200
        resp = c.post("/v1/audio/speech", json=SPEECH, headers={"Authorization": f"bearer {KEY}"})
        assert resp.status_code == 200 and resp.content


def test_the_openai_sdk_sends_its_api_key_as_we_expect():
    with app(api_keys=(KEY,)) as c:
        for key, status in ((KEY, 200), ("sk-wrong", 401)):
            sdk = openai.OpenAI(api_key=key, base_url="http://testserver/v1", http_client=c, max_retries=0)
            try:
                audio = sdk.audio.speech.create(model="fake", voice="ryan", input="Hi.", response_format="wav")
                got = 200 if audio.content[:4] == b"RIFF" else -1
            except openai.AuthenticationError as e:
                got = e.status_code
            assert got == status


def test_api_keys_from_flags_a_file_and_the_environment(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nsk-a\n\n  sk-b  \nsk-a\n")
    assert load_api_keys(["sk-c"], str(keys)) == ("sk-c", "sk-a", "sk-b")
    for bad in ("", "two words", "tab\tkey"):
        with pytest.raises(ValueError, match="API key"):
            load_api_keys([bad])
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys([], str(tmp_path / "missing"))
    # a comment after a key, as --help's "(# comments)" reads; a bad line named by file and number (a walkthrough
    # got "an API key must be ..." naming neither)
    keys.write_text("sk-a  # the team's\nsk-x#y\n  sk-two words\n")
    with pytest.raises(ValueError, match=f"--api-key-file {keys} line 3: an API key must be"):
        load_api_keys([], str(keys))
    keys.write_text("sk-a  # the team's\nsk-x#y\n")
    assert load_api_keys([], str(keys)) == ("sk-a", "sk-x#y")
    keys.write_text("# keys go here\n\n")  # asked for keys and given none: not a server open to all
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys(["sk-c"], str(keys))
    monkeypatch.setenv("LEGATO_API_KEY", "sk-env")
    args = argparse.Namespace(api_key=["sk-c"], api_key_file=None, allowed_origins="", allowed_hosts=None,
                              host="127.0.0.1")
    got = access_settings(args)
    assert got["api_keys"] == ("sk-c", "sk-env")
    assert set(got["allowed_hosts"]) >= {"localhost", "127.0.0.1", "::1"}
    assert access_settings(argparse.Namespace(**{**vars(args), "host": "0.0.0.0"}))["allowed_hosts"] is None
    with pytest.raises(ValueError, match="not an origin"):
        access_settings(argparse.Namespace(**{**vars(args), "allowed_origins": "evil"}))


def test_cross_site_form_posts_are_refused():
    with app() as c:
        form = {"name": "x"}
        for origin in ("https://evil.example", "null", "http://127.0.0.1.evil.example"):
            assert_error(c.post("/v1/audio/voices", data=form, headers={"Origin": origin}), 403,
                         "origin_not_allowed")
            assert_error(c.post("/v1/audio/speech", json=SPEECH, headers={"Origin": origin}), 403,
                         "origin_not_allowed")
        # no CORS unless configured: a preflight is refused, and no response grants an origin
        pre = c.options("/v1/audio/speech", headers={"Origin": "https://app.example",
                                                     "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
        # our own pages (the API docs) and clients that are not browsers still work
        assert c.post("/v1/audio/speech", json=SPEECH, headers={"Origin": "http://testserver"}).status_code == 200
        assert c.post("/v1/audio/speech", json=SPEECH).status_code == 200


def test_allowed_origins_get_cors_and_others_do_not():
    with app(allowed_origins=("https://app.example",), api_keys=(KEY,)) as c:
        pre = c.options("/v1/audio/speech", headers={"Origin": "https://app.example",
                                                     "Access-Control-Request-Method": "POST",
                                                     "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        auth = {"Authorization": f"Bearer {KEY}"}
        ok = c.post("/v1/audio/speech", json=SPEECH, headers={"Origin": "https://app.example", **auth})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-request-id" in ok.headers["access-control-expose-headers"].lower()
        assert_error(c.post("/v1/audio/speech", json=SPEECH, headers={"Origin": "https://other.example", **auth}),
                     403, "origin_not_allowed")


def test_cors_lets_an_allowed_page_send_the_openai_sdks_own_headers():
    """OpenAI's JavaScript SDK in a browser sends x-stainless-* headers beside Authorization: the preflight of an
    allowed origin must grant them, or every call from such a page fails before it is sent."""
    asked = "authorization,content-type,x-stainless-os,x-stainless-lang,x-stainless-retry-count"
    with app(allowed_origins=("https://app.example",)) as c:
        pre = c.options("/v1/audio/speech", headers={"Origin": "https://app.example",
                                                     "Access-Control-Request-Method": "POST",
                                                     "Access-Control-Request-Headers": asked})
        assert pre.status_code == 200, pre.text
        granted = {h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
        assert set(asked.split(",")) <= granted, granted
        other = c.options("/v1/audio/speech", headers={"Origin": "https://other.example",
                                                       "Access-Control-Request-Method": "POST",
                                                       "Access-Control-Request-Headers": asked})
        assert other.status_code != 200 and "access-control-allow-origin" not in other.headers


def test_cors_exposes_every_header_a_speech_response_sets():
    """A page of an allowed origin reads what a script reads: a walkthrough found the whole file's usage headers
    (`X-Usage-*`, which the README promises with `stream: false`) hidden from it by the expose list."""
    origin = {"Origin": "https://app.example"}
    with app(allowed_origins=("https://app.example",)) as c:
        for body in (SPEECH, {**SPEECH, "stream": True, "response_format": "pcm"}):
            resp = c.post("/v1/audio/speech", json=body, headers=origin)
            assert resp.status_code == 200, resp.text
            exposed = {h.strip().lower() for h in resp.headers["access-control-expose-headers"].split(",")}
            ours = {h for h in resp.headers if h.startswith("x-") or h == "retry-after"}
            assert "x-usage-total-tokens" in ours or body["stream"]
            assert ours <= exposed, ours - exposed


def test_host_check_refuses_rebound_names():
    with app(allowed_hosts=("localhost", "127.0.0.1", "::1")) as c:
        for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
            assert c.get("/v1/models", headers={"Host": host}).status_code == 200
        for host in ("attacker.example", "attacker.example:8000", "127.0.0.1.nip.io", ""):
            assert_error(c.get("/v1/models", headers={"Host": host}), 400, "invalid_host")


def test_host_check_refuses_a_request_with_two_host_headers():
    """An outside probe sent `Host: 127.0.0.1` then `Host: evil.example` and got 200 (the first was read)."""
    from legato.server.access import HostCheck

    async def main():
        sent: list[dict] = []
        called: list[bool] = []

        async def inner(scope, receive, send):
            called.append(True)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": [
            (b"host", b"127.0.0.1"), (b"Host", b"evil.example")]}
        await HostCheck(inner, ["127.0.0.1"])(scope, receive, send)
        return sent, called

    sent, called = asyncio.run(main())
    assert not called and sent[0]["status"] == 400
    assert b"2 Host headers" in b"".join(m.get("body", b"") for m in sent[1:])


def test_duplicate_request_id_in_flight_is_409():
    def slow(req):
        return [frames_chunk(1, 1), 1.0, frames_chunk(1, 2, True, "stop")]

    with app(slow) as c:
        # a raw stream holds its id until it ends; a second request with that id meanwhile is a conflict
        with c.stream("POST", "/v1/audio/speech", json={**SPEECH, "stream": True, "response_format": "pcm"},
                      headers={"X-Request-Id": "dup-1"}) as first:
            assert first.status_code == 200
            assert_error(c.post("/v1/audio/speech", json=SPEECH, headers={"X-Request-Id": "dup-1"}), 409,
                         "duplicate_request_id")
            body = b"".join(first.iter_bytes())
        assert body
        # once it ended the id is free again, and a refused request never holds it
        assert c.post("/v1/audio/speech", json=SPEECH, headers={"X-Request-Id": "dup-1"}).status_code == 200
        refused = c.post("/v1/audio/speech", json={**SPEECH, "speed": 2.0}, headers={"X-Request-Id": "d2"})
        assert refused.status_code == 400
        assert c.post("/v1/audio/speech", json=SPEECH, headers={"X-Request-Id": "d2"}).status_code == 200


@pytest.mark.parametrize("field,value", [("stream", "yes"), ("stream", 1), ("speed", True), ("seed", "3"),
                                         ("seed", 3.0), ("ignore_eos", "false"), ("temperature", "0.5")])
def test_loose_coercion_is_refused(field, value):
    with app() as c:
        resp = c.post("/v1/audio/speech", json={**SPEECH, field: value})
        assert resp.status_code == 400 and field in resp.json()["error"]["message"], resp.text


def test_the_bench_client_sends_its_api_key():
    from server_helpers import LiveServer

    from legato.bench.client import ClientConfig, run_benchmark
    from legato.bench.datasets import BenchRequest

    def frames(req):
        return [frames_chunk(1, 1), frames_chunk(1, 2, True, "stop")]

    reqs = [BenchRequest("u0", {"input": "Hi.", "voice": "ryan", "num_frames": 2, "ignore_eos": True}, 3, 2)]
    app = build_app(FakeClient(frames), server_settings(api_keys=(KEY,)), None)
    with LiveServer(app) as srv:
        for key, status in ((KEY, 200), (None, 401)):
            cfg = ClientConfig(base_url=srv.url, progress=False, api_key=key)
            (rec,) = asyncio.run(run_benchmark(cfg, reqs)).records
            assert rec.status == status and rec.ok == (status == 200), rec.error


def test_metrics_are_open_with_an_api_key_unless_protected():
    with app(api_keys=(KEY,)) as c:
        scraped = c.get("/metrics")
        assert scraped.status_code == 200 and "vllm:num_requests_running" in scraped.text
        assert_error(c.get("/metrics/", headers={}), 401, "invalid_api_key")  # only the exact path is open
    with app(api_keys=(KEY,), protect_metrics=True) as c:
        assert_error(c.get("/metrics"), 401, "invalid_api_key")
        assert c.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    args = argparse.Namespace(api_key=[KEY], api_key_file=None, allowed_origins="", allowed_hosts=None,
                              host="127.0.0.1", protect_metrics=True)
    assert access_settings(args)["protect_metrics"] is True


@pytest.mark.parametrize("host", ["localhost:1@evil.example", "localhost@evil.example", "user@localhost",
                                  "localhost:8000:9000", "localhost:99999", "localhost:80x", "localhost evil",
                                  "[::1", "[::1]x", "[::1]:8000@evil.example", "[evil.example]", "::1",
                                  "localhost/evil", "localhost%2f", "127.0.0.1:-1", "localhost\\@evil.example"])
def test_host_check_parses_the_authority(host):
    with app(allowed_hosts=("localhost", "127.0.0.1", "::1")) as c:
        assert_error(c.get("/v1/models", headers={"Host": host}), 400, "invalid_host")


@pytest.mark.parametrize("host", ["LOCALHOST", "localhost:", "localhost:65535", "127.0.0.1:0", "[::1]", "[::1]:1",
                                  "[0:0:0:0:0:0:0:1]:8000"])
def test_host_check_takes_every_spelling_of_an_allowed_authority(host):
    with app(allowed_hosts=("localhost", "127.0.0.1", "::1")) as c:
        assert c.get("/v1/models", headers={"Host": host}).status_code == 200
