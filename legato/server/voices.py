"""Saved voices for Base (voice-clone) models: a reference clip analysed once, reused by name.

A voice made from audio runs the speaker encoder and the codec encoder once, at upload; the x-vector and
the reference codes are stored, so a speech request naming the voice skips both encoders.

On disk each voice is one `<lower-cased name>.safetensors` file under the store's directory: tensors
`speaker_embedding` [hidden] float32 and, for in-context cloning, `ref_code` [T, 16] int64; everything
else in the file's string metadata. A file is written under a temporary dot-name, fsynced and renamed
over the final name, so a crash leaves either the old voice, the new one, or an ignored temporary file,
never half a voice. A store belongs to one server process, unless it is `shared` (the fronts of
`legato serve --fronts N`): then each lookup checks the voice's file (one stat), so a voice one front saves
or deletes is seen by the others at their next request naming it, and a listing reads the directory. Two
fronts saving one name at once: the later rename wins.

A voice without `ref_text` (or made with `x_vector_only`) keeps only the x-vector: the reference codes
are useless without the transcript, so they are not stored and the voice clones in x-vector-only mode.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from legato.pipeline.client import EngineClient, RequestRejected
from legato.server.text import check_unicode, is_blank

log = logging.getLogger(__name__)

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"  # the whole name (fullmatch)
_NAME = re.compile(NAME_PATTERN)
MAX_REF_TEXT_CHARS = 4096
_FORMAT = "1"
_SUFFIX = ".safetensors"
_TMP_PREFIX = ".tmp-"  # names cannot start with '.', so temporaries never collide with voices
QUARANTINE_DIR = "quarantine"  # voice files that fail validation at start-up are moved here, not served


class VoiceError(Exception):
    """A voice request the store refuses; `status` follows HTTP (400, 404, 409)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Voice:
    name: str
    speaker_embedding: torch.Tensor  # [hidden] float32 CPU
    ref_code: torch.Tensor | None  # [T, 16] int64 CPU; None: x-vector-only voice
    ref_text: str | None
    created_at: float
    source: str  # "audio" | "embedding"

    @property
    def x_vector_only(self) -> bool:
        return self.ref_code is None

    def speech_fields(self) -> dict:
        """The `SpeechInput` fields that make a request speak in this voice."""
        return {
            "speaker_embedding": self.speaker_embedding,
            "ref_code": self.ref_code,
            "ref_text": self.ref_text if self.ref_code is not None else None,
            "x_vector_only": self.ref_code is None,
        }

    def info(self) -> VoiceInfo:
        return VoiceInfo(
            name=self.name, created_at=self.created_at, source=self.source,
            has_ref_code=self.ref_code is not None, ref_text=self.ref_text,
            ref_frames=0 if self.ref_code is None else int(self.ref_code.shape[0]),
        )


@dataclass
class VoiceInfo:
    """What a listing shows of a voice (no tensors)."""

    name: str
    created_at: float
    source: str
    has_ref_code: bool
    ref_text: str | None
    ref_frames: int

    def to_dict(self) -> dict:
        return {
            "name": self.name, "created_at": self.created_at, "source": self.source,
            "has_ref_code": self.has_ref_code, "ref_text": self.ref_text, "ref_frames": self.ref_frames,
        }


def validate_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise VoiceError(400, "voice name must be 1-64 characters of letters, digits, '_', '.', '-', "
                              "starting with a letter or digit")
    return name


class VoiceStore:
    """Voices of one Base model, persisted under `root_dir`. Names are unique ignoring case.

    Methods are called from the server's event loop; engine work and file writes run off it.
    """

    def __init__(self, root_dir: str | Path, client: EngineClient, max_voices: int = 1000, *, shared: bool = False,
                 tidy: bool = True) -> None:
        self.root = Path(root_dir)
        self.client = client
        self.max_voices = max_voices
        self.shared = shared  # other processes change the directory too: files are checked at each lookup
        self.tidy = tidy  # removes unfinished writes and quarantines bad files at start (one process of many)
        self._voices: dict[str, Voice] = {}  # lower-cased name -> voice
        self._stamps: dict[str, tuple[int, int, int]] = {}  # shared: each loaded file's (inode, size, mtime)
        self._pending: set[str] = set()  # names being created or deleted (reserved across their awaits)
        self.root.mkdir(parents=True, exist_ok=True)
        if client.info.model_type == "base":
            self._load_all()
        else:
            log.info("model is %s, not base: saved voices in %s are not loaded", client.info.model_type, self.root)

    # --- queries --------------------------------------------------------------------------------------

    def get(self, name: str) -> Voice | None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):  # not a name a voice can have (see delete)
            return None
        key = name.lower()
        if self.shared:
            self._sync(key)
        return self._voices.get(key)

    def list(self) -> list[VoiceInfo]:
        if self.shared:
            on_disk = {p.name[: -len(_SUFFIX)] for p in self.root.glob(f"*{_SUFFIX}") if not p.name.startswith(".")}
            for key in on_disk | set(self._voices):
                self._sync(key)
        return [v.info() for _, v in sorted(self._voices.items())]

    def __len__(self) -> int:
        return len(self._voices)

    # --- changes --------------------------------------------------------------------------------------

    async def create(
        self,
        name: str,
        audio: tuple[np.ndarray, int] | None = None,
        ref_text: str | None = None,
        speaker_embedding: list[float] | None = None,
        x_vector_only: bool = False,
        replace: bool = False,
    ) -> Voice:
        """Saves a voice from a clip (`audio` = (mono samples, rate); the engine analyses it once) or from a
        precomputed x-vector. Raises VoiceError: 400 bad input or not a Base model, 409 name taken (unless
        `replace`) or store full."""
        key = self.precheck(name, replace)
        if not x_vector_only and isinstance(ref_text, str) and is_blank(ref_text):  # as the speech route does
            raise VoiceError(400, "ref_text is blank (only spaces or invisible characters): give the transcript of "
                                  "the reference audio, or leave ref_text out for an x-vector-only voice")
        ref_text = _clean_ref_text(ref_text)
        if (audio is None) == (speaker_embedding is None):
            raise VoiceError(400, "give exactly one of reference audio or speaker_embedding")
        self._pending.add(key)  # no await since the checks above, so this reservation is race-free
        try:
            if audio is not None:
                voice = await self._from_audio(name, audio, ref_text, x_vector_only)
            else:
                if ref_text is not None:
                    raise VoiceError(400, "ref_text needs reference audio; a speaker_embedding voice is "
                                          "x-vector only")
                voice = Voice(name, self._embedding_tensor(speaker_embedding), None, None, time.time(),
                              "embedding")
            await asyncio.to_thread(self._write, key, voice)
            self._voices[key] = voice
            self._stamps[key] = _stamp(self._path(key))
            return voice
        finally:
            self._pending.discard(key)

    def precheck(self, name: str, replace: bool = False) -> str:
        """The checks `create` makes before any work (Base model, valid and free name, room left), for
        callers that want to refuse before decoding an upload. Returns the lower-cased key."""
        self.require_base()
        name = validate_name(name)
        key = name.lower()
        if key in self._pending:
            raise VoiceError(409, f"voice {name!r} is being changed by another request")
        if self.shared:
            self._sync(key)
        if key in self._voices and not replace:
            raise VoiceError(409, f"voice {name!r} already exists (delete it first, or set replace)")
        if key not in self._voices and len(self._voices) + len(self._pending) >= self.max_voices:
            raise VoiceError(409, f"the server holds its maximum of {self.max_voices} voices; delete one first")
        return key

    async def delete(self, name: str) -> bool:
        """Removes a voice; False if there was none by that name. Raises VoiceError(409) while another request
        is creating or replacing it (the key stays reserved across the file removal for the same reason), and
        VoiceError(400) on a model other than Base, as `create` (its presets are not saved voices to delete)."""
        self.require_base()
        # Only a name a voice could have: str.lower() folds some non-ASCII letters to ASCII (the Kelvin sign
        # U+212A to "k"), so "\u212ax" named, and deleted, the voice "kx".
        key = name.lower() if isinstance(name, str) and _NAME.fullmatch(name) else None
        if key is not None and self.shared:
            self._sync(key)
        if key is None or key not in self._voices:
            return False
        if key in self._pending:
            raise VoiceError(409, f"voice {name!r} is being changed by another request")
        self._pending.add(key)
        try:
            await asyncio.to_thread(self._unlink, key)
            self._voices.pop(key, None)
            self._stamps.pop(key, None)
        finally:
            self._pending.discard(key)
        return True

    # --- helpers --------------------------------------------------------------------------------------

    def require_base(self) -> None:
        info = self.client.info
        if info.model_type != "base":
            raise VoiceError(400, f"saved voices need a Base (voice-clone) model; this server runs a "
                                  f"{info.model_type} model")

    async def _from_audio(self, name: str, audio: tuple[np.ndarray, int], ref_text: str | None,
                          x_vector_only: bool) -> Voice:
        samples, rate = audio
        samples = np.asarray(samples, dtype=np.float32)
        if samples.ndim != 1 or samples.size == 0 or not isinstance(rate, (int, np.integer)) or rate <= 0:
            raise VoiceError(400, "reference audio must be non-empty mono samples with a positive sample rate")
        try:
            feats = await self.client.extract_voice(samples, int(rate))
        except RequestRejected as e:
            raise VoiceError(e.status, f"cannot use the reference audio: {e.message}") from e
        emb = feats.speaker_embedding.detach().to("cpu", torch.float32).reshape(-1).contiguous()
        keep_codes = not x_vector_only and ref_text is not None
        code = feats.ref_code.detach().to("cpu", torch.int64).contiguous() if keep_codes else None
        return Voice(name, emb, code, ref_text if keep_codes else None, time.time(), "audio")

    def _embedding_tensor(self, values: object) -> torch.Tensor:
        try:
            return parse_speaker_embedding(values, self.client.info.hidden_size)
        except ValueError as e:
            raise VoiceError(400, str(e)) from e

    def _path(self, key: str) -> Path:
        return self.root / f"{key}{_SUFFIX}"

    def _write(self, key: str, voice: Voice) -> None:
        tensors = {"speaker_embedding": voice.speaker_embedding}
        if voice.ref_code is not None:
            tensors["ref_code"] = voice.ref_code
        meta = {
            "format": _FORMAT, "name": voice.name, "created_at": repr(voice.created_at), "source": voice.source,
            "ref_text": json.dumps(voice.ref_text),
        }
        tmp = self.root / f"{_TMP_PREFIX}{uuid.uuid4().hex}{_SUFFIX}"
        try:
            save_file(tensors, str(tmp), metadata=meta)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self._path(key))
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(self.root)

    def _unlink(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
        _fsync_dir(self.root)

    def _sync(self, key: str) -> None:
        """Shared store: the voice `key` as its file is now (gone, new, or replaced by another process)."""
        if key in self._pending:  # this process is changing it
            return
        path = self._path(key)
        stamp = _stamp(path)
        if stamp == self._stamps.get(key):
            return
        self._voices.pop(key, None)
        self._stamps.pop(key, None)
        if stamp is None:
            return
        try:
            voice = self._read(path)
        except Exception as e:  # mid-replace or bad: not served; the process that starts first tidies it
            log.warning("not serving voice file %s: %s", path, e)
            return
        self._voices[key], self._stamps[key] = voice, stamp

    def _load_all(self) -> None:
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(_TMP_PREFIX):
                if self.tidy:  # another process's write may be under way otherwise
                    log.warning("removing %s: a voice write that never finished", path)
                    path.unlink(missing_ok=True)
                continue
            if path.suffix != _SUFFIX or path.name.startswith("."):
                continue
            try:
                voice = self._read(path)
            except Exception as e:  # one bad file must not keep the server from starting, nor be served
                if self.tidy:
                    self._quarantine(path, e)
                else:
                    log.warning("not serving voice file %s: %s", path, e)
                continue
            self._voices[voice.name.lower()] = voice
            self._stamps[voice.name.lower()] = _stamp(path)
        if self._voices:
            log.info("loaded %d saved voices from %s", len(self._voices), self.root)

    def _quarantine(self, path: Path, why: Exception) -> None:
        """Moves a voice file that fails validation out of the store (kept for its owner to inspect)."""
        target = self.root / QUARANTINE_DIR / f"{path.name}.{int(time.time())}"
        try:
            target.parent.mkdir(exist_ok=True)
            os.replace(path, target)
        except OSError as e:
            log.warning("voice file %s is invalid (%s) and could not be quarantined (%s): not serving it", path,
                        why, e)
            return
        log.warning("quarantined voice file %s -> %s: %s", path, target, why)

    def _read(self, path: Path) -> Voice:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if meta.get("format") != _FORMAT:
            raise ValueError(f"unknown voice format {meta.get('format')!r}")
        name = validate_name(meta.get("name"))
        if name.lower() != path.name[: -len(_SUFFIX)]:
            raise ValueError(f"file name does not match the voice name {name!r}")
        emb = tensors.get("speaker_embedding")
        hidden = self.client.info.hidden_size
        if emb is None or emb.dtype != torch.float32 or tuple(emb.shape) != (hidden,):
            raise ValueError(f"speaker_embedding is not float32 [{hidden}] (a voice of another model?)")
        if not torch.isfinite(emb).all():
            raise ValueError("speaker_embedding is not finite")
        code = tensors.get("ref_code")
        if code is not None and (code.dtype != torch.int64 or code.ndim != 2 or code.shape[1] != 16):
            raise ValueError("ref_code is not int64 [T, 16]")
        ref_text = json.loads(meta.get("ref_text", "null"))
        if ref_text is not None:  # the rules of a new voice: a file edited or written by an older version
            try:
                if _clean_ref_text(ref_text) != ref_text:
                    raise ValueError("ref_text is not stored stripped")
            except VoiceError as e:
                raise ValueError(e.message) from e
        if code is not None and ref_text is None:
            raise ValueError("ref_code without its ref_text")
        source = meta.get("source")
        if source not in ("audio", "embedding"):
            raise ValueError(f"unknown source {source!r}")
        return Voice(name, emb, code, ref_text, float(meta["created_at"]), source)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What tells one version of a voice file from another (a replace is a rename: a new inode)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _clean_ref_text(ref_text: object) -> str | None:
    if ref_text is None:
        return None
    if not isinstance(ref_text, str):
        raise VoiceError(400, "ref_text must be a string")
    try:
        check_unicode(ref_text)
    except ValueError as e:
        raise VoiceError(400, f"ref_text {e}") from e
    ref_text = ref_text.strip()
    if len(ref_text) > MAX_REF_TEXT_CHARS:
        raise VoiceError(400, f"ref_text is {len(ref_text)} characters; the limit is {MAX_REF_TEXT_CHARS}")
    return ref_text or None


def _fsync_dir(path: Path) -> None:
    # makes the rename itself durable; not every filesystem allows opening a directory
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def parse_speaker_embedding(values: object, hidden: int) -> torch.Tensor:
    """A client-supplied x-vector as a float32 [hidden] tensor; ValueError says what is wrong with it."""
    if not isinstance(values, (list, tuple)) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
    ):
        raise ValueError("speaker_embedding must be a list of numbers")
    if len(values) != hidden:
        raise ValueError(f"speaker_embedding has {len(values)} values; this model needs {hidden}")
    if not all(math.isfinite(v) for v in values):
        raise ValueError("speaker_embedding contains NaN or infinite values")
    t = torch.tensor(values, dtype=torch.float32)
    if not torch.isfinite(t).all():
        raise ValueError("speaker_embedding values overflow float32")
    return t
