"""Reference audio from a request field: data URLs, bare base64, `file://` and `http(s)://` URLs.

Everything a client sends here is untrusted, so each source is checked before any bytes are decoded:
local files only inside the directory the operator allowed (after resolving symlinks and `..`), remote
URLs only when the operator opted in and only from public addresses (`remote_media`), every source capped
in bytes before decoding and in seconds from its header before a sample is decoded. A clip must then be
real audio worth cloning: finite, long enough, not silent. Every refusal is a MediaError with a plain
message. Decoding and file reads run on worker threads so a large clip never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import os
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import numpy as np

from legato.models.qwen3_tts.inputs import voice_key

MiB = 1024 * 1024
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Rates a voice recording plausibly has (telephone to studio); outside them the header is lying or the file
# is not speech, and a huge declared rate would let a short header ask for an enormous decode.
MIN_RATE, MAX_RATE = 8000, 192000
# -80 dBFS: below one step of 13-bit audio, so only digital silence or dither; no speaker embedding in it
SILENCE_PEAK = 1e-4
MAX_PEAK = 1e3  # a float WAV's samples are within [-1, 1]; far beyond, they overflow the encoders
_UNKNOWN_FRAMES = 1 << 62
_BLOCK_SAMPLES = 1 << 20  # interleaved samples per decoded block (4 MiB as float32)
_UNREADABLE = "ref_audio cannot be decoded: it is not a readable audio file (WAV, FLAC, OGG, MP3)"

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9A-Fa-f]+>")


def _strip_whitespace(text: str) -> str:
    # str.split() drops every run of whitespace in C: a regex over a few hundred KB of base64 per request
    # held the GIL long enough to slow the engine thread under load.
    return "".join(text.split())


class MediaError(Exception):
    """A reference-audio value the server will not use. `status`: 400 bad or undecodable input, 403 a
    local path or remote URL the policy forbids, 413 too large (bytes or seconds)."""

    def __init__(self, status: int, message: str) -> None:
        message = _plain(message)
        super().__init__(message)
        self.status = status
        self.message = message


def _plain(message: str) -> str:
    # libraries put object reprs in their errors ("<_io.BytesIO object at 0x7f...>"): they mean nothing
    # to a client and leak a server memory address
    return _OBJECT_REPR.sub("the audio data", message)


@dataclass
class MediaPolicy:
    """What the operator allows. `allowed_local_media_path` None: no `file://` at all.
    `allow_remote_networks`: CIDRs that remote URLs may reach although they are not public (an internal
    media server); strings are parsed here. `min_seconds`: shorter clips carry too little voice to clone."""

    allowed_local_media_path: str | None = None
    allow_remote: bool = False
    max_bytes: int = 10 * MiB
    max_seconds: float = 60.0
    timeout_s: float = 10.0
    allow_remote_networks: tuple[IPNetwork | str, ...] = ()
    min_seconds: float = 0.5

    def __post_init__(self) -> None:
        self.allow_remote_networks = parse_networks(self.allow_remote_networks)


def parse_networks(values: Iterable[object]) -> tuple[IPNetwork, ...]:
    """CIDR strings (or networks) -> networks; a bare address is a one-address network. Raises ValueError."""
    return tuple(ipaddress.ip_network(v, strict=False) for v in values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Clip:
    """A decoded reference clip: mono float32 samples (read-only when cached), their rate, and their
    `voice_key` when it was computed here (None: the engine's voice cache hashes them)."""

    samples: np.ndarray
    rate: int
    key: str | None = None


class ClipCache:
    """Decoded inline clips (data URLs and bare base64) by their exact text, least recently used out first.

    Clients that clone a voice send the same clip with every request; decoding its base64 and its audio
    again each time cost ~3 ms of CPU per request, much of it holding the GIL the event loop needs. Only
    inline values are cached: what a `file://` or remote URL names can change between requests. Only clips
    that passed every check are stored, so a hit needs none. Thread-safe (decoding runs on worker threads)."""

    def __init__(self, max_entries: int = 64, max_bytes: int = 256 * MiB) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, Clip] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, value: str) -> Clip | None:
        with self._lock:
            clip = self._entries.get(value)
            if clip is None:
                self.misses += 1
            else:
                self.hits += 1
                self._entries.move_to_end(value)
            return clip

    def put(self, value: str, clip: Clip) -> None:
        size = self._size(value, clip)
        if self.max_entries <= 0 or size > self.max_bytes:
            return
        clip.samples.flags.writeable = False  # shared by every request that sends this clip
        with self._lock:
            old = self._entries.pop(value, None)
            if old is not None:
                self._bytes -= self._size(value, old)
            self._entries[value] = clip
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                key, gone = self._entries.popitem(last=False)
                self._bytes -= self._size(key, gone)

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _size(value: str, clip: Clip) -> int:
        return len(value) + clip.samples.nbytes


async def resolve_ref_clip(value: str, policy: MediaPolicy, cache: ClipCache | None = None) -> Clip:
    """Reads one reference clip -> `Clip`; raises MediaError.

    Accepted: `data:audio/...;base64,...`, bare base64, `file://` URLs (only under the allowed local media
    path) and `http(s)://` URLs (only with `allow_remote`). Plain filesystem paths are refused: a local file
    must be named as a `file://` URL, so a path can never be mistaken for base64 or vice versa. Inline clips
    (data URLs, bare base64) are decoded, checked and keyed in one worker-thread hop, and remembered in
    `cache` when one is given; URLs are read each time (what they name can change) and left unkeyed.
    """
    if not isinstance(value, str) or not value.strip():
        raise MediaError(400, "ref_audio is empty")
    value = value.strip()
    m = _SCHEME.match(value)
    scheme = m.group(1).lower() if m else None
    if scheme in ("data", None):
        # A clip sent before is answered here: a hop to a worker thread and back costs the request two passes
        # of an event loop that, serving hundreds of streams, takes milliseconds each.
        known = cache.get(value) if cache is not None else None
        if known is not None:
            return known
        return await asyncio.to_thread(_inline_clip, value, scheme == "data", policy, cache)
    if scheme == "file":
        data = await asyncio.to_thread(_read_local, value, policy)
    elif scheme in ("http", "https"):
        from legato.server.remote_media import fetch_remote  # imports httpx: only remote fetches need it

        data = await fetch_remote(value, policy)
    else:
        # base64 has no ':' so anything with a scheme-like prefix was meant as a URL
        raise MediaError(400, f"unsupported ref_audio URL scheme {scheme!r}: use a data: URL, base64, "
                              "file:// or http(s)://")
    samples, rate = await decode_ref_audio(data, policy)
    return Clip(samples, rate)


def _inline_clip(value: str, is_data_url: bool, policy: MediaPolicy, cache: ClipCache | None) -> Clip:
    data = _decode_data_url(value, policy) if is_data_url else _decode_base64(value, policy)
    _check_size(data, policy)
    samples, rate = _decode(data, policy)
    clip = Clip(samples, rate, voice_key(samples, rate))
    if cache is not None:
        cache.put(value, clip)
    return clip


async def resolve_ref_audio(value: str, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    """`resolve_ref_clip` without a cache: (mono float32 samples, sample rate); raises MediaError."""
    clip = await resolve_ref_clip(value, policy)
    return clip.samples, clip.rate


async def decode_ref_audio(data: bytes, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    """Decodes audio bytes (an upload, or what `resolve_ref_audio` fetched) under the policy's limits."""
    _check_size(data, policy)
    return await asyncio.to_thread(_decode, data, policy)


def _check_size(data: bytes, policy: MediaPolicy) -> None:
    if len(data) > policy.max_bytes:
        raise MediaError(413, f"ref_audio is {len(data)} bytes; the limit is {policy.max_bytes}")
    if not data:
        raise MediaError(400, "ref_audio is empty")


def _decode(data: bytes, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    import soundfile as sf

    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            # The header is judged before any sample is decoded: a few KiB of FLAC can declare hours.
            _check_header(f.samplerate, f.channels, f.frames, policy)
            samples = _read_mono(f, policy)
            rate = int(f.samplerate)
    except MediaError:
        raise
    except Exception as e:  # LibsndfileError, and TypeError/ValueError/RuntimeError for odd input
        raise MediaError(400, f"{_UNREADABLE} ({_reason(e)})") from e
    _check_samples(samples, rate, policy)
    return samples, rate


def _reason(err: Exception) -> str:
    # libsndfile's own words ("Format not recognised"), without the "Error opening <BytesIO ...>" prefix
    text = getattr(err, "error_string", None) or str(err) or type(err).__name__
    return _plain(text).strip().rstrip(".")[:160]


def _check_header(rate: int, channels: int, frames: int, policy: MediaPolicy) -> None:
    if not MIN_RATE <= rate <= MAX_RATE:
        raise MediaError(400, f"ref_audio declares a sample rate of {rate} Hz; accepted rates are "
                              f"{MIN_RATE}-{MAX_RATE} Hz")
    if channels < 1:
        raise MediaError(400, f"ref_audio declares {channels} channels")
    # libsndfile reports a stream of unknown length (a FLAC without a sample count) as SF_COUNT_MAX:
    # not a claim to judge; reading stops at the limit instead
    if frames > policy.max_seconds * rate and frames < _UNKNOWN_FRAMES:
        raise MediaError(413, f"ref_audio is {frames / rate:.1f} s long; the limit is {policy.max_seconds:g} s")


def _read_mono(f, policy: MediaPolicy) -> np.ndarray:
    """Decodes block by block to mono, so memory is bounded by the mono clip, whatever the channel count,
    and stops once past the length limit whatever the header said."""
    limit = int(policy.max_seconds * f.samplerate)
    block_frames = max(1, _BLOCK_SAMPLES // f.channels)
    blocks: list[np.ndarray] = []
    total = 0
    while True:
        block = f.read(frames=block_frames, dtype="float32", always_2d=True)
        if not len(block):
            break
        blocks.append(block.mean(axis=1).astype(np.float32, copy=False))
        total += len(block)
        if total > limit:
            raise MediaError(413, f"ref_audio is longer than the limit of {policy.max_seconds:g} s")
    return np.concatenate(blocks) if blocks else np.zeros(0, np.float32)


def _check_samples(samples: np.ndarray, rate: int, policy: MediaPolicy) -> None:
    if not len(samples):
        raise MediaError(400, "ref_audio is empty: it holds no audio samples")
    if not np.isfinite(samples).all():
        raise MediaError(400, "ref_audio contains NaN or infinite samples")
    seconds = len(samples) / rate
    if seconds < policy.min_seconds:
        raise MediaError(400, f"ref_audio is {seconds * 1000:.0f} ms long; a reference clip must be at least "
                              f"{policy.min_seconds:g} s")
    peak = float(np.abs(samples).max())
    if peak > MAX_PEAK:
        raise MediaError(400, f"ref_audio has samples of magnitude {peak:.3g}: a float clip's samples lie within "
                              f"[-1, 1] (at most {MAX_PEAK:g} is taken)")
    if peak < SILENCE_PEAK:
        raise MediaError(400, f"ref_audio is silent (peak {_dbfs(peak)}, below {_dbfs(SILENCE_PEAK)}): a voice "
                              "cannot be cloned from silence")


def _dbfs(peak: float) -> str:
    return "-inf dBFS" if peak <= 0 else f"{20 * np.log10(peak):.0f} dBFS"


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
