"""The offline Python API: load a model, synthesise utterances.

    tts = TTS.load()                      # the embedded tiny default (random weights: noise)
    out = tts.generate("Hello.", speaker="ryan")
    out.codes, out.audio, out.sample_rate

`generate` runs a list of utterances batched through the engine (continuous batching, the counter-based
sampler: a seeded utterance gives the same codes whatever it is batched with). `generate_reference` runs
the plain reference loop, one utterance at a time: the executable definition the engine is tested
against (greedy results are identical; sampled ones draw from a different random generator).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from legato.engine.config import EngineConfig
from legato.engine.engine import Engine, EngineRequest
from legato.models.qwen3_tts.default import DEFAULT_SPEAKER, default_model_dir
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.loader import LoadedModel, load_model
from legato.models.qwen3_tts.prompt import default_max_prompt_tokens, takes_instructions
from legato.models.qwen3_tts.prompt_build import build_prompt
from legato.models.qwen3_tts.reference_loop import generate_codes
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline.threads import run_on_engine_thread

log = logging.getLogger(__name__)


@dataclass
class SpeechResult:
    codes: torch.Tensor  # [frames, 16] int64
    audio: np.ndarray  # float32 mono PCM
    sample_rate: int
    finish_reason: str | None = None  # stop (the model ended it) | length (max_new_tokens or the frame cap)

    @property
    def duration(self) -> float:
        return len(self.audio) / self.sample_rate


class TTS:
    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self._streamer = None  # the streaming codec decoder of `decode`, built on first use

    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        device: str | None = None,
        dtype: torch.dtype | None = None,
    ) -> TTS:
        """A model directory or hub id; None loads the embedded tiny default (random weights).
        `device` None: CUDA when there is one, else the CPU; `dtype` None: bfloat16 on CUDA, float32 elsewhere."""
        if model is None:
            model = default_model_dir()
            log.warning("using the embedded default model (random weights: the audio is noise)")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype is None:
            dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        return cls(load_model(model, device=device, dtype=dtype))

    def default_sampling(self) -> SamplingParams:
        return SamplingParams.from_generation_defaults(self.loaded.generation_defaults)

    def generate(
        self,
        inputs: str | SpeechInput | list[str | SpeechInput] | None = None,
        sampling: SamplingParams | list[SamplingParams] | None = None,
        engine_config: EngineConfig | None = None,
        *,
        text_ids: Sequence[int] | None = None,
        greedy: bool = False,
        **kwargs,
    ) -> SpeechResult | list[SpeechResult]:
        """Synthesises one utterance (returns a result) or a list (returns a list, run batched).

        `text_ids` instead of `inputs`: the text as token ids of the model's tokenizer (no chat template),
        e.g. the ids another implementation was given. `greedy`: argmax decoding for the talker and the
        code predictor, on top of `sampling`. `kwargs` are `SpeechInput` fields applied to plain-text
        inputs. Every request is capped in frames by its text (`EngineConfig.frames_per_text_token`)."""
        if (inputs is None) == (text_ids is None):
            raise ValueError("give either inputs or text_ids")
        if text_ids is not None:
            inputs = SpeechInput(text_ids=list(text_ids), **kwargs)
        single = not isinstance(inputs, list)
        items = [self._input(x, kwargs) for x in ([inputs] if single else inputs)]
        params = sampling if isinstance(sampling, list) else [sampling or self.default_sampling()] * len(items)
        if len(params) != len(items):
            raise ValueError(f"{len(items)} inputs but {len(params)} sampling settings")
        if greedy:
            params = [replace(p, do_sample=False, subtalker_do_sample=False) for p in params]
        cfg = self.loaded.config
        if cfg.tts_model_type == "custom_voice" and not takes_instructions(cfg.tts_model_type, cfg.tts_model_size) \
                and any(x.instructions for x in items):  # dropped as the official package drops it: said, though
            log.warning("the 0.6B CustomVoice model takes no instructions: they are left out (the 1.7B CustomVoice "
                        "and the VoiceDesign models take them)")
        specs = [build_spec(self.loaded, x) for x in items]
        engine = Engine(self.loaded, engine_config or self._engine_config(len(items)))
        ids = [f"utt-{i}" for i in range(len(items))]
        for rid, spec, p in zip(ids, specs, params, strict=True):
            engine.add_request(EngineRequest(rid, spec, p))
        # The loop runs as the server's does (pipeline/threads.py): on the CPU, stepping on the caller's
        # thread made a busy machine many times slower offline than served.
        codes, audio, reasons, errors = run_on_engine_thread(lambda stop: _step_all(engine, ids, stop))
        if errors:
            raise RuntimeError(f"generation failed: {errors}")
        results = [
            SpeechResult(
                codes=torch.cat(codes[rid]) if codes[rid] else torch.zeros(0, 16, dtype=torch.long),
                audio=np.concatenate(audio[rid]) if audio[rid] else np.zeros(0, dtype=np.float32),
                sample_rate=self.loaded.sample_rate,
                finish_reason=reasons.get(rid),
            )
            for rid in ids
        ]
        return results[0] if single else results

    def generate_reference(self, text: str | SpeechInput, sampling: SamplingParams | None = None,
                           **kwargs) -> SpeechResult:
        """One utterance through the plain eager reference loop (`torch.Generator` sampling)."""
        inp = self._input(text, kwargs)
        sampling = sampling or self.default_sampling()
        spec = build_spec(self.loaded, inp)
        talker = self.loaded.talker
        prompt = build_prompt(spec, talker, self.loaded.config)
        codes = generate_codes(talker, prompt, sampling)
        audio = self.decode(codes, spec.ref_code)
        return SpeechResult(codes=codes.cpu(), audio=audio, sample_rate=self.loaded.sample_rate)

    def _input(self, x: str | SpeechInput, kwargs: dict) -> SpeechInput:
        if not isinstance(x, (str, SpeechInput)):
            raise TypeError(f"an input is a str or a SpeechInput, got {type(x).__name__}")
        inp = x if isinstance(x, SpeechInput) else SpeechInput(text=x, **kwargs)
        if self.loaded.config.tts_model_type == "custom_voice" and inp.speaker is None and self._is_default():
            log.info("no speaker given: the embedded default model uses %r", DEFAULT_SPEAKER)
            inp = replace(inp, speaker=DEFAULT_SPEAKER)
        return inp

    def _engine_config(self, n: int) -> EngineConfig:
        weight = self.loaded.talker.codec_head.weight
        dtype = str(weight.dtype).replace("torch.", "")
        cfg = self.loaded.config
        # The server's default prompt limit (4096 characters, 60 s of reference): a longer prompt is refused
        # unless the caller passes an engine_config with max_prompt_tokens=None.
        limit = default_max_prompt_tokens(cfg.tts_model_type, cfg.tts_model_size, 4096, 60.0,
                                          self.loaded.speech_config.frame_rate)
        return EngineConfig(device=weight.device.type, dtype=dtype, max_num_seqs=max(1, min(n, 256)),
                            max_num_batched_tokens=max(4096, n), max_model_len=8192, max_prompt_tokens=limit)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor, ref_code: torch.Tensor | None = None) -> np.ndarray:
        """Codes [T, 16] -> float32 audio, through the engine's streaming decoder (its codec dtype and the
        reference's 300-frame decode windows). With in-context cloning the reference codes run first (as the
        official wrapper decodes them in front) and only the generated frames' audio is returned."""
        if codes.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        if self._streamer is None:
            from legato.engine.codec_streamer import CodecStreamer, StreamSchedule
            from legato.engine.config import codec_dtype_name

            decoder = self.loaded.speech_tokenizer.decoder
            device = next(decoder.parameters()).device
            self._streamer = CodecStreamer(decoder, StreamSchedule(decode_every_step=False), capacity=1,
                                           dtype=getattr(torch, codec_dtype_name("auto", device.type)))
        streamer = self._streamer
        streamer.open("decode", ref_code)
        for frame in codes.to(torch.long):
            streamer.push("decode", frame)
        audio, failed = streamer.flush({"decode"})
        if failed:
            raise RuntimeError(failed["decode"])
        return audio.get("decode", np.zeros(0, dtype=np.float32))

    def _is_default(self) -> bool:
        return self.loaded.path.name.startswith("legato-tiny")


def _step_all(engine: Engine, ids: list[str], stop: threading.Event) -> tuple[dict, dict, dict, dict]:
    """Steps `engine` until every request has ended (or `stop` is set: each is aborted, its reason "abort");
    returns each request's codes, audio, finish reason and error."""
    codes: dict[str, list[torch.Tensor]] = {rid: [] for rid in ids}
    audio: dict[str, list[np.ndarray]] = {rid: [] for rid in ids}
    errors: dict[str, str] = {}
    reasons: dict[str, str | None] = {}
    aborted = False
    while engine.has_unfinished():
        if stop.is_set() and not aborted:  # the caller was interrupted: free everything, then drain the aborts
            aborted = True
            for rid in ids:
                engine.abort(rid, "interrupted")
        for out in engine.step():
            codes[out.request_id].append(out.codes)
            if out.audio is not None:
                audio[out.request_id].append(out.audio)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
            if out.finish_reason == "error":
                errors[out.request_id] = out.error or "failed"
    return codes, audio, reasons, errors
