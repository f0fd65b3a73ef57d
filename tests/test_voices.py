"""The voice store: voices from a real clip (the real speaker and codec encoders, run once) or from an
x-vector; lookups ignore case; everything survives a restart bit for bit; bad input and bad files are
refused or skipped with a reason."""

from __future__ import annotations

import asyncio
import logging
import os

import numpy as np
import pytest
import torch
from voice_helpers import CLIP, HIDDEN, FakeClient

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.audio import read_audio_file
from legato.models.qwen3_tts.inputs import SpeechInput, extract_voice
from legato.models.qwen3_tts.loader import load_model
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline.client import SynthesisRequest
from legato.pipeline.local import LocalEngineClient
from legato.server.voices import Voice, VoiceError, VoiceStore


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    torch.set_num_threads(1)
    return load_model(tiny_checkpoint)


def real_client(loaded) -> LocalEngineClient:
    return LocalEngineClient(loaded, EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=64,
                                                  max_model_len=1024))


def clip() -> tuple[np.ndarray, int]:
    return read_audio_file(str(CLIP))


def run(coro):
    return asyncio.run(coro)


def embedding(seed: int = 0) -> list[float]:
    return torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed)).tolist()


def status_of(coro) -> VoiceError:
    with pytest.raises(VoiceError) as info:
        run(coro)
    assert info.value.message
    return info.value


# --- from a real clip, through the real encoders ----------------------------------------------------


def test_voice_from_real_clip_is_extracted_once_persists_and_speaks(loaded, tmp_path):
    samples, rate = clip()
    assert rate == 24000

    async def main():
        client = real_client(loaded)
        await client.start()
        try:
            store = VoiceStore(tmp_path, client)
            voice = await store.create("Alice", audio=(samples, rate), ref_text="Hello, this is my voice.")
            # a restarted server: a new store over the same directory, with the engine's own view of it
            restarted = VoiceStore(tmp_path, client).get("alice")
            inp = SpeechInput("Hi there.", language="english", **restarted.speech_fields())
            req = SynthesisRequest("v1", inp, SamplingParams(seed=3, max_new_tokens=4))
            chunks = [c async for c in client.generate(req)]
        finally:
            await client.stop()
        return voice, restarted, chunks

    voice, restarted, chunks = run(main())
    direct = extract_voice(loaded, samples, rate)
    assert voice.source == "audio" and voice.ref_text == "Hello, this is my voice."
    assert voice.speaker_embedding.dtype == torch.float32 and voice.speaker_embedding.shape == (HIDDEN,)
    assert voice.ref_code.dtype == torch.int64 and voice.ref_code.shape == (51, 16)  # 4 s at 12.5 Hz
    assert torch.equal(voice.speaker_embedding, direct.speaker_embedding)
    assert torch.equal(voice.ref_code, direct.ref_code)
    assert restarted is not voice and restarted.name == "Alice"
    assert torch.equal(restarted.speaker_embedding, voice.speaker_embedding)
    assert torch.equal(restarted.ref_code, voice.ref_code)
    assert (restarted.ref_text, restarted.created_at, restarted.source) == (voice.ref_text, voice.created_at, "audio")
    assert chunks[-1].finished and chunks[-1].finish_reason in ("stop", "length"), chunks[-1].error
    assert chunks[-1].num_prompt_tokens > 51  # the reference codes are in the prompt (in-context cloning)


def test_real_encoder_rejection_becomes_a_400(loaded, tmp_path):
    async def main():
        client = real_client(loaded)
        await client.start()
        try:
            await VoiceStore(tmp_path, client).create("short", audio=(np.zeros(100, np.float32), 24000))
        finally:
            await client.stop()

    err = status_of(main())
    assert err.status == 400 and "too short" in err.message
    assert list(tmp_path.iterdir()) == []


# --- with a fake engine -----------------------------------------------------------------------------


def test_extract_voice_runs_once_per_upload_and_never_on_load(tmp_path):
    client = FakeClient()
    store = VoiceStore(tmp_path, client)
    run(store.create("a", audio=clip(), ref_text="words"))
    assert client.calls == 1
    store.get("a"), store.list()
    run(store.create("b", audio=clip(), x_vector_only=True))
    assert client.calls == 2
    VoiceStore(tmp_path, client)
    assert client.calls == 2


def test_x_vector_only_voices_keep_no_codes(tmp_path):
    store = VoiceStore(tmp_path, FakeClient())
    flagged = run(store.create("flagged", audio=clip(), ref_text="ignored words", x_vector_only=True))
    untranscribed = run(store.create("untranscribed", audio=clip()))
    for v in (flagged, untranscribed):
        assert v.ref_code is None and v.ref_text is None and v.x_vector_only
        assert v.speech_fields()["x_vector_only"] is True
        info = v.info()
        assert not info.has_ref_code and info.ref_frames == 0
    full = run(store.create("full", audio=clip(), ref_text="  words  "))
    assert full.ref_text == "words" and full.info().ref_frames == 7
    assert full.speech_fields() == {"speaker_embedding": full.speaker_embedding, "ref_code": full.ref_code,
                                    "ref_text": "words", "x_vector_only": False}


def test_voice_from_embedding(tmp_path):
    store = VoiceStore(tmp_path, FakeClient())
    values = embedding(1)
    voice = run(store.create("emb", speaker_embedding=values))
    assert voice.source == "embedding" and voice.ref_code is None
    assert torch.equal(voice.speaker_embedding, torch.tensor(values, dtype=torch.float32))
    again = VoiceStore(tmp_path, FakeClient()).get("EMB")
    assert torch.equal(again.speaker_embedding, voice.speaker_embedding) and again.source == "embedding"


@pytest.mark.parametrize(
    "values, needle",
    [
        (embedding()[:-1], "needs 64"),
        (embedding() + [0.0], "needs 64"),
        ([], "needs 64"),
        ([float("nan")] + embedding()[1:], "NaN"),
        ([float("inf")] + embedding()[1:], "NaN"),
        ([1e39] + embedding()[1:], "overflow"),
        ([True] + embedding()[1:], "list of numbers"),
        (["0.5"] + embedding()[1:], "list of numbers"),
        ("0.5, 0.1", "list of numbers"),
    ],
)
def test_bad_embeddings_are_400(tmp_path, values, needle):
    err = status_of(VoiceStore(tmp_path, FakeClient()).create("x", speaker_embedding=values))
    assert err.status == 400 and needle in err.message


def test_exactly_one_source_is_required(tmp_path):
    store = VoiceStore(tmp_path, FakeClient())
    assert status_of(store.create("x")).status == 400
    assert status_of(store.create("x", audio=clip(), speaker_embedding=embedding())).status == 400
    assert "ref_text" in status_of(store.create("x", speaker_embedding=embedding(), ref_text="hi")).message
    assert status_of(store.create("x", audio=(np.zeros((2, 10), np.float32), 24000))).status == 400
    assert status_of(store.create("x", audio=(np.zeros(10, np.float32), 0))).status == 400
    assert status_of(store.create("x", audio=clip(), ref_text="w" * 5000)).status == 400
    for blank in ("   ", "\u200b\u200b", "\x01\x02", ""):  # refused as the speech route refuses it: no transcript
        err = status_of(store.create("x", audio=clip(), ref_text=blank))
        assert err.status == 400 and "ref_text is blank" in err.message, repr(blank)
    assert len(store) == 0 and list(tmp_path.iterdir()) == []
    assert run(store.create("x", audio=clip(), ref_text=" ", x_vector_only=True)).x_vector_only  # not read there


def test_list_get_delete_ignore_case(tmp_path):
    store = VoiceStore(tmp_path, FakeClient())
    run(store.create("Zed", speaker_embedding=embedding(1)))
    run(store.create("amy", speaker_embedding=embedding(2)))
    assert [v.name for v in store.list()] == ["amy", "Zed"]
    assert store.get("ZED").name == "Zed" and store.get("nobody") is None
    assert store.list()[1].to_dict()["source"] == "embedding"
    assert run(store.delete("zed")) is True
    assert run(store.delete("Zed")) is False
    assert store.get("Zed") is None and [v.name for v in store.list()] == ["amy"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["amy.safetensors"]
    assert [v.name for v in VoiceStore(tmp_path, FakeClient()).list()] == ["amy"]


@pytest.mark.parametrize("name", ["", "a" * 65, "../x", "a/b", "..", ".hidden", "-x", "_x", "x y", "名字",
                                  "a\x00b", "a\\b", "x\n", None, 5])
def test_invalid_names_are_400(tmp_path, name):
    err = status_of(VoiceStore(tmp_path, FakeClient()).create(name, speaker_embedding=embedding()))
    assert err.status == 400 and "name" in err.message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["a", "A-b_c.d", "x" * 64, "7", "v1..2"])
def test_valid_names(tmp_path, name):
    store = VoiceStore(tmp_path, FakeClient())
    run(store.create(name, speaker_embedding=embedding()))
    assert VoiceStore(tmp_path, FakeClient()).get(name).name == name


def test_duplicates_are_409_unless_replace(tmp_path):
    store = VoiceStore(tmp_path, FakeClient())
    run(store.create("Bob", speaker_embedding=embedding(1)))
    for name in ("Bob", "bob", "BOB"):
        err = status_of(store.create(name, speaker_embedding=embedding(2)))
        assert err.status == 409 and "exists" in err.message
    replaced = run(store.create("BOB", speaker_embedding=embedding(2), replace=True))
    assert len(store) == 1 and store.get("bob") is replaced
    reloaded = VoiceStore(tmp_path, FakeClient()).get("bob")
    assert reloaded.name == "BOB" and torch.equal(reloaded.speaker_embedding, torch.tensor(embedding(2)))


def test_concurrent_creates_of_one_name(tmp_path):
    client = FakeClient(delay_s=0.05)
    store = VoiceStore(tmp_path, client)

    async def main():
        return await asyncio.gather(store.create("same", audio=clip()), store.create("SAME", audio=clip()),
                                    return_exceptions=True)

    results = run(main())
    assert sum(isinstance(r, Voice) for r in results) == 1
    errors = [r for r in results if isinstance(r, VoiceError)]
    assert len(errors) == 1 and errors[0].status == 409
    assert client.calls == 1  # the loser is refused before any engine work


def test_delete_during_a_replace_is_409(tmp_path):
    store = VoiceStore(tmp_path, FakeClient(delay_s=0.05))
    run(store.create("v", audio=clip()))

    async def main():
        replacing = asyncio.create_task(store.create("v", audio=clip(), replace=True))
        await asyncio.sleep(0.01)  # the replace is now waiting on the engine
        with pytest.raises(VoiceError) as info:
            await store.delete("V")
        return await replacing, info.value

    replaced, err = run(main())
    assert err.status == 409 and "another request" in err.message
    assert store.get("v") is replaced and (tmp_path / "v.safetensors").exists()


def test_store_is_capped(tmp_path):
    store = VoiceStore(tmp_path, FakeClient(), max_voices=2)
    run(store.create("a", speaker_embedding=embedding()))
    run(store.create("b", speaker_embedding=embedding()))
    err = status_of(store.create("c", speaker_embedding=embedding()))
    assert err.status == 409 and "maximum of 2" in err.message
    run(store.create("b", speaker_embedding=embedding(3), replace=True))  # replacing needs no room


def test_non_base_model_is_refused(tmp_path):
    client = FakeClient(model_type="custom_voice")
    store = VoiceStore(tmp_path, client)
    err = status_of(store.create("x", audio=clip()))
    assert err.status == 400 and "Base" in err.message and "custom_voice" in err.message
    assert client.calls == 0 and store.list() == []


def test_crash_mid_write_leaves_no_voice(tmp_path, monkeypatch):
    store = VoiceStore(tmp_path, FakeClient())
    run(store.create("keep", speaker_embedding=embedding(1)))

    def crash(*args):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        run(store.create("lost", speaker_embedding=embedding(2)))
    with pytest.raises(OSError):
        run(store.create("keep", speaker_embedding=embedding(2), replace=True))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.safetensors"]
    assert store.get("lost") is None
    assert torch.equal(store.get("keep").speaker_embedding, torch.tensor(embedding(1)))
    run(store.create("lost", speaker_embedding=embedding(2)))  # the name was not left reserved


def test_bad_files_are_skipped_with_a_warning(tmp_path, caplog):
    store = VoiceStore(tmp_path, FakeClient())
    run(store.create("good", audio=clip(), ref_text="words"))
    run(store.create("renamed", speaker_embedding=embedding()))
    (tmp_path / "renamed.safetensors").rename(tmp_path / "other.safetensors")  # name no longer matches
    run(VoiceStore(tmp_path / "wide", FakeClient(hidden=HIDDEN * 2)).create("wide", speaker_embedding=[0.0] * 128))
    (tmp_path / "wide" / "wide.safetensors").rename(tmp_path / "wide.safetensors")  # another model's voice
    (tmp_path / "wide").rmdir()
    (tmp_path / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    (tmp_path / ".tmp-0123.safetensors").write_bytes(b"half a voice")
    (tmp_path / "notes.txt").write_text("not a voice")

    with caplog.at_level(logging.WARNING, logger="legato.server.voices"):
        reloaded = VoiceStore(tmp_path, FakeClient())
    assert [v.name for v in reloaded.list()] == ["good"]
    assert reloaded.get("good").info().ref_frames == 7
    skipped = " ".join(r.getMessage() for r in caplog.records)
    for name in ("other.safetensors", "wide.safetensors", "garbage.safetensors", "empty.safetensors"):
        assert name in skipped
    assert not (tmp_path / ".tmp-0123.safetensors").exists()  # a leftover temporary is cleaned up
    assert (tmp_path / "notes.txt").exists()  # files that are not voices are left alone
