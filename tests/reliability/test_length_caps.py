"""Which cap ends a request, and that the caps agree (issue 20): a 4,096-character input ended `length` at
2,047 frames (`--default-max-new-tokens 2048`) while its text's frame cap allowed more, and nothing said
which limit had cut it. Now a request that asks for no length runs to its text's frame cap (or the room
under --max-model-len), and a request cut short names the cap: `X-Length-Cap`, the SSE done event, the log.

The engine runs with small caps (one frame per text token) and `ignore_eos`, so a request runs to its cap
and no assertion depends on when a random model samples EOS."""

from __future__ import annotations

import json

import pytest
from server_helpers import FakeClient, engine_config, frames_chunk, local_client, server_settings, tiny_loaded
from starlette.testclient import TestClient

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.inputs import SpeechInput
from legato.server.app import build_app
from legato.server.prompt_limit import PromptLimit
from legato.server.settings import ServerSettings

TEXT = "Hello there, this is a test of the frame caps."
LONG = ("The weather report says it will rain heavily over the coast this evening. " * 60)[:4096]
SMALL_CAPS = dict(frames_per_text_token=1.0, frame_cap_margin=2)


@pytest.fixture(scope="module")
def cv(tmp_path_factory):
    return tiny_loaded(tmp_path_factory.mktemp("caps"), "custom_voice")


def serve(cv, settings: ServerSettings, **engine_kw) -> TestClient:
    config = engine_config(**engine_kw)
    limit = PromptLimit.for_model(cv.text_tokenizer, cv.config, settings, config)
    return TestClient(build_app(local_client(cv, **engine_kw), settings, None, prompt_limit=limit))


def sizes(cv, text: str) -> tuple[int, int]:
    return PromptLimit(cv.text_tokenizer, cv.config, 1 << 20).sizes(SpeechInput(text, speaker="ryan"))


def speak(c: TestClient, **body):
    return c.post("/v1/audio/speech", json={"input": TEXT, "voice": "ryan", "response_format": "pcm",
                                            "stream": False, "ignore_eos": True, **body})


def test_the_default_server_lets_the_largest_input_run_to_its_text_cap(cv):
    """The issue's case, with the shipped defaults: no fixed 2,048-token default cuts below the text's cap."""
    seen = []
    settings = server_settings(cv, default_max_new_tokens=None, max_new_tokens_limit=4096, max_input_chars=4096)
    assert ServerSettings().default_max_new_tokens is None  # the shipped default
    client = FakeClient(lambda req: seen.append(req) or [frames_chunk(1, req.sampling.max_new_tokens - 1, True,
                                                                      "length")])
    limit = PromptLimit.for_model(cv.text_tokenizer, cv.config, settings, EngineConfig())
    with TestClient(build_app(client, settings, None, prompt_limit=limit)) as c:
        r = c.post("/v1/audio/speech", json={"input": LONG, "voice": "ryan", "response_format": "pcm",
                                             "stream": False})
    assert r.status_code == 200, r.text
    prompt, text = sizes(cv, LONG)
    cap = EngineConfig().frame_cap_for(text)
    assert cap > 2047 and seen[0].sampling.max_new_tokens - 1 == cap and seen[0].max_frames is None
    assert r.headers["x-finish-reason"] == "length" and r.headers["x-length-cap"] == "frame_cap"


def test_a_request_cut_by_its_text_cap_says_so(cv, caplog):
    settings = server_settings(cv, default_max_new_tokens=None)
    _, text = sizes(cv, TEXT)
    cap = engine_config(**SMALL_CAPS).frame_cap_for(text)
    with caplog.at_level("INFO", logger="legato.server.streaming"), serve(cv, settings, **SMALL_CAPS) as c:
        r = speak(c, stream=False)
        sse = c.post("/v1/audio/speech", json={"input": TEXT, "voice": "ryan", "ignore_eos": True,
                                               "stream_format": "sse", "response_format": "pcm"})
    assert r.status_code == 200 and r.headers["x-finish-reason"] == "length"
    assert r.headers["x-length-cap"] == "frame_cap" and r.headers["x-usage-output-tokens"] == str(cap)
    done = json.loads(sse.text.strip().split("\n\n")[-1][len("data: "):])
    assert done["finish_reason"] == "length" and done["length_cap"] == "frame_cap"
    assert done["usage"]["output_tokens"] == cap
    cut = [r.getMessage() for r in caplog.records if "ended 'length'" in r.getMessage()]
    assert len(cut) == 2 and all(f"at {cap} frames: cut by the text's frame cap" in m for m in cut), cut


@pytest.mark.parametrize("asked, default, expect", [
    ({"max_new_tokens": 5}, None, ("max_new_tokens", 4)),
    ({}, 6, ("default_max_new_tokens", 5)),
    ({"num_frames": 3, "ignore_eos": False}, None, ("num_frames", 3)),
    ({"num_frames": 3}, None, ("num_frames", 3)),  # an exact length: the cap is what it asked for
])
def test_each_cap_is_named_when_it_cuts(cv, asked, default, expect):
    settings = server_settings(cv, default_max_new_tokens=default)
    with serve(cv, settings, **SMALL_CAPS) as c:
        r = speak(c, **asked)
    assert r.status_code == 200, r.text
    assert (r.headers["x-length-cap"], int(r.headers["x-usage-output-tokens"])) == expect


def test_the_room_under_max_model_len_is_a_cap_not_a_refusal(cv):
    prompt, _ = sizes(cv, TEXT)
    settings = server_settings(cv, default_max_new_tokens=None)
    with serve(cv, settings, frames_per_text_token=None, max_model_len=prompt + 6) as c:
        r = speak(c)
        over = speak(c, input=TEXT + " And some more words to push the prompt past the model length.")
    assert r.status_code == 200, r.text
    assert r.headers["x-length-cap"] == "max_model_len" and r.headers["x-usage-output-tokens"] == "6"
    assert over.status_code == 400 and over.json()["error"]["code"] == "prompt_too_long", over.text
    assert "leaves no frame under --max-model-len" in over.json()["error"]["message"]


def test_a_request_that_ends_by_itself_names_no_cap(cv):
    settings = server_settings(cv, default_max_new_tokens=None)
    client = FakeClient(lambda req: [frames_chunk(1, 1, True, "stop")])
    limit = PromptLimit.for_model(cv.text_tokenizer, cv.config, settings, EngineConfig())
    with TestClient(build_app(client, settings, None, prompt_limit=limit)) as c:
        r = speak(c)
    assert r.status_code == 200 and r.headers["x-finish-reason"] == "stop" and "x-length-cap" not in r.headers
