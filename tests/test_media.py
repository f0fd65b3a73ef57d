"""Reference-audio resolution: every accepted source decodes to the same samples, and every source the
policy forbids (local files outside the allowed directory, remote URLs, oversized or overlong clips,
garbage) is refused with the right 4xx before the server reads or decodes more than it must."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
import soundfile as sf

from legato.models.qwen3_tts.audio import encode_wav, read_audio
from legato.models.qwen3_tts.inputs import voice_key
from legato.server import media as media_module
from legato.server.media import (
    Clip,
    ClipCache,
    MediaError,
    MediaPolicy,
    decode_ref_audio,
    resolve_ref_audio,
    resolve_ref_clip,
)

CLIP = Path(__file__).parent / "data" / "voice01.wav"
CLIP_BYTES = CLIP.read_bytes()
CLIP_SAMPLES, CLIP_RATE = read_audio(CLIP_BYTES)


def resolve(value: str, policy: MediaPolicy | None = None) -> tuple[np.ndarray, int]:
    return asyncio.run(resolve_ref_audio(value, policy or MediaPolicy()))


def refused(value: str, policy: MediaPolicy | None = None) -> MediaError:
    with pytest.raises(MediaError) as info:
        resolve(value, policy)
    assert info.value.message and str(info.value) == info.value.message
    return info.value


def assert_is_clip(result: tuple[np.ndarray, int]) -> None:
    samples, rate = result
    assert rate == CLIP_RATE == 24000
    assert samples.dtype == np.float32 and samples.ndim == 1
    np.testing.assert_array_equal(samples, CLIP_SAMPLES)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --- inline sources ---------------------------------------------------------------------------------


def test_data_url_decodes_the_clip():
    assert_is_clip(resolve(f"data:audio/wav;base64,{b64(CLIP_BYTES)}"))
    assert_is_clip(resolve(f"DATA:audio/x-wav;base64,{b64(CLIP_BYTES)}"))  # scheme and type case-free
    assert_is_clip(resolve(f"data:;base64,{b64(CLIP_BYTES)}"))  # no media type given


def test_inline_base64_is_decoded_off_the_event_loop(monkeypatch):
    """A 13 MB base64 payload takes tens of ms to decode: on the loop it would stall every audio stream."""
    import legato.server.media as media

    threads = []
    real = base64.b64decode

    def spy(*args, **kwargs):
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(media.base64, "b64decode", spy)
    resolve(f"data:audio/wav;base64,{b64(CLIP_BYTES)}")
    resolve(b64(CLIP_BYTES))
    assert len(threads) == 2 and threading.main_thread() not in threads


def test_bare_base64_decodes_the_clip_even_with_line_breaks():
    assert_is_clip(resolve(b64(CLIP_BYTES)))
    wrapped = base64.encodebytes(CLIP_BYTES).decode()  # 76-character lines, like the `base64` tool
    assert "\n" in wrapped
    assert_is_clip(resolve(wrapped))


@pytest.mark.parametrize(
    "value, needle",
    [
        ("data:audio/wav,RIFF....", "base64"),  # not base64-encoded
        (f"data:text/plain;base64,{b64(CLIP_BYTES)}", "not audio"),
        ("data:audio/wav;base64", "malformed"),
        ("data:audio/wav;base64,@@@not base64@@@", "not valid base64"),
        ("", "empty"),
        ("   ", "empty"),
        ("ftp://example.com/a.wav", "unsupported"),
        ("gopher:x", "unsupported"),
        ("%%% definitely not audio %%%", "base64"),
        ("/etc/passwd", "file://"),  # a plain path is never opened; the message says how to name files
        ("../secret.wav", "file://"),
    ],
)
def test_malformed_values_are_400(value, needle):
    err = refused(value)
    assert err.status == 400
    assert needle in err.message


def test_undecodable_or_empty_audio_is_400():
    assert refused(b64(os.urandom(3000))).status == 400  # valid base64, not audio
    assert "decode" in refused(b64(b"RIFF" + b"\0" * 60)).message
    empty = encode_wav(np.zeros(0, np.float32), 24000)
    assert refused(b64(empty)).status == 400
    buf = io.BytesIO()
    sf.write(buf, np.array([0.0, np.nan, 0.1] * 100, np.float32), 24000, format="WAV", subtype="FLOAT")
    assert "NaN" in refused(b64(buf.getvalue())).message


# --- size and length limits -------------------------------------------------------------------------


def test_oversized_input_is_413_before_decoding():
    small = MediaPolicy(max_bytes=len(CLIP_BYTES) - 1000)
    assert refused(f"data:audio/wav;base64,{b64(CLIP_BYTES)}", small).status == 413
    assert refused(b64(CLIP_BYTES), small).status == 413
    with pytest.raises(MediaError) as info:
        asyncio.run(decode_ref_audio(CLIP_BYTES, small))
    assert info.value.status == 413 and str(small.max_bytes) in info.value.message
    # exactly at the limit is fine, line breaks or not
    assert_is_clip(resolve(b64(CLIP_BYTES), MediaPolicy(max_bytes=len(CLIP_BYTES))))
    assert_is_clip(resolve(base64.encodebytes(CLIP_BYTES).decode(), MediaPolicy(max_bytes=len(CLIP_BYTES))))


def test_too_long_clip_is_refused_with_its_length():
    err = refused(b64(CLIP_BYTES), MediaPolicy(max_seconds=2.5))
    assert err.status == 413 and "4.0 s" in err.message and "2.5 s" in err.message


def test_compressed_silence_is_refused_from_its_header():
    # two minutes of FLAC silence is a few KiB: the declared length must stop it before it is decoded
    buf = io.BytesIO()
    sf.write(buf, np.zeros(24000 * 120, np.float32), 24000, format="FLAC")
    assert len(buf.getvalue()) < 100_000
    err = refused(b64(buf.getvalue()), MediaPolicy(max_seconds=60))
    assert err.status == 413 and "120.0 s" in err.message


# --- local files ------------------------------------------------------------------------------------


@pytest.fixture
def media(tmp_path):
    """An allowed directory holding the clip, and a sibling directory outside it holding a copy."""
    root = tmp_path / "media"
    outside = tmp_path / "media-private"  # shares a string prefix with the allowed directory
    root.mkdir()
    outside.mkdir()
    (root / "clip.wav").write_bytes(CLIP_BYTES)
    (root / "with space.wav").write_bytes(CLIP_BYTES)
    (outside / "secret.wav").write_bytes(CLIP_BYTES)
    return root, outside, MediaPolicy(allowed_local_media_path=str(root))


def test_file_url_inside_the_allowed_directory_is_read(media):
    root, _, policy = media
    assert_is_clip(resolve(f"file://{root}/clip.wav", policy))
    assert_is_clip(resolve(f"file://localhost{root}/clip.wav", policy))
    assert_is_clip(resolve(f"file://{quote(str(root))}/with%20space.wav", policy))
    (root / "sub").mkdir()
    os.symlink(root / "clip.wav", root / "sub" / "link.wav")  # a link that stays inside is fine
    assert_is_clip(resolve(f"file://{root}/sub/link.wav", policy))
    assert_is_clip(resolve(f"file://{root}/sub/../clip.wav", policy))


def test_file_urls_are_refused_without_an_allowed_directory(media):
    root, _, _ = media
    err = refused(f"file://{root}/clip.wav", MediaPolicy())
    assert err.status == 403 and "allowed-local-media-path" in err.message


def test_file_url_escapes_are_403(media):
    root, outside, policy = media
    os.symlink(outside / "secret.wav", root / "link.wav")
    os.symlink(outside, root / "dirlink")
    escapes = [
        f"file://{outside}/secret.wav",  # plainly outside, though it shares the prefix "media"
        f"file://{root}/../media-private/secret.wav",  # `..` climbs out
        f"file://{root}/%2E%2E/media-private/secret.wav",  # the same, percent-encoded
        f"file://{root}/link.wav",  # a file symlink pointing out
        f"file://{root}/dirlink/secret.wav",  # a directory symlink pointing out
        "file:///etc/passwd",
        f"file://{root}/../media-private/does-not-exist.wav",  # outside: 403 whether it exists or not
    ]
    for url in escapes:
        err = refused(url, policy)
        assert err.status == 403, url
        assert "outside" in err.message and str(outside) not in err.message


def test_bad_local_files_are_400(media):
    root, _, policy = media
    (root / "dir.wav").mkdir()
    (root / "junk.wav").write_bytes(b"not audio at all")
    assert "cannot open" in refused(f"file://{root}/missing.wav", policy).message
    assert refused(f"file://{root}/dir.wav", policy).status == 400
    os.mkfifo(root / "fifo.wav")  # opening a FIFO for reading would block without a writer
    assert "regular file" in refused(f"file://{root}/fifo.wav", policy).message
    assert refused(f"file://{root}/junk.wav", policy).status == 400
    assert refused(f"file://example.com{root}/clip.wav", policy).status == 400  # remote host in file://
    assert refused("file://relative/clip.wav", policy).status == 400


def test_large_local_file_is_413(media):
    root, _, _ = media
    policy = MediaPolicy(allowed_local_media_path=str(root), max_bytes=1000)
    assert refused(f"file://{root}/clip.wav", policy).status == 413


# --- remote URLs ------------------------------------------------------------------------------------

LOOPBACK_SERVER = ("127.0.0.1/32",)  # loopback is refused unless the operator allows it, as these tests do


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the stdlib's name)
        if self.path == "/clip.wav":
            self.send_response(200)
            self.send_header("Content-Length", str(len(CLIP_BYTES)))
            self.end_headers()
            self.wfile.write(CLIP_BYTES)
        elif self.path == "/endless":  # no Content-Length: only the streamed byte count can stop it
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(64):
                    self.wfile.write(b"\0" * 65536)
            except OSError:
                pass  # the client hung up, as it should
        elif self.path == "/slow":
            time.sleep(8)  # daemon thread: shutdown does not wait for it
            self.send_response(200)
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_base():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_urls_are_403_unless_allowed(http_base):
    for url in (f"{http_base}/clip.wav", "https://example.com/a.wav"):
        err = refused(url, MediaPolicy())
        assert err.status == 403 and "allow-remote-media" in err.message


def test_remote_fetch_when_allowed(http_base):
    policy = MediaPolicy(allow_remote=True, timeout_s=5.0, allow_remote_networks=LOOPBACK_SERVER)
    assert_is_clip(resolve(f"{http_base}/clip.wav", policy))
    err = refused(f"{http_base}/missing.wav", policy)
    assert err.status == 400 and "404" in err.message


def test_remote_fetch_is_capped_and_timed(http_base):
    def policy(**limits) -> MediaPolicy:
        return MediaPolicy(allow_remote=True, allow_remote_networks=LOOPBACK_SERVER, **limits)

    declared = refused(f"{http_base}/clip.wav", policy(max_bytes=1000))
    assert declared.status == 413
    streamed = refused(f"{http_base}/endless", policy(max_bytes=200_000))
    assert streamed.status == 413 and "200000" in streamed.message
    start = time.monotonic()
    slow = refused(f"{http_base}/slow", policy(timeout_s=0.3))
    assert slow.status == 400 and "timed out" in slow.message
    assert time.monotonic() - start < 5  # the endpoint would stall for longer than this


# --- the inline clip cache ------------------------------------------------------------------------------


def resolve_clip(value: str, cache: ClipCache | None, policy: MediaPolicy | None = None) -> Clip:
    return asyncio.run(resolve_ref_clip(value, policy or MediaPolicy(), cache))


def test_an_inline_clip_is_decoded_once_and_keyed_as_the_voice_cache_keys_it(monkeypatch):
    decoded = []
    real = media_module._decode
    monkeypatch.setattr(media_module, "_decode", lambda data, policy: decoded.append(1) or real(data, policy))
    cache = ClipCache()
    url = f"data:audio/wav;base64,{b64(CLIP_BYTES)}"
    first = resolve_clip(url, cache)
    again = resolve_clip(" " + url + "\n", cache)  # the same clip, however it is padded
    bare = resolve_clip(b64(CLIP_BYTES), cache)  # bare base64 is a second entry
    assert len(decoded) == 2 and len(cache) == 2 and (cache.hits, cache.misses) == (1, 2)
    assert again is first
    for clip in (first, bare):
        assert_is_clip((clip.samples, clip.rate))
        assert clip.key == voice_key(CLIP_SAMPLES, CLIP_RATE)
        assert not clip.samples.flags.writeable  # shared by every request that sends it: nobody may change it
    assert resolve_clip(url, None).samples.flags.writeable  # no cache, nothing shared


def test_a_cached_clip_is_answered_without_a_worker_thread(monkeypatch):
    cache = ClipCache()
    url = f"data:audio/wav;base64,{b64(CLIP_BYTES)}"
    first = resolve_clip(url, cache)

    async def no_thread(*args, **kwargs):
        raise AssertionError("a cached clip went to a worker thread")

    monkeypatch.setattr(media_module.asyncio, "to_thread", no_thread)
    assert resolve_clip(url, cache) is first and (cache.hits, cache.misses) == (1, 1)
    with pytest.raises(AssertionError, match="worker thread"):  # a new clip still decodes off the event loop
        resolve_clip(b64(CLIP_BYTES), cache)


def test_a_refused_clip_is_not_cached_and_is_refused_again():
    cache = ClipCache()
    silent = io.BytesIO()
    sf.write(silent, np.zeros(24000, np.float32), 24000, format="WAV")
    for value in ("data:audio/wav;base64,@@@", f"data:audio/wav;base64,{b64(silent.getvalue())}"):
        for _ in range(2):
            with pytest.raises(MediaError) as info:
                resolve_clip(value, cache)
            assert info.value.status == 400
    assert len(cache) == 0


def test_the_clip_cache_keeps_within_its_entry_and_byte_limits():
    values = [f"data:audio/wav;base64,{b64(_tone(24000 + i))}" for i in range(4)]
    by_count = ClipCache(max_entries=2)
    for v in values:
        resolve_clip(v, by_count)
    assert len(by_count) == 2
    resolve_clip(values[-1], by_count)  # the newest stays
    assert by_count.hits == 1
    one = len(values[0]) + 4 * 24001
    by_bytes = ClipCache(max_bytes=int(2.5 * one))
    for v in values:
        resolve_clip(v, by_bytes)
    assert len(by_bytes) == 2 and by_bytes._bytes <= by_bytes.max_bytes
    too_big = ClipCache(max_bytes=one // 2)  # a clip larger than the whole cache is served, never stored
    assert_is_clip_like(resolve_clip(values[0], too_big))
    assert len(too_big) == 0


def test_file_urls_are_not_cached_and_leave_the_key_to_the_engine(tmp_path):
    path = tmp_path / "voice.wav"
    path.write_bytes(CLIP_BYTES)
    cache = ClipCache()
    clip = resolve_clip(path.as_uri(), cache, MediaPolicy(allowed_local_media_path=str(tmp_path)))
    assert_is_clip((clip.samples, clip.rate))
    assert clip.key is None and len(cache) == 0  # the file may change before the next request


def _tone(n: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, (0.1 * np.sin(np.arange(n) / 9.0)).astype(np.float32), 24000, format="WAV")
    return buf.getvalue()


def assert_is_clip_like(clip: Clip) -> None:
    assert clip.rate == 24000 and clip.samples.dtype == np.float32 and len(clip.samples) > 0
