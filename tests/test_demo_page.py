"""The `/demo` page (speak as you type): served by the app, and driven in a real headless Chromium against a live
server with the tiny model. Typing sends whole words to the streaming-text WebSocket and audio comes back while
the text is still open; Speak ends the text and the context finishes; Stop cancels a context that is still
waiting for text, and the server frees it."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from browser_helpers import Browser, find_browser
from server_helpers import LiveServer, local_client, server_settings, tiny_loaded

from legato.server.app import DEMO_PATH, build_app


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return tiny_loaded(tmp_path_factory.mktemp("demo-models"), "custom_voice")


@pytest.fixture
def app(loaded):  # one per test: an app's lifespan stops its engine client when the app's server stops
    client = local_client(loaded, frames_per_text_token=2.0)
    return build_app(client, server_settings(loaded, default_max_new_tokens=40, max_new_tokens_limit=512))


def test_the_demo_page_is_served_as_html_that_uses_the_streaming_socket(app):
    from fastapi.testclient import TestClient

    with TestClient(app) as http:
        page = http.get(DEMO_PATH)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for needle in ("/v1/audio/speech/stream", "input_text.append", "input_text.end", "response.cancel",
                   'id="speak"', 'id="stop"', 'id="instructions"'):
        assert needle in page.text


def _type(words: list[str]) -> str:
    """JavaScript that types `words` into the text box one by one, each followed by an input event."""
    return ("(() => { const t = document.getElementById('text'); for (const w of " + json.dumps(words) +
            ") { t.value += w; t.dispatchEvent(new Event('input')); } return true; })()")


@pytest.mark.skipif(find_browser() is None, reason="no Chromium on this machine (CI installs Debian's chromium; "
                                                   "or set LEGATO_CHROMIUM)")
def test_the_demo_speaks_as_you_type_and_stops_in_a_real_browser(app):
    with LiveServer(app) as live:
        async def main() -> None:
            async with Browser(find_browser()) as browser:
                page = await browser.open(f"{live.url}{DEMO_PATH}")
                await page.until("window.legatoDemo && window.legatoDemo.state === 'ready'", "the session is ready")
                # Typing: whole words go out and are spoken while the text is still open.
                await page.eval(_type(["Typing ", "a ", "sentence ", "that ", "is ", "heard ", "as "]))
                await page.until("window.legatoDemo.audioBytes > 0", "audio before the text ends")
                await page.eval(_type(["it ", "goes."]) + " && document.getElementById('speak').click()")
                await page.until("window.legatoDemo.done === 1", "the first context finishes")
                # Stop: a context still waiting for text is cancelled, and the server says how much it sent.
                heard = await page.eval("window.legatoDemo.audioBytes")
                await page.eval(_type(["Then ", "the ", "user ", "interrupts ", "this "]))
                await page.until(f"window.legatoDemo.audioBytes > {heard}", "audio of the second context")
                await page.eval("document.getElementById('stop').click()")
                await page.until("window.legatoDemo.cancelled === 1", "the cancel")
                state = await page.eval("JSON.stringify(window.legatoDemo)")
                assert json.loads(state)["errors"] == [], state

        asyncio.run(main())
        # The browser is gone: the server winds its socket down (polled, with a deadline), nothing left behind.
        deadline = time.monotonic() + 60
        while "legato_ws_open_sockets 0.0" not in (metrics := httpx.get(f"{live.url}/metrics", timeout=30).text):
            assert time.monotonic() < deadline, "the server did not finish the browser's socket"
            time.sleep(0.05)
    assert "legato_ws_cancels_total 1.0" in metrics
    assert "legato_ws_contexts 0.0" in metrics


@pytest.mark.skipif(find_browser() is None, reason="no Chromium on this machine (CI installs Debian's chromium; "
                                                   "or set LEGATO_CHROMIUM)")
def test_the_demo_speaks_a_voice_design_model_in_the_voice_its_description_names(tmp_path_factory):
    """A VoiceDesign model has no voices, and a request without instructions is refused: the page shows the
    description field instead of the voice list and sends it with the session, so typing is spoken there too."""
    loaded = tiny_loaded(tmp_path_factory.mktemp("demo-design"), "voice_design")
    client = local_client(loaded, frames_per_text_token=2.0)
    app = build_app(client, server_settings(loaded, default_max_new_tokens=40, max_new_tokens_limit=512))
    with LiveServer(app) as live:
        async def main() -> dict:
            async with Browser(find_browser()) as browser:
                page = await browser.open(f"{live.url}{DEMO_PATH}")
                await page.until("window.legatoDemo && window.legatoDemo.state === 'ready'", "the session is ready")
                shown = await page.eval("[document.getElementById('design').hidden, "
                                        "document.getElementById('voice').closest('label').hidden]")
                assert shown == [False, True], shown  # the description instead of an empty voice list
                await page.eval(_type(["A ", "voice ", "from ", "its ", "description."]) +
                                " && document.getElementById('speak').click()")
                await page.until("window.legatoDemo.done === 1 || window.legatoDemo.errors.length > 0",
                                 "the context finishes")
                return json.loads(await page.eval("JSON.stringify(window.legatoDemo)"))

        state = asyncio.run(main())
    assert state["errors"] == [] and state["done"] == 1 and state["audioBytes"] > 0, state
    assert state["taskType"] == "VoiceDesign"
