"""Reference audio against hostile input: remote URLs aimed at the server's own network (SSRF, DNS rebinding,
redirects), and clips that are silent, too short, too long, not audio, or lie in their headers. Every one
is refused with a plain 4xx; none reaches a 500, a hang or a huge allocation."""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import socket
import struct
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from fastapi import FastAPI
from fastapi.testclient import TestClient
from voice_helpers import FakeClient

from legato.server.media import MediaError, MediaPolicy, decode_ref_audio, resolve_ref_audio
from legato.server.remote_media import MAX_REDIRECTS, forbidden_reason
from legato.server.settings import ServerSettings
from legato.server.voices import VoiceStore
from legato.server.voices_api import build_voices_router

CLIP_BYTES = (Path(__file__).parent.parent / "data" / "voice01.wav").read_bytes()
CLIP_SAMPLES = sf.info(io.BytesIO(CLIP_BYTES)).frames
LOOPBACK_ONLY = ("127.0.0.1/32",)
HANG_GUARD_S = 30.0  # far past any honest answer: only a hang trips it


def resolve(value: str, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    return asyncio.run(asyncio.wait_for(resolve_ref_audio(value, policy), HANG_GUARD_S))


def refused(value: str, policy: MediaPolicy) -> MediaError:
    with pytest.raises(MediaError) as info:
        resolve(value, policy)
    assert_plain(info.value.message)
    return info.value


def refused_bytes(data: bytes, policy: MediaPolicy | None = None) -> MediaError:
    with pytest.raises(MediaError) as info:
        asyncio.run(asyncio.wait_for(decode_ref_audio(data, policy or MediaPolicy()), HANG_GUARD_S))
    assert_plain(info.value.message)
    return info.value


def assert_plain(message: str) -> None:
    assert message and "0x" not in message and "<" not in message and "object at" not in message, message


def remote(**kw) -> MediaPolicy:
    return MediaPolicy(allow_remote=True, **{"timeout_s": 10.0, **kw})


# --- the address rules ------------------------------------------------------------------------------


@pytest.mark.parametrize("addr, why", [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.5.4", "private"), ("192.168.1.1", "private"), ("fd12:3456::1", "private"),
    ("169.254.169.254", "metadata"), ("fd00:ec2::254", "metadata"), ("100.100.100.200", "metadata"),
    ("169.254.1.1", "link-local"), ("fe80::1", "link-local"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"),
    ("240.0.0.1", "reserved"), ("255.255.255.255", "reserved"), ("192.0.2.7", "reserved"), ("198.18.0.1", "reserved"),
    ("100.64.0.1", "carrier-grade NAT"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:169.254.169.254", "metadata"), ("::ffff:10.0.0.1", "private"),
    ("::ffff:100.64.1.1", "carrier-grade NAT"), ("64:ff9b::a00:1", "private"), ("2002:7f00:1::", "loopback"),
])
def test_non_public_addresses_are_forbidden_with_the_reason(addr, why):
    reason = forbidden_reason(ipaddress.ip_address(addr))
    assert reason is not None and why in reason


@pytest.mark.parametrize("addr", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"])
def test_public_addresses_pass(addr):
    assert forbidden_reason(ipaddress.ip_address(addr)) is None


def test_the_allow_list_opens_only_its_networks_and_never_the_metadata_service():
    allowed = MediaPolicy(allow_remote_networks=("127.0.0.0/8", "10.0.0.0/8", "169.254.0.0/16")).allow_remote_networks
    assert forbidden_reason(ipaddress.ip_address("127.0.0.1"), allowed) is None
    assert forbidden_reason(ipaddress.ip_address("::ffff:127.0.0.1"), allowed) is None  # the same host
    assert forbidden_reason(ipaddress.ip_address("10.9.8.7"), allowed) is None
    assert "private" in forbidden_reason(ipaddress.ip_address("192.168.0.1"), allowed)
    assert "loopback" in forbidden_reason(ipaddress.ip_address("::1"), allowed)
    assert "metadata" in forbidden_reason(ipaddress.ip_address("169.254.169.254"), allowed)


def test_a_bad_allow_list_is_refused_when_the_server_is_configured():
    assert ServerSettings(remote_media_allow_cidrs=("10.0.0.0/8", "192.168.1.7")).remote_media_allow_cidrs
    with pytest.raises(ValueError, match="remote_media_allow_cidrs"):
        ServerSettings(remote_media_allow_cidrs=("not-a-network",))


# --- remote fetches against a loopback server --------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the stdlib's name)
        self.server.seen.append((self.path, self.headers.get("Host")))
        port = self.server.server_address[1]
        redirects = {
            "/to-clip": "/clip.wav",  # relative: resolved against this hop
            "/to-metadata": "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
            "/to-private": "http://10.0.0.1/clip.wav",
            "/to-other-loopback": f"http://127.0.0.2:{port}/clip.wav",  # loopback, outside the allow-list
            "/to-mapped": f"http://[::ffff:127.0.0.1]:{port}/clip.wav",
            "/to-ftp": "ftp://example.com/clip.wav",
            "/loop": "/loop",
        }
        if self.path == "/clip.wav":
            self._send(200, body=CLIP_BYTES)
        elif self.path in redirects:
            self._send(302, location=redirects[self.path])
        elif self.path.startswith("/slow-hop/"):  # /slow-hop/N: a short pause, then N more hops to the clip
            time.sleep(0.3)
            left = int(self.path.rsplit("/", 1)[1])
            self._send(302, location=f"/slow-hop/{left - 1}" if left else "/clip.wav")
        else:
            self._send(404)

    def _send(self, status: int, body: bytes = b"", location: str | None = None) -> None:
        self.send_response(status)
        if location:
            self.send_header("Location", location)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.seen = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def base(server):
    server.seen.clear()
    return f"http://127.0.0.1:{server.server_address[1]}"


def assert_clip(result: tuple[np.ndarray, int]) -> None:
    samples, rate = result
    assert rate == 24000 and len(samples) == CLIP_SAMPLES


def test_the_allowed_loopback_server_works(base, server):
    assert_clip(resolve(f"{base}/clip.wav", remote(allow_remote_networks=LOOPBACK_ONLY)))
    assert_clip(resolve(f"{base}/to-clip", remote(allow_remote_networks=LOOPBACK_ONLY)))  # a checked redirect
    assert [p for p, _ in server.seen] == ["/clip.wav", "/to-clip", "/clip.wav"]


def test_loopback_private_and_metadata_urls_are_refused_before_connecting(base, server):
    port = server.server_address[1]
    cases = {
        f"{base}/clip.wav": "loopback",
        f"http://[::1]:{port}/clip.wav": "loopback",
        f"http://localhost:{port}/clip.wav": "loopback",  # a name: judged by what it resolves to
        f"http://[::ffff:127.0.0.1]:{port}/clip.wav": "loopback",
        f"http://2130706433:{port}/clip.wav": "loopback",  # 127.0.0.1 as one decimal number
        "http://10.0.0.1/clip.wav": "private",
        "http://192.168.1.1/clip.wav": "private",
        "http://169.254.169.254/latest/meta-data/": "metadata",
        "http://[fd00:ec2::254]/latest/meta-data/": "metadata",
        "http://100.100.100.200/latest/meta-data/": "metadata",
        f"http://0.0.0.0:{port}/clip.wav": "unspecified",
    }
    for url, why in cases.items():
        err = refused(url, remote())
        assert err.status == 403 and why in err.message and "--remote-media-allow-cidr" in err.message, (url, err)
    assert server.seen == []  # not one request reached the server


def fake_dns(monkeypatch, answers: dict[str, list[list[str]]]) -> dict[str, int]:
    """Answers the named hosts from `answers` (one list of addresses per lookup, the last repeating) and
    passes every other name to the real resolver; returns the lookup count per faked name."""
    real = socket.getaddrinfo
    calls = dict.fromkeys(answers, 0)

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in answers:
            return real(host, port, *args, **kwargs)
        replies = answers[host]
        addrs = replies[min(calls[host], len(replies) - 1)]
        calls[host] += 1
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port, 0, 0) if ":" in a else (a, port)) for a in addrs]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return calls


def test_a_public_looking_name_resolving_to_a_private_address_is_refused(monkeypatch):
    fake_dns(monkeypatch, {
        "media.example.com": [["10.0.0.5"]],
        "mixed.example.com": [["93.184.216.34", "127.0.0.1"]],  # one bad answer is enough
        "v6.example.com": [["::ffff:169.254.169.254"]],
    })
    err = refused("https://media.example.com/clip.wav", remote())
    assert err.status == 403 and "'media.example.com' resolves to 10.0.0.5" in err.message and "private" in err.message
    err = refused("http://mixed.example.com/clip.wav", remote())
    assert err.status == 403 and "127.0.0.1" in err.message and "loopback" in err.message
    err = refused("http://v6.example.com/clip.wav", remote())
    assert err.status == 403 and "metadata" in err.message


def test_the_connection_goes_to_the_address_that_was_checked(monkeypatch, server):
    """DNS rebinding: the second answer for the name is private. The server must resolve once and connect to
    the first, checked answer, sending the name in the Host header."""
    port = server.server_address[1]
    calls = fake_dns(monkeypatch, {"voices.example": [["127.0.0.1"], ["10.66.66.66"]]})
    server.seen.clear()
    assert_clip(resolve(f"http://voices.example:{port}/clip.wav", remote(allow_remote_networks=LOOPBACK_ONLY)))
    assert calls == {"voices.example": 1}
    assert server.seen == [("/clip.wav", f"voices.example:{port}")]


def test_https_connects_to_the_checked_address_and_verifies_the_name(monkeypatch):
    """TLS goes to the pinned IP, but SNI and the certificate check use the name from the URL."""
    import httpx

    fake_dns(monkeypatch, {"secure.example": [["127.0.0.1"]]})
    sent = []

    async def send(self, request, **kwargs):
        sent.append((request.url.host, request.headers["host"], request.extensions.get("sni_hostname")))
        raise httpx.ConnectError("stopped by the test", request=request)

    monkeypatch.setattr(httpx.AsyncClient, "send", send)
    err = refused("https://secure.example/clip.wav", remote(allow_remote_networks=LOOPBACK_ONLY))
    assert err.status == 400 and "stopped by the test" in err.message
    assert sent == [("127.0.0.1", "secure.example", "secure.example")]


def test_unresolvable_names_are_400(monkeypatch):
    def fail(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    err = refused("http://nowhere.invalid/clip.wav", remote())
    assert err.status == 400 and "cannot resolve" in err.message


def test_redirects_to_forbidden_addresses_are_refused(base, server):
    policy = remote(allow_remote_networks=LOOPBACK_ONLY)
    for path, why in [("/to-metadata", "metadata"), ("/to-private", "private"), ("/to-other-loopback", "loopback")]:
        err = refused(f"{base}{path}", policy)
        assert err.status == 403 and why in err.message, (path, err)
    assert_clip(resolve(f"{base}/to-mapped", policy))  # the allowed host in IPv6 form is still that host
    # only the allowed server was ever asked: no request went to where the redirects pointed
    assert [p for p, _ in server.seen] == ["/to-metadata", "/to-private", "/to-other-loopback", "/to-mapped",
                                           "/clip.wav"]


def test_redirects_are_bounded_and_keep_to_http(base, server):
    policy = remote(allow_remote_networks=LOOPBACK_ONLY)
    loop = refused(f"{base}/loop", policy)
    assert loop.status == 400 and f"more than {MAX_REDIRECTS}" in loop.message
    assert len(server.seen) == MAX_REDIRECTS + 1
    ftp = refused(f"{base}/to-ftp", policy)
    assert ftp.status == 400 and "ftp" in ftp.message
    creds = refused(f"http://user:secret@127.0.0.1:{server.server_address[1]}/clip.wav", policy)
    assert creds.status == 400 and "password" in creds.message and "secret" not in creds.message


def test_the_time_limit_covers_all_hops_together(base):
    # four hops of 0.3 s each: every hop is well inside 0.8 s, the whole chain is not
    err = refused(f"{base}/slow-hop/3", remote(allow_remote_networks=LOOPBACK_ONLY, timeout_s=0.8))
    assert err.status == 400 and "timed out after 0.8 s" in err.message


# --- clips that are not worth cloning ----------------------------------------------------------------


def wav(samples: np.ndarray, rate: int = 24000, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def tone(seconds: float, rate: int = 24000, peak: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (peak * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def test_silence_is_refused_and_quiet_speech_is_not():
    err = refused_bytes(wav(np.zeros(24000, np.float32)))
    assert err.status == 400 and "silent" in err.message
    dither = np.random.default_rng(0).choice([-1, 0, 1], 24000) / 32768  # one 16-bit step: still nothing
    assert "silent" in refused_bytes(wav(dither.astype(np.float32), subtype="FLOAT")).message
    samples, rate = asyncio.run(decode_ref_audio(wav(tone(1.0, peak=0.01)), MediaPolicy()))  # -40 dBFS
    assert rate == 24000 and len(samples) == 24000


def test_a_float_clip_far_outside_its_range_is_refused_before_it_overflows_the_encoders():
    """A float WAV with a finite sample of 3e38 overflowed the speaker encoder: the voice saved from it (201)
    held a non-finite embedding that every request refused, and a restart quarantined it (an outside probe)."""
    loud = tone(1.0)
    loud[5] = 3e38
    err = refused_bytes(wav(loud, subtype="FLOAT"))
    assert err.status == 400 and "magnitude 3e+38" in err.message and "[-1, 1]" in err.message
    over = tone(1.0, peak=2.0)  # a little past full scale, as some tools write: taken
    samples, _ = asyncio.run(decode_ref_audio(wav(over, subtype="FLOAT"), MediaPolicy()))
    assert len(samples) == 24000


def test_a_clip_whose_voice_overflows_is_refused_where_the_voice_is_computed(tmp_path):
    """The second guard, for callers that skip the server's media checks (the offline API, `legato synth`): the
    encoders' result must be finite, or the clip is refused there with the reason."""
    import pytest

    from legato.models.qwen3_tts.audio import AudioError
    from legato.models.qwen3_tts.inputs import extract_voice
    from legato.models.qwen3_tts.loader import load_model
    from legato.models.qwen3_tts.testing import write_checkpoint

    loaded = load_model(write_checkpoint(tmp_path / "base"))
    loud = tone(1.0)
    loud[5] = 3e38
    with pytest.raises(AudioError, match="speaker embedding overflows"):
        extract_voice(loaded, loud, 24000)
    assert extract_voice(loaded, tone(1.0), 24000, codes=False).speaker_embedding.isfinite().all()


def test_too_short_clips_are_refused_naming_the_minimum():
    for seconds in (0.001, 0.49):
        err = refused_bytes(wav(tone(seconds)))
        assert err.status == 400 and "at least 0.5 s" in err.message, err
    assert len(asyncio.run(decode_ref_audio(wav(tone(0.5)), MediaPolicy()))[0]) == 12000


def test_ten_minutes_is_refused_from_the_header_without_decoding(monkeypatch):
    ten_minutes = wav(tone(600, rate=8000), rate=8000, subtype="ULAW")  # 4.8 MB: under the byte cap
    assert len(ten_minutes) < MediaPolicy().max_bytes
    decoded = []
    real_read = sf.SoundFile.read
    monkeypatch.setattr(sf.SoundFile, "read", lambda self, *a, **k: decoded.append(1) or real_read(self, *a, **k))
    err = refused_bytes(ten_minutes)
    assert err.status == 413 and "600.0 s" in err.message and "limit is 60 s" in err.message
    assert decoded == []
    # the same ten minutes as plain 16-bit PCM is over the byte cap: refused before the header is read
    assert refused_bytes(wav(tone(600))).status == 413


@pytest.mark.parametrize("data", [
    b"not audio at all, just some text" * 20,
    b"\x89PNG\r\n\x1a\n" + bytes(2000),
    b'{"audio": "elsewhere"}' * 40,
    np.random.default_rng(1).bytes(5000),
    b"RIFF" + b"\0" * 60,
])
def test_not_audio_is_a_plain_400(data):
    err = refused_bytes(data)
    assert err.status == 400
    assert err.message.startswith("ref_audio cannot be decoded: it is not a readable audio file (WAV, FLAC, OGG, MP3)")


def lying_wav(samples: np.ndarray, rate: int = 24000, channels: int = 1, data_size: int | None = None) -> bytes:
    """A 16-bit PCM WAV whose header fields say whatever the test wants."""
    pcm = (samples * 32767).astype("<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * 2 * max(channels, 1), 2 * max(channels, 1), 16)
    body = (b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"data" + struct.pack("<I", len(pcm) if data_size is None else data_size) + pcm)
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.mark.parametrize("header, status, needle", [
    ({"channels": 0}, 400, "not a readable audio file"),
    ({"channels": 5000}, 400, "not a readable audio file"),
    ({"rate": 0}, 400, "not a readable audio file"),
    ({"rate": 1}, 400, "8000-192000 Hz"),
    ({"rate": 2_000_000_000}, 400, "8000-192000 Hz"),
])
def test_a_wav_header_with_impossible_fields_is_refused(header, status, needle):
    err = refused_bytes(lying_wav(tone(1.0), **header))
    assert err.status == status and needle in err.message, err


def test_a_data_size_past_the_end_decodes_only_what_is_there():
    # streamed WAVs (this server's own included) end with a data size of 0xFFFFFFFF: the bytes present count
    samples, rate = asyncio.run(decode_ref_audio(lying_wav(tone(1.0), data_size=0xFFFFFFF0), MediaPolicy()))
    assert rate == 24000 and len(samples) == 24000
    err = refused_bytes(lying_wav(np.zeros(0, np.float32), data_size=0x7FFFFFFF))  # a header and no samples
    assert err.status == 400 and "empty" in err.message


def flac_declaring(samples: np.ndarray, rate: int, declared_frames: int) -> bytes:
    """A FLAC stream whose STREAMINFO claims `declared_frames` samples (the low 36 bits of bytes 18-25)."""
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="FLAC")
    data = bytearray(buf.getvalue())
    field = int.from_bytes(data[18:26], "big")
    data[18:26] = ((field & ~(2**36 - 1)) | declared_frames).to_bytes(8, "big")
    return bytes(data)


def test_a_huge_declared_sample_count_is_refused_from_the_header():
    err = refused_bytes(flac_declaring(tone(1.0), 24000, 2**36 - 1))
    assert err.status == 413 and "limit is 60 s" in err.message


def test_a_header_lying_within_the_limit_costs_no_more_memory_than_the_real_clip():
    # 8 channels at 192 kHz declaring 55 s: decoding it in one piece would allocate 55 s x 8 channels
    # (over 300 MB) before finding the data ends after 1 s
    t = np.arange(192000) / 192000
    eight = np.stack([0.3 * np.sin(2 * np.pi * 110 * (c + 1) * t) for c in range(8)], axis=1).astype(np.float32)
    data = flac_declaring(eight, 192000, 55 * 192000)
    policy = MediaPolicy(max_bytes=64 * 1024 * 1024)
    tracemalloc.start()
    try:
        with pytest.raises(MediaError) as info:
            asyncio.run(decode_ref_audio(data, policy))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.status == 400 and "not a readable audio file" in info.value.message
    assert_plain(info.value.message)
    assert peak < 64 * 1024 * 1024, peak


# --- through the HTTP API ------------------------------------------------------------------------------


def test_the_voices_api_answers_every_bad_clip_with_a_plain_4xx(tmp_path):
    app = FastAPI()
    app.include_router(build_voices_router(VoiceStore(tmp_path / "voices", FakeClient()), MediaPolicy()))
    http = TestClient(app)
    clips = {
        "silent": (wav(np.zeros(24000, np.float32)), 400, "silent"),
        "short": (wav(tone(0.001)), 400, "0.5 s"),
        "long": (wav(tone(600, rate=8000), rate=8000, subtype="ULAW"), 413, "60 s"),
        "garbage": (b"garbage" * 99, 400, "not a readable audio file"),
        "zero-channels": (lying_wav(tone(1.0), channels=0), 400, "not a readable audio file"),
        "zero-rate": (lying_wav(tone(1.0), rate=0), 400, "not a readable audio file"),
    }
    for name, (data, status, needle) in clips.items():
        r = http.post("/v1/audio/voices", data={"name": name}, files={"file": ("a.wav", data, "audio/wav")})
        assert r.status_code == status, (name, r.text)
        message = r.json()["error"]["message"]
        assert needle in message, (name, message)
        assert_plain(message)
        data_url = "data:audio/wav;base64," + base64.b64encode(data).decode()
        r = http.post("/v1/audio/voices", json={"name": name, "ref_audio": data_url})
        assert r.status_code == status and r.json()["error"]["param"] == "ref_audio", (name, r.text)
