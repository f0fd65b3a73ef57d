"""Reference audio from a request field: data URLs, bare base64, `file://` and `http(s)://` URLs.

Everything a client sends here is untrusted, so each source is checked before any bytes are decoded:
local files only inside the directory the operator allowed (after resolving symlinks and `..`), remote
URLs only when the operator opted in, every source capped in bytes before decoding and in seconds after.
Decoding and file reads run on worker threads so a large clip never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import re
import stat
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import numpy as np

from legato.models.qwen3_tts.audio import AudioError, read_audio

MiB = 1024 * 1024

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
def _strip_whitespace(text: str) -> str:
    # str.split() drops every run of whitespace in C: a regex over a few hundred KB of base64 per request
    # held the GIL long enough to slow the engine thread under load.
    return "".join(text.split())


class MediaError(Exception):
    """A reference-audio value the server will not use. `status`: 400 bad or undecodable input, 403 a
    local path or remote URL the policy forbids, 413 too large (bytes or seconds)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class MediaPolicy:
    """What the operator allows. `allowed_local_media_path` None: no `file://` at all."""

    allowed_local_media_path: str | None = None
    allow_remote: bool = False
    max_bytes: int = 10 * MiB
    max_seconds: float = 60.0
    timeout_s: float = 10.0


async def resolve_ref_audio(value: str, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    """Reads one reference clip -> (mono float32 samples, sample rate); raises MediaError.

    Accepted: `data:audio/...;base64,...`, bare base64, `file://` URLs (only under the allowed local media
    path) and `http(s)://` URLs (only with `allow_remote`). Plain filesystem paths are refused: a local file
    must be named as a `file://` URL, so a path can never be mistaken for base64 or vice versa.
    """
    if not isinstance(value, str) or not value.strip():
        raise MediaError(400, "ref_audio is empty")
    value = value.strip()
    m = _SCHEME.match(value)
    scheme = m.group(1).lower() if m else None
    if scheme == "data":
        data = await asyncio.to_thread(_decode_data_url, value, policy)
    elif scheme == "file":
        data = await asyncio.to_thread(_read_local, value, policy)
    elif scheme in ("http", "https"):
        data = await _fetch_remote(value, policy)
    elif scheme is not None:
        # base64 has no ':' so anything with a scheme-like prefix was meant as a URL
        raise MediaError(400, f"unsupported ref_audio URL scheme {scheme!r}: use a data: URL, base64, "
                              "file:// or http(s)://")
    else:
        data = await asyncio.to_thread(_decode_base64, value, policy)
    return await decode_ref_audio(data, policy)


async def decode_ref_audio(data: bytes, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    """Decodes audio bytes (an upload, or what `resolve_ref_audio` fetched) under the policy's limits."""
    if len(data) > policy.max_bytes:
        raise MediaError(413, f"ref_audio is {len(data)} bytes; the limit is {policy.max_bytes}")
    if not data:
        raise MediaError(400, "ref_audio is empty")
    return await asyncio.to_thread(_decode, data, policy.max_seconds)


def _decode(data: bytes, max_seconds: float) -> tuple[np.ndarray, int]:
    # The header's length is checked first: a few KiB of FLAC silence can decode to hours of samples.
    declared = _declared_seconds(data)
    if declared is not None and declared > max_seconds:
        raise MediaError(413, f"ref_audio is {declared:.1f} s long; the limit is {max_seconds:g} s")
    try:
        samples, sr = read_audio(data)
    except AudioError as e:
        raise MediaError(400, f"ref_audio: {e}") from e
    seconds = len(samples) / sr
    if seconds > max_seconds:
        raise MediaError(413, f"ref_audio is {seconds:.1f} s long; the limit is {max_seconds:g} s")
    if not np.isfinite(samples).all():
        raise MediaError(400, "ref_audio contains NaN or infinite samples")
    return samples, sr


def _declared_seconds(data: bytes) -> float | None:
    import soundfile as sf

    try:
        info = sf.info(io.BytesIO(data))
    except Exception:  # undecodable: read_audio reports it with its own message
        return None
    if info.samplerate <= 0 or info.frames <= 0:
        return None
    return info.frames / info.samplerate


def _check_encoded_size(encoded_len: int, policy: MediaPolicy) -> None:
    # 4 base64 characters carry 3 bytes; refuse before allocating the decoded copy
    if encoded_len // 4 * 3 > policy.max_bytes + 3:
        raise MediaError(413, f"ref_audio is about {encoded_len // 4 * 3} bytes; the limit is {policy.max_bytes}")


def _decode_base64(text: str, policy: MediaPolicy) -> bytes:
    compact = _strip_whitespace(text)  # line breaks (as `base64` writes them) carry no data
    _check_encoded_size(len(compact), policy)
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as e:
        if text.startswith(("/", "~", ".")):
            raise MediaError(400, "ref_audio looks like a file path: give local files as file:// URLs") from e
        raise MediaError(400, "ref_audio is neither a URL (data:, file://, http(s)://) nor valid base64") from e


def _decode_data_url(url: str, policy: MediaPolicy) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError(400, "malformed data URL: no ',' after the media type")
    params = [p.strip().lower() for p in header[len("data:"):].split(";")]
    mime = params[0]
    if "base64" not in params[1:]:
        raise MediaError(400, "data URL must be base64-encoded (data:audio/wav;base64,...)")
    if mime and not (mime.startswith("audio/") or mime == "application/octet-stream"):
        raise MediaError(400, f"data URL media type {mime!r} is not audio")
    compact = _strip_whitespace(payload)
    _check_encoded_size(len(compact), policy)
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(400, "data URL payload is not valid base64") from e


def _read_local(url: str, policy: MediaPolicy) -> bytes:
    """Reads a `file://` URL if it resolves inside the allowed directory (runs on a worker thread)."""
    if not policy.allowed_local_media_path:
        raise MediaError(403, "file:// ref_audio is disabled: the server was started without an allowed "
                              "local media path (--allowed-local-media-path)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(400, f"file:// URL names a remote host {parts.netloc!r}")
    path = unquote(parts.path)
    if not path.startswith("/") or "\x00" in path:
        raise MediaError(400, "file:// URL must hold an absolute path (file:///dir/clip.wav)")
    root = os.path.realpath(policy.allowed_local_media_path)
    real = os.path.realpath(path)  # resolves symlinks and '..' before the containment check
    if os.path.commonpath([root, real]) != root:
        raise MediaError(403, "ref_audio file is outside the server's allowed local media path "
                              "(--allowed-local-media-path)")
    try:
        # O_NOFOLLOW: `real` has no symlinks left, so a link appearing there now is a swap; refuse it.
        # O_NONBLOCK: opening a FIFO must not hang the thread (regular files ignore the flag).
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise MediaError(400, f"cannot open ref_audio file: {e.strerror}") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise MediaError(400, "ref_audio file is not a regular file")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > policy.max_bytes:
            raise MediaError(413, f"ref_audio file is {st.st_size} bytes; the limit is {policy.max_bytes}")
        data = f.read(policy.max_bytes + 1)  # the file may have grown since fstat
    if len(data) > policy.max_bytes:
        raise MediaError(413, f"ref_audio file is over the limit of {policy.max_bytes} bytes")
    return data


async def _fetch_remote(url: str, policy: MediaPolicy) -> bytes:
    if not policy.allow_remote:
        raise MediaError(403, "remote ref_audio URLs are disabled on this server (--allow-remote-media)")
    try:
        # httpx's timeout bounds each read; wait_for bounds the whole download against a slow drip
        return await asyncio.wait_for(_download(url, policy), timeout=policy.timeout_s)
    except asyncio.TimeoutError as e:
        raise MediaError(400, f"fetching ref_audio timed out after {policy.timeout_s:g} s") from e


async def _download(url: str, policy: MediaPolicy) -> bytes:
    import httpx

    try:
        async with httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=True) as http:
            async with http.stream("GET", url) as resp:
                if resp.status_code >= 400:
                    raise MediaError(400, f"fetching ref_audio failed: HTTP {resp.status_code}")
                declared = resp.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > policy.max_bytes:
                    raise MediaError(413, f"remote ref_audio is {declared} bytes; the limit is {policy.max_bytes}")
                buf = bytearray()
                async for chunk in resp.aiter_bytes():
                    buf += chunk
                    if len(buf) > policy.max_bytes:
                        raise MediaError(413, f"remote ref_audio is over the limit of {policy.max_bytes} bytes")
                return bytes(buf)
    except httpx.TimeoutException as e:
        raise MediaError(400, f"fetching ref_audio timed out after {policy.timeout_s:g} s") from e
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise MediaError(400, f"fetching ref_audio failed: {type(e).__name__}: {e}") from e
