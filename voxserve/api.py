"""The offline Python API: load a model, synthesise utterances.

    tts = TTS.load()                      # the embedded tiny default (random weights: noise)
    out = tts.generate("Hello.", speaker="ryan")
    out.codes, out.audio, out.sample_rate

`generate` runs the plain reference loop, one request at a time; it is the executable definition that
the batched engine is tested against.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from voxserve.models.qwen3_tts.default import DEFAULT_SPEAKER, default_model_dir
from voxserve.models.qwen3_tts.inputs import SpeechInput, build_spec
from voxserve.models.qwen3_tts.loader import LoadedModel, load_model
from voxserve.models.qwen3_tts.prompt import build_prompt
from voxserve.models.qwen3_tts.reference_loop import generate_codes
from voxserve.models.qwen3_tts.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class SpeechResult:
    codes: torch.Tensor  # [frames, 16] int64
    audio: np.ndarray  # float32 mono PCM
    sample_rate: int

    @property
    def duration(self) -> float:
        return len(self.audio) / self.sample_rate


class TTS:
    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded

    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> TTS:
        """A model directory or hub id; None loads the embedded tiny default (random weights)."""
        if model is None:
            model = default_model_dir()
            log.warning("using the embedded default model (random weights: the audio is noise)")
        return cls(load_model(model, device=device, dtype=dtype))

    def default_sampling(self) -> SamplingParams:
        g = self.loaded.generation_defaults
        return SamplingParams(
            do_sample=g["do_sample"],
            temperature=g["temperature"],
            top_k=g["top_k"],
            top_p=g["top_p"],
            repetition_penalty=g["repetition_penalty"],
            max_new_tokens=g["max_new_tokens"],
            subtalker_do_sample=g["subtalker_dosample"],
            subtalker_temperature=g["subtalker_temperature"],
            subtalker_top_k=g["subtalker_top_k"],
            subtalker_top_p=g["subtalker_top_p"],
        )

    def generate(self, text: str | SpeechInput, sampling: SamplingParams | None = None, **kwargs) -> SpeechResult:
        """Synthesises one utterance. `kwargs` are `SpeechInput` fields (language, speaker, instructions,
        ref_audio, ref_sample_rate, ref_text, x_vector_only, speaker_embedding, non_streaming_mode)."""
        inp = text if isinstance(text, SpeechInput) else SpeechInput(text=text, **kwargs)
        if self.loaded.config.tts_model_type == "custom_voice" and inp.speaker is None and self._is_default():
            log.info("no speaker given: the embedded default model uses %r", DEFAULT_SPEAKER)
            inp = replace(inp, speaker=DEFAULT_SPEAKER)
        sampling = sampling or self.default_sampling()
        spec = build_spec(self.loaded, inp)
        talker = self.loaded.talker
        prompt = build_prompt(spec, talker, self.loaded.config)
        codes = generate_codes(talker, prompt, sampling)
        audio = self.decode(codes, spec.ref_code)
        return SpeechResult(codes=codes.cpu(), audio=audio, sample_rate=self.loaded.sample_rate)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor, ref_code: torch.Tensor | None = None) -> np.ndarray:
        """Codes [T, 16] -> float32 audio. With in-context cloning the reference codes are decoded in
        front (as the official wrapper does) and their share of the samples is cut off."""
        decoder = self.loaded.speech_tokenizer.decoder
        if codes.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        device = next(decoder.parameters()).device
        full = codes if ref_code is None else torch.cat([ref_code.to(codes.device), codes], dim=0)
        wav = decoder.decode(full.unsqueeze(0).to(device))[0].float().cpu().numpy()
        if ref_code is not None:
            cut = int(ref_code.shape[0] / full.shape[0] * len(wav))
            wav = wav[cut:]
        return wav

    def _is_default(self) -> bool:
        return self.loaded.path.name.startswith("voxserve-tiny")
