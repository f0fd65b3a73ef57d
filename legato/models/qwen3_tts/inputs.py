"""From a user's request (text, voice, reference audio, instructions) to a `PromptSpec`.

This is where reference audio becomes a speaker embedding (x-vector) and codec codes, and where text is
tokenised with the model's templates. The offline API, the engine and the server all go through it, so
every entry point treats the same request the same way.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .audio import AudioError, resample
from .blank import is_blank
from .loader import LoadedModel
from .prompt import PromptError, PromptSpec, instruct_text_ids, ref_text_ids, target_text_ids, target_text_ids_of


@dataclass
class SpeechInput:
    """One utterance to synthesise.

    text: what to say; or `text_ids`, its token ids under the model's text tokenizer (without the chat
        template, which is added as for text), to drive the model with exactly the ids another
        implementation used. language: "auto" or a language name of the model.
    speaker: CustomVoice preset speaker. instructions: VoiceDesign voice description, or a CustomVoice
        style instruction (1.7B only).
    Base (voice clone): either `ref_audio` (mono float samples at `ref_sample_rate`) with `ref_text`
        (in-context cloning) or with `x_vector_only=True`; or a precomputed `speaker_embedding`
        (x-vector only), optionally with `ref_code` + `ref_text` for in-context cloning of a saved voice.
    non_streaming_mode: None takes the official wrapper's default for the mode (False for voice clone,
        True for CustomVoice and VoiceDesign).
    """

    text: str = ""
    language: str = "auto"
    speaker: str | None = None
    instructions: str | None = None
    ref_audio: np.ndarray | None = None
    ref_sample_rate: int = 24000
    ref_text: str | None = None
    x_vector_only: bool = False
    speaker_embedding: torch.Tensor | None = None
    ref_code: torch.Tensor | None = None
    non_streaming_mode: bool | None = None
    text_ids: Sequence[int] | None = None
    # `voice_key(ref_audio, ref_sample_rate)` when the caller already has it (the server computes it once per
    # clip it caches), so the voice cache need not hash the samples again on the admission thread.
    ref_audio_key: str | None = None


@dataclass
class VoiceFeatures:
    """What a reference clip contributes: the x-vector and (for in-context cloning) its codec codes."""

    speaker_embedding: torch.Tensor  # [hidden], float32, CPU
    ref_code: torch.Tensor | None  # [T_ref, 16], int64, CPU; None when only the x-vector was asked for


def voice_key(samples: np.ndarray, sample_rate: int) -> str:
    """The voice cache's key of a clip: a digest of its float32 samples and its rate."""
    arr = np.ascontiguousarray(samples, dtype=np.float32)
    # Hashed from the array's own buffer (no bytes copy); hashlib lets go of the GIL for large inputs.
    return hashlib.blake2b(arr, digest_size=16, key=str(int(sample_rate)).encode()).hexdigest()


def _codec_rate_clip(loaded: LoadedModel, samples: np.ndarray, sample_rate: int) -> torch.Tensor:
    """A mono clip at the codec's input rate, as a tensor the encoders may own; AudioError if too short."""
    if loaded.model.speaker_encoder is None:
        raise PromptError(f"this is a {loaded.config.tts_model_type} model; reference audio needs a Base model")
    rate = loaded.speech_config.input_sample_rate
    wav = resample(np.asarray(samples, dtype=np.float32), sample_rate, rate)
    if not wav.flags.writeable:  # a clip the server caches is read-only; torch wants to own a writable one
        wav = wav.copy()
    if len(wav) < loaded.model.speaker_encoder.min_samples:
        raise AudioError(f"reference audio too short: {len(wav) / rate:.3f} s")
    return torch.from_numpy(wav)


@torch.inference_mode()
def extract_voice(loaded: LoadedModel, samples: np.ndarray, sample_rate: int, key: str | None = None,
                  codes: bool = True) -> VoiceFeatures:
    """Speaker embedding and (with `codes`) reference codes of a mono clip, resampled to the codec rate first.
    An x-vector-only request needs no codes: leaving them out skips the codec encoder. `key` is unused: the
    signature is the one `VoiceCache` shares, so `build_spec` can take either."""
    wav_t = _codec_rate_clip(loaded, samples, sample_rate)
    embedding = loaded.model.speaker_encoder.embed(wav_t)[0].float().cpu()
    if not torch.isfinite(embedding).all():
        # Finite samples can still overflow the encoder (a float clip with values near 3e38): say so here, not
        # later as a non-finite embedding the caller never sent, nor in a saved voice no request can use.
        raise AudioError("the reference audio gives no usable voice: its speaker embedding overflows (are its "
                         "samples far outside [-1, 1]?)")
    return VoiceFeatures(embedding, _ref_codes(loaded, wav_t) if codes else None)


@torch.inference_mode()
def voice_codes(loaded: LoadedModel, samples: np.ndarray, sample_rate: int) -> torch.Tensor:
    """The reference codes alone (`extract_voice`'s second half), for a clip whose x-vector is known."""
    return _ref_codes(loaded, _codec_rate_clip(loaded, samples, sample_rate))


def _ref_codes(loaded: LoadedModel, wav_t: torch.Tensor) -> torch.Tensor:
    return loaded.speech_tokenizer.encoder.encode(wav_t).cpu()


class VoiceCache:
    """Voice features by reference clip (a hash of its samples and rate), least recently used out first.
    Clients that send the same reference clip with every request pay for its encoding once. A clip first
    seen by an x-vector-only request is cached without codes; a clone of it later adds them.

    Safe to call from several threads. A lock guards the entries but is never held while an encoder runs, so
    `lookup` of a cached clip never waits for another clip's encode. A clip that several requests bring at
    once is encoded once (the others wait for that encode), and the encoders never run two at a time."""

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, VoiceFeatures] = OrderedDict()
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        self._encoding: dict[str, threading.Event] = {}  # clip key -> set when its encode ends (or fails)
        self._encoder = threading.Lock()

    def lookup(self, key: str, codes: bool = True) -> VoiceFeatures | None:
        """The clip's features if cached (with codes, if `codes`), counted as a hit; None otherwise, counted
        as nothing (the call that encodes it counts the miss). Never waits for an encode."""
        with self._lock:
            feats = self._hit(key, codes)
        return None if feats is None else _copy(feats, codes)

    def __call__(self, loaded: LoadedModel, samples: np.ndarray, sample_rate: int,
                 key: str | None = None, codes: bool = True) -> VoiceFeatures:
        """`extract_voice`, remembered (same signature, so `build_spec` can take it as its `extract`). `key`:
        `voice_key(samples, sample_rate)` if the caller has it already."""
        if self.max_entries <= 0:
            return extract_voice(loaded, samples, sample_rate, codes=codes)
        arr = np.ascontiguousarray(samples, dtype=np.float32)
        key = key or voice_key(arr, sample_rate)
        while True:
            with self._lock:
                feats = self._hit(key, codes)
                if feats is not None:
                    return _copy(feats, codes)
                running = self._encoding.get(key)
                if running is None:
                    done = self._encoding[key] = threading.Event()
                    known = self._entries.get(key)  # x-vector only so far, when codes are wanted now
                    break
            running.wait()  # that encode ends (its own duration bounds this); then look again
        try:
            with self._encoder:
                if known is None:
                    feats = extract_voice(loaded, arr, sample_rate, codes=codes)
                else:
                    feats = VoiceFeatures(known.speaker_embedding, voice_codes(loaded, arr, sample_rate))
            with self._lock:
                self.misses += 1
                self._entries[key] = feats
                self._entries.move_to_end(key)
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
        finally:
            with self._lock:
                del self._encoding[key]
            done.set()
        return _copy(feats, codes)

    def _hit(self, key: str, codes: bool) -> VoiceFeatures | None:
        """Under the lock: a cached entry that serves `codes`, made most recent and counted."""
        feats = self._entries.get(key)
        if feats is None or (codes and feats.ref_code is None):
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return feats


def _copy(feats: VoiceFeatures, codes: bool) -> VoiceFeatures:
    """A caller's own copy of cached features (the prompt builder may write to what it gets)."""
    return VoiceFeatures(feats.speaker_embedding.clone(), feats.ref_code.clone() if codes else None)


def reaches_voice(inp: SpeechInput) -> bool:
    """Whether `build_spec` gets as far as encoding `inp`'s reference clip: it has one, no speaker embedding
    beside it, and text that passes the checks `build_spec` makes first. A caller that encodes clips ahead
    of `build_spec` encodes only these, so a request refused on its text costs no encode."""
    if inp.ref_audio is None or inp.speaker_embedding is not None:
        return False
    if inp.text_ids is not None:
        return not inp.text
    return isinstance(inp.text, str) and not is_blank(inp.text)


def build_spec(loaded: LoadedModel, inp: SpeechInput, extract=extract_voice) -> PromptSpec:
    """Tokenises and, for reference audio, encodes the voice (with `extract`: `extract_voice` or a
    `VoiceCache`); raises PromptError/AudioError for bad input."""
    tok = loaded.text_tokenizer
    if inp.text_ids is not None:
        if inp.text:
            raise PromptError("give either text or text_ids, not both")
        text_ids = target_text_ids_of(tok, _token_ids(inp.text_ids))
    elif not isinstance(inp.text, str) or not inp.text.strip():
        raise PromptError("input text is empty")
    elif is_blank(inp.text):  # the server's rule: zero-width or control characters only is nothing to say
        raise PromptError("input text is blank (only spaces, control or invisible characters)")
    else:
        text_ids = target_text_ids(tok, inp.text)
    model_type = loaded.config.tts_model_type
    non_streaming = inp.non_streaming_mode
    if non_streaming is None:
        non_streaming = model_type != "base"
    embedding, ref_code = inp.speaker_embedding, inp.ref_code
    if inp.ref_audio is not None:
        if embedding is not None:
            raise PromptError("give either ref_audio or speaker_embedding, not both")
        feats = extract(loaded, inp.ref_audio, inp.ref_sample_rate, key=inp.ref_audio_key,
                        codes=not inp.x_vector_only)
        embedding = feats.speaker_embedding
        ref_code = None if inp.x_vector_only else feats.ref_code
    x_vector_only = inp.x_vector_only or (embedding is not None and ref_code is None)
    if model_type == "base" and embedding is None:
        raise PromptError(
            "a Base model clones a voice: give ref_audio (+ ref_text), a speaker_embedding or a saved voice"
        )
    if model_type == "base" and not x_vector_only and (not inp.ref_text or is_blank(inp.ref_text)):
        raise PromptError("in-context voice cloning needs ref_text (the transcript of ref_audio); "
                          "or set x_vector_only")
    return PromptSpec(
        text_ids=text_ids,
        language=inp.language or "auto",
        speaker=inp.speaker,
        instruct_ids=instruct_text_ids(tok, inp.instructions),
        ref_ids=ref_text_ids(tok, inp.ref_text) if (inp.ref_text and not x_vector_only) else None,
        ref_code=None if x_vector_only else ref_code,
        speaker_embedding=embedding,
        x_vector_only=x_vector_only,
        non_streaming_mode=non_streaming,
    )


def _token_ids(ids: Sequence[int] | torch.Tensor | np.ndarray) -> list[int]:
    values = ids.tolist() if isinstance(ids, (torch.Tensor, np.ndarray)) else list(ids)
    if not values:
        raise PromptError("text_ids is empty")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise PromptError("text_ids must be a flat sequence of integer token ids")
    return values
