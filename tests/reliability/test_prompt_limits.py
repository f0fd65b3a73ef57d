"""One small request must not stall every other: the prompt-token limit and fair prefill.

An outside probe sent 4,096 emoji (within the 4,096-character input limit): a 16,394-token prompt that took
45 s of prefill on the CPU while a concurrent 2-frame request waited 47 s. The limit refuses such a prompt
in the server before the engine sees it (and again at engine admission); fair prefill keeps a short request
admitted behind a long prompt from waiting for all of it. Run with -s to see the measured figures.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from server_helpers import local_client, server_settings, tiny_loaded
from starlette.testclient import TestClient

from legato.engine.engine import Engine, EngineRequest
from legato.engine.scheduler import RequestTooLargeError
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.loader import load_model
from legato.models.qwen3_tts.prompt import default_max_prompt_tokens, prompt_length
from legato.models.qwen3_tts.prompt_build import build_prompt
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.models.qwen3_tts.testing import write_checkpoint
from legato.models.qwen3_tts.tiny import tiny_config
from legato.server.app import build_app
from legato.server.prompt_limit import PromptLimit
from legato.server.settings import ServerSettings

EMOJI = "😀" * 4096
# 4,096 characters of ordinary English (the bench prompts' style): the largest legitimate input.
PLAIN = ("The weather report says it will rain heavily over the coast this evening. " * 60)[:4096]


@pytest.fixture(scope="module")
def cv(tmp_path_factory):
    return tiny_loaded(tmp_path_factory.mktemp("limits"), "custom_voice")


def _spy(client):
    """Records the requests that reach the engine client."""
    seen: list[str] = []
    generate = client.generate

    def counted(req):
        seen.append(req.request_id)
        return generate(req)

    client.generate = counted
    return seen


# ---- the limit ---------------------------------------------------------------------------------------

def test_the_default_limit_fits_the_largest_legitimate_request():
    settings = ServerSettings()
    assert settings.prompt_token_limit("custom_voice", "0b6") == 3 * 4096 + 16 == 12304
    assert settings.prompt_token_limit("custom_voice", "1b7") == 2 * 3 * 4096 + 16
    assert settings.prompt_token_limit("voice_design", "1b7") == 2 * 3 * 4096 + 16
    assert settings.prompt_token_limit("base", "0b6") == 2 * 3 * 4096 + 750 + 16
    assert ServerSettings(max_prompt_tokens=6000).prompt_token_limit("base", "0b6") == 6000
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        ServerSettings(max_prompt_tokens=0)


def test_4096_emoji_are_refused_by_the_server_before_the_engine_sees_them(cv):
    settings = server_settings(cv)
    client = local_client(cv)
    seen = _spy(client)
    limit = PromptLimit.for_model(cv.text_tokenizer, cv.config, settings)
    with TestClient(build_app(client, settings, None, prompt_limit=limit)) as c:
        started = time.perf_counter()
        r = c.post("/v1/audio/speech", json={"input": EMOJI, "voice": "ryan", "response_format": "pcm"})
        refused_s = time.perf_counter() - started
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "prompt_too_long" and err["param"] == "input"
        assert err["message"] == "prompt is 16394 tokens; the limit is 12304 (--max-prompt-tokens)"
        assert seen == []
        ok = c.post("/v1/audio/speech", json={"input": PLAIN[:40], "voice": "ryan", "response_format": "pcm",
                                                "num_frames": 2, "ignore_eos": True})
        assert ok.status_code == 200 and len(seen) == 1
    print(f"\n4096 emoji: 400 prompt_too_long in {refused_s * 1000:.1f} ms (16394 tokens > 12304)")


def test_the_largest_plain_input_fits_the_default_limit(cv):
    limit = PromptLimit.for_model(cv.text_tokenizer, cv.config, ServerSettings())
    n = limit.count(SpeechInput(PLAIN, speaker="ryan"))
    print(f"\n4096 plain characters: {n} prompt tokens (limit {limit.limit})")
    assert n <= limit.limit
    limit.check(SpeechInput(PLAIN, speaker="ryan"))


# Text of the model's languages that the tiny model's vocabulary does not merge (it has English merges only):
# the tokenizer's worst case. 'Привет' * 700 cut to 4,096 characters was 8,202 tokens against a limit of 4,112.
RANDOM = np.random.default_rng(20)
SCRIPTS = {
    "cyrillic": ("Привет" * 700)[:4096],
    "cyrillic-random": "".join(map(chr, RANDOM.integers(0x0400, 0x0500, 4096))),
    "cjk": ("你好世界今天天气很好" * 410)[:4096],
    "cjk-rare": "".join(map(chr, RANDOM.integers(0x4E00, 0xA000, 4096))),
    "hangul": ("가나다라마바사" * 586)[:4096],
    "hangul-random": "".join(map(chr, RANDOM.integers(0xAC00, 0xD7A4, 4096))),
    "kana": "".join(map(chr, RANDOM.integers(0x3041, 0x30FF, 4096))),
    "latin-accents": "".join(map(chr, RANDOM.integers(0x00C0, 0x0250, 4096))),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_text_of_every_script_at_the_character_limit_fits_the_default_limit(cv, script):
    from server_helpers import FakeClient, frames_chunk

    settings = server_settings(cv, max_input_chars=4096)
    text = SCRIPTS[script]
    assert len(text) == 4096
    limit = PromptLimit.for_model(cv.text_tokenizer, cv.config, settings)
    n = limit.count(SpeechInput(text, speaker="ryan"))
    assert n <= limit.limit
    if script in ("cyrillic", "hangul"):  # the worst case is really exercised: 2 and ~3 tokens a character
        assert n > (2 if script == "cyrillic" else 2.8) * len(text)
    reached = []  # the front passes it on (the engine's admission holds the same count: tests below)
    client = FakeClient(lambda req: reached.append(req) or [frames_chunk(1, 1, True, "stop")])
    with TestClient(build_app(client, settings, None, prompt_limit=limit)) as c:
        r = c.post("/v1/audio/speech", json={"input": text, "voice": "ryan", "response_format": "pcm",
                                             "stream": False})
    assert r.status_code == 200 and len(reached) == 1, r.text


def test_the_engine_refuses_an_over_limit_prompt_at_admission(cv):
    from server_helpers import engine_config

    engine = Engine(cv, engine_config(max_prompt_tokens=4112, max_model_len=32768, num_kv_blocks=2048))
    spec = build_spec(cv, SpeechInput(EMOJI, speaker="ryan"))
    with pytest.raises(RequestTooLargeError, match=r"prompt is 16394 tokens; the limit is 4112"):
        engine.add_request(EngineRequest("emoji", spec, SamplingParams(seed=0)))
    assert not engine.has_unfinished()


def test_without_a_front_check_the_engine_refusal_is_a_400(cv):
    settings = server_settings(cv)
    with TestClient(build_app(local_client(cv, max_prompt_tokens=4112, max_model_len=32768, num_kv_blocks=2048),
                              settings)) as c:
        r = c.post("/v1/audio/speech", json={"input": EMOJI, "voice": "ryan", "response_format": "pcm"})
    assert r.status_code == 400 and "prompt is 16394 tokens; the limit is 4112" in r.json()["error"]["message"]


# ---- the count equals the engine's prompt -------------------------------------------------------------

def _cv_large(root):
    return load_model(write_checkpoint(root / "cv-1b7", tiny_config("custom_voice", size="1b7")))


@pytest.mark.parametrize("model, inp", [
    ("custom_voice", SpeechInput("Hello there, how are you?", speaker="ryan")),
    ("custom_voice", SpeechInput("Hello there.", speaker="ryan", language="english", non_streaming_mode=False)),
    ("custom_voice", SpeechInput("你好", speaker="dylan")),  # a dialect speaker: its language tag
    ("custom_voice-1b7", SpeechInput("Hello there.", speaker="ryan", instructions="Whisper, slowly.")),
    ("custom_voice", SpeechInput("Hello there.", speaker="ryan", instructions="dropped by the 0.6B")),
    ("voice_design", SpeechInput("Hello there.", instructions="A calm, low voice.")),
    ("base", SpeechInput("Hello there.", speaker_embedding=torch.ones(64), x_vector_only=True)),
    ("base", SpeechInput("Hello there, this text is longer than the reference.", speaker_embedding=torch.ones(64),
                         ref_code=torch.zeros(5, 16, dtype=torch.long), ref_text="Hi.")),
    ("base", SpeechInput("Hello.", speaker_embedding=torch.ones(64), ref_code=torch.zeros(9, 16, dtype=torch.long),
                         ref_text="A short reference.", non_streaming_mode=True)),
    ("base", SpeechInput("Hello.", ref_audio=np.random.default_rng(0).standard_normal(24000 + 7).astype(np.float32)
                         * 0.1, ref_sample_rate=24000, ref_text="A clip.")),
])
def test_the_front_count_is_the_engine_prompt_length(tmp_path_factory, model, inp):
    root = tmp_path_factory.mktemp("count")
    loaded = _cv_large(root) if model.endswith("1b7") else tiny_loaded(root, model)
    spec = build_spec(loaded, inp)
    length = build_prompt(spec, loaded.talker, loaded.config).length
    assert prompt_length(spec, loaded.config) == length
    assert PromptLimit(loaded.text_tokenizer, loaded.config, 1 << 20).count(inp) == length


def test_the_offline_api_holds_the_default_limit(cv):
    from legato.api import TTS

    tts = TTS(cv)
    cfg = tts._engine_config(1)
    assert cfg.max_prompt_tokens == default_max_prompt_tokens("custom_voice", "0b6", 4096, 60.0) == 12304
    with pytest.raises(RequestTooLargeError, match="prompt is 16394 tokens"):
        tts.generate(EMOJI, speaker="ryan")


# ---- fair prefill: a short request beside the largest prompt -------------------------------------------

def short_beside_long(loaded, fair: bool, budget: int = 256) -> tuple[int, float, int, int]:
    """Steps and seconds from a 2-frame request's arrival to its end, admitted one step after the largest
    plain prompt; also that prompt's length and the steps it took."""
    from server_helpers import engine_config

    engine = Engine(loaded, engine_config(max_num_batched_tokens=budget, max_model_len=8192, num_kv_blocks=1024,
                                          fair_prefill=fair, max_prompt_tokens=4112))
    long = EngineRequest("long", build_spec(loaded, SpeechInput(PLAIN, speaker="ryan")), SamplingParams(seed=1),
                         max_frames=2, ignore_eos=True)
    short = EngineRequest("short", build_spec(loaded, SpeechInput("Hi there.", speaker="ryan")),
                          SamplingParams(seed=2), max_frames=2, ignore_eos=True)
    engine.add_request(long)
    prompt_len = engine.live["long"].req.prompt_len
    engine.step()
    engine.add_request(short)
    started, steps, short_steps, long_steps = time.perf_counter(), 1, None, None
    short_s = 0.0
    while engine.has_unfinished():
        outputs = engine.step()
        steps += 1
        for o in outputs:
            if o.finished and o.request_id == "short":
                short_steps, short_s = steps - 1, time.perf_counter() - started
                assert o.finish_reason == "length" and o.num_frames == 2
            if o.finished and o.request_id == "long":
                long_steps = steps
        assert steps < 1000
    return short_steps, short_s, prompt_len, long_steps


def test_a_short_request_behind_the_largest_prompt_ends_within_a_few_steps(cv):
    torch.manual_seed(0)
    fair_steps, fair_s, prompt_len, fair_long = short_beside_long(cv, fair=True)
    fifo_steps, fifo_s, _, fifo_long = short_beside_long(cv, fair=False)
    print(f"\nshort 2-frame request beside a {prompt_len}-token prompt (budget 256 tokens/step, CPU): "
          f"fair prefill {fair_steps} steps / {fair_s:.2f} s (long prompt done at step {fair_long}); "
          f"admission order {fifo_steps} steps / {fifo_s:.2f} s (long done at step {fifo_long})")
    # Measured 4: its prefill, one decode, a step of read-back lag (async scheduling), the codec's last audio.
    assert fair_steps <= 5
    assert fifo_steps >= prompt_len // 256 - 1  # without fairness it waits for the whole long prompt
    assert fair_long <= fifo_long + 2  # the long prompt is barely slowed
