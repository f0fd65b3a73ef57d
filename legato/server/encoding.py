"""Audio response formats: whole files and streams, in wav, pcm, flac, mp3 and opus.

Every format carries mono audio, at the model's rate unless the request asks for another (`sample_rate`:
streaming.py resamples before encoding, resample.py). PCM is s16le; WAV is that PCM behind a header (exact
sizes in a file, sizes left open, 0xFFFFFFFF, in a stream, which streaming players accept); FLAC is
file-only (soundfile cannot emit it chunk by chunk). MP3 (LAME) and Opus in Ogg come from libsndfile through
`soundfile`, the library the server already reads audio with: a stream encoder keeps one libsndfile writer
open per response and sends the bytes each chunk adds, so any prefix of a stream decodes and the whole
stream decodes to the audio. MP3 is constant-bitrate, so a decoder can size a stream from its bytes: 80 kbit/s
by default, or any bitrate of the MPEG layer III table for the sample rate (`mp3_bitrates`), which libsndfile
reaches through its compression level (a linear map onto the table's range, LAME taking the exact value).
A file closes its writer, which lets libsndfile fill in the MP3 header frame (LAME's encoder
delay and padding, so decoders trim to the exact sample count); a stream cannot go back to its first bytes,
so it goes out without that header frame and decodes to the audio plus the encoder's delay and padding
(under 100 ms). Opus streams decode to the exact sample count. AAC needs an encoder libsndfile does not have
(FFmpeg or fdk-aac), so it is refused with a 400 instead.
"""

from __future__ import annotations

import io
import logging
import threading
from dataclasses import dataclass

import numpy as np

from legato.models.qwen3_tts.audio import encode_wav, to_pcm16, wav_header

log = logging.getLogger(__name__)

MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg; codecs=opus", "wav": "audio/wav", "pcm": "audio/pcm",
               "flac": "audio/flac"}
STREAMABLE = ("mp3", "opus", "wav", "pcm")
UNSUPPORTED = {"aac": "aac is not supported: this server's audio library (libsndfile) has no AAC encoder; "
                      "use mp3, opus, wav, flac or pcm"}
# Sample rates the Opus codec runs at (the Qwen3-TTS codec's 24 kHz is one of them), and those a response of
# another format may ask for: the MPEG rates LAME encodes (and every rate WAV, PCM and FLAC carry).
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
OUTPUT_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
# MP3 constant bitrates (kbit/s) by sample rate: MPEG-1 at 32 kHz and up, MPEG-2 at 16-24 kHz, MPEG-2.5 below.
# libsndfile maps its compression level c linearly onto [top, bottom]: kbit/s = top - c * (top - bottom).
_MP3_TABLES = ((32000, (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)),
               (16000, (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)),
               (0, (8, 16, 24, 32, 40, 48, 56, 64)))
MP3_DEFAULT_KBPS = 80  # below 16 kHz, where MPEG-2.5 tops out at 64, the default is 64
# libsndfile commands (sndfile.h): how much audio an Ogg page may hold before it is written; the encoder's
# compression level (0 best .. 1 smallest); the MP3 bitrate mode.
_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302
_SFC_SET_COMPRESSION_LEVEL = 0x1301
_SFC_SET_BITRATE_MODE = 0x1305
_BITRATE_CONSTANT = 0
_SOUNDFILE = {"mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}


@dataclass(frozen=True, slots=True)
class AudioFormat:
    """How a response carries its audio: the format, the sample rate (None: the model's) and, for mp3, the
    constant bitrate in kbit/s (None: the default)."""

    fmt: str
    sample_rate: int | None = None
    mp3_kbps: int | None = None


def media_type(fmt: str) -> str:
    return MEDIA_TYPES[fmt]


def mp3_bitrates(sample_rate: int) -> tuple[int, ...]:
    """The constant MP3 bitrates (kbit/s) at `sample_rate`."""
    return next(table for floor, table in _MP3_TABLES if sample_rate >= floor)


def format_problem(fmt: str, sample_rate: int) -> str | None:
    """Why `fmt` cannot carry audio at `sample_rate`, or None."""
    if fmt in UNSUPPORTED:
        return UNSUPPORTED[fmt]
    if fmt == "opus" and sample_rate not in OPUS_RATES:
        return f"opus cannot carry {sample_rate} Hz audio (Opus runs at {', '.join(map(str, OPUS_RATES))} Hz)"
    return None


def sample_rate_problem(fmt: str, sample_rate: int) -> str | None:
    """Why a response in `fmt` cannot be asked for at `sample_rate`, or None."""
    rates = OPUS_RATES if fmt == "opus" else OUTPUT_RATES
    if sample_rate not in rates:
        return f"{sample_rate} Hz is not offered for {fmt}; sample rates: {', '.join(map(str, rates))}"
    return None


def mp3_bitrate_problem(fmt: str, sample_rate: int, kbps: int) -> str | None:
    """Why an `fmt` response at `sample_rate` cannot have the mp3 bitrate `kbps`, or None."""
    if fmt != "mp3":
        return f"mp3_bitrate sets the bitrate of mp3 responses; this one is {fmt}"
    if kbps not in mp3_bitrates(sample_rate):
        return (f"mp3 at {sample_rate} Hz has no {kbps} kbit/s; its constant bitrates: "
                f"{', '.join(map(str, mp3_bitrates(sample_rate)))}")
    return None


def audio_options_problem(fmt: str, sample_rate: int | None, mp3_kbps: int | None,
                          model_rate: int) -> tuple[str, str, str] | None:
    """Why a response in `fmt` at `sample_rate` (None: the model's) and `mp3_kbps` cannot be made, as (message,
    code, field) for the error; None if it can. HTTP and the streaming-text socket refuse alike."""
    if (problem := format_problem(fmt, model_rate)) is not None:
        return f"response_format {problem}", "unsupported_format", "response_format"
    if sample_rate is not None and (problem := sample_rate_problem(fmt, sample_rate)):
        return f"sample_rate: {problem}", "unsupported_sample_rate", "sample_rate"
    if mp3_kbps is not None and (problem := mp3_bitrate_problem(fmt, sample_rate or model_rate, mp3_kbps)):
        return f"mp3_bitrate: {problem}", "unsupported_bitrate", "mp3_bitrate"
    return None


def encode_file(samples: np.ndarray, sample_rate: int, fmt: str, mp3_kbps: int | None = None) -> bytes:
    """A complete response body in `fmt` (mp3 at `mp3_kbps`, default MP3_DEFAULT_KBPS)."""
    if fmt == "wav":
        return encode_wav(samples, sample_rate)
    if fmt == "pcm":
        return to_pcm16(samples)
    if fmt == "flac":
        return _encode_with_soundfile(samples, sample_rate, "FLAC", "PCM_16")
    if fmt in _SOUNDFILE:
        return _encode_with_soundfile(samples, sample_rate, *_SOUNDFILE[fmt], mp3_kbps=mp3_kbps)
    raise ValueError(f"unsupported format {fmt!r}; supported: {', '.join(MEDIA_TYPES)}")


def _encode_with_soundfile(samples: np.ndarray, sample_rate: int, container: str, subtype: str,
                           mp3_kbps: int | None = None) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", samplerate=sample_rate, channels=1, format=container, subtype=subtype) as f:
        if container == "MP3":
            _constant_bitrate(f, sample_rate, mp3_kbps)
        f.write(_quantised(samples))
    return buf.getvalue()


def _quantised(samples: np.ndarray) -> np.ndarray:
    """The samples as 16-bit PCM sees them, so every format encodes the same quantised audio."""
    return np.frombuffer(to_pcm16(samples), dtype="<i2")


class StreamEncoder:
    """Bytes of one streamed response: `start()` once, `encode(samples)` per chunk, `finish()` at the end, or
    `close()` for a stream that ended early. Calls may come from different threads (the server encodes on
    worker threads): a lock makes them one at a time, so `close()` never frees the writer under an `encode`
    still running for a client that left."""

    def __init__(self, fmt: str, sample_rate: int, mp3_kbps: int | None = None) -> None:
        if fmt not in STREAMABLE:
            raise ValueError(f"{fmt} cannot be streamed; streamable: {', '.join(STREAMABLE)}")
        self.fmt = fmt
        self.sample_rate = sample_rate
        self.mp3_kbps = mp3_kbps
        self._sink: _AppendOnlySink | None = None
        self._writer = None
        self._head: bytearray | None = None  # MP3: the first bytes, until LAME's header frame is dropped
        self._lock = threading.Lock()

    def start(self) -> bytes:
        with self._lock:
            return self._start()

    def encode(self, samples: np.ndarray) -> bytes:
        with self._lock:
            return self._encode(samples)

    def finish(self) -> bytes:
        with self._lock:
            return self._finish()

    def close(self) -> None:
        """Drops the writer of a stream that ended early (no bytes are produced)."""
        with self._lock:
            if self._writer is not None:
                try:
                    self._writer.close()
                except Exception:  # the stream is gone; a failing close must not mask why
                    log.debug("closing an abandoned %s encoder failed", self.fmt, exc_info=True)
                self._writer = None

    def _start(self) -> bytes:
        if self.fmt == "wav":
            return wav_header(self.sample_rate, None)
        if self.fmt == "pcm":
            return b""
        import soundfile as sf

        container, subtype = _SOUNDFILE[self.fmt]
        self._sink = _AppendOnlySink()
        self._writer = sf.SoundFile(self._sink, "w", samplerate=self.sample_rate, channels=1, format=container,
                                    subtype=subtype)
        if self.fmt == "opus":
            _flush_every_ogg_packet(self._writer)
        else:
            _constant_bitrate(self._writer, self.sample_rate, self.mp3_kbps)
            self._head = bytearray()
        return self._taken()

    def _encode(self, samples: np.ndarray) -> bytes:
        if self.fmt in ("pcm", "wav"):
            return to_pcm16(samples)
        if self._writer is None:  # closed: the stream has ended
            return b""
        if samples.size:
            self._writer.write(_quantised(samples))
        return self._taken()

    def _finish(self) -> bytes:
        if self._writer is None:  # pcm, wav, or closed
            return b""
        self._writer.close()  # flushes the encoder's tail (and rewrites a header that was already sent)
        self._writer = None
        data = self._taken()
        if self.fmt == "mp3" and self._head:  # a stream too short to pass its header frame: send what there is
            data, self._head = bytes(self._head) + data, None
        return data

    def _taken(self) -> bytes:
        data = self._sink.take()
        if self.fmt != "mp3" or self._head is None:
            return data
        # LAME reserves the first MP3 frame for a header (lengths, delay) filled in only at close: a frame of
        # zeros here, which would decode as a frame of silence. The stream leaves it out.
        self._head += data
        size = _mpeg_frame_size(self._head)
        if size is None or len(self._head) < size:
            return b""
        head, self._head = bytes(self._head), None
        return head[size:] if not any(head[4:size]) else head


class _AppendOnlySink(io.RawIOBase):
    """A seekable in-memory file for libsndfile whose new bytes can be taken off as they are written.
    Writes into bytes already taken (libsndfile finishing a header at close) change only the copy here."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = bytearray()
        self._pos = 0
        self._taken = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        data = bytes(data)
        end = self._pos + len(data)
        if end > len(self._buf):
            self._buf.extend(b"\0" * (end - len(self._buf)))
        self._buf[self._pos : end] = data
        self._pos = end
        return len(data)

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), len(self._buf) - self._pos))
        buffer[:n] = self._buf[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._buf)}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def take(self) -> bytes:
        """The bytes written past what was taken before."""
        out = bytes(self._buf[self._taken :])
        self._taken = len(self._buf)
        return out


# Layer III bitrates (kbit/s) by index, for MPEG-1 and for MPEG-2/2.5; sample rates by version and index.
_L3_KBPS = {1: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
            2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)}
_MPEG_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def _mpeg_frame_size(data: bytes | bytearray) -> int | None:
    """Bytes of the MPEG Layer III frame that `data` starts with (None: not enough bytes, or no frame)."""
    if len(data) < 4 or data[0] != 0xFF or data[1] & 0xE0 != 0xE0:
        return None
    version, layer = (data[1] >> 3) & 3, (data[1] >> 1) & 3
    rate_index, bitrate_index, padding = (data[2] >> 2) & 3, data[2] >> 4, (data[2] >> 1) & 1
    if layer != 1 or version not in _MPEG_RATES or rate_index == 3 or bitrate_index in (0, 15):
        return None
    kbps = _L3_KBPS[1 if version == 3 else 2][bitrate_index]
    return (144 if version == 3 else 72) * kbps * 1000 // _MPEG_RATES[version][rate_index] + padding


def _constant_bitrate(writer, sample_rate: int, kbps: int | None) -> None:
    table = mp3_bitrates(sample_rate)
    kbps = max(k for k in table if k <= MP3_DEFAULT_KBPS) if kbps is None else kbps
    if kbps not in table:
        raise ValueError(f"mp3 at {sample_rate} Hz has no {kbps} kbit/s (constant bitrates: {table})")
    top, bottom = table[-1], table[0]
    # libsndfile truncates top - level * (top - bottom) to an int: aim half a kbit/s above, never below.
    level = min(1.0, max(0.0, (top - kbps - 0.5) / (top - bottom)))
    _command(writer, _SFC_SET_BITRATE_MODE, "int", _BITRATE_CONSTANT, success=0)
    _command(writer, _SFC_SET_COMPRESSION_LEVEL, "double", level, success=1)


def _command(writer, command: int, ctype: str, value, success: int) -> None:
    """`sf_command` on an open soundfile (the package exposes no wrapper for these settings). libsndfile
    answers 1 (SF_TRUE) for some commands and 0 for others when they succeed (libsndfile 1.2)."""
    from soundfile import _ffi, _snd

    arg = _ffi.new(f"{ctype}*", value)
    if _snd.sf_command(writer._file, command, arg, _ffi.sizeof(ctype)) != success:
        raise RuntimeError(f"libsndfile refused command {command:#x}")


def _flush_every_ogg_packet(writer) -> None:
    """Asks libsndfile to write an Ogg page as soon as it holds audio, instead of about a second of it, so
    each chunk's Opus packets leave with the chunk. Without the command (an old libsndfile) pages are still
    valid, just later."""
    try:
        _command(writer, _SFC_SET_OGG_PAGE_LATENCY_MS, "double", 0.0, success=0)
    except Exception:
        log.warning("libsndfile cannot shorten Ogg pages: opus streams will arrive in ~1 s pages", exc_info=True)
