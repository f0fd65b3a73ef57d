"""The prompt-token limit (`--max-prompt-tokens`), held in the HTTP front before a request reaches an engine.

The input limit counts characters, and a character can cost several tokens (an emoji four), so without this
one request of 4096 emoji is a 16k-token prompt whose prefill every other request waits behind. The count
is the engine's own (`prompt_length`, equal to `build_prompt`'s length) from the model's text tokenizer
alone, so a front whose engines run in worker processes loads only the tokenizer. The engines hold the same
limit at admission (`EngineConfig.max_prompt_tokens`), exactly, for callers that skip this front. Given the
engines' config, it also works out each request's frame limit and the cap behind it (frame_budget.py).
"""

from __future__ import annotations

import math
from pathlib import Path

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.config import Qwen3TTSConfig, load_model_config
from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.prompt import (
    PromptSpec,
    instruct_text_ids,
    prompt_length,
    ref_text_ids,
    target_text_ids,
    target_text_ids_of,
    target_text_tokens,
)
from legato.models.qwen3_tts.text_tokenizer import TextTokenizer
from legato.server.errors import ApiError
from legato.server.frame_budget import FrameBudget, LengthAsk, frame_budget
from legato.server.settings import ServerSettings

CODEC_FRAME_RATE = 12.5  # Qwen3-TTS 12 Hz codec: one frame per 1920 samples at 24 kHz


class PromptLimit:
    """Counts a request's prompt tokens and refuses it (400 `prompt_too_long`) over `limit`. With `engine`
    (the engines' config) it also sets each request's frame limit (`budget`)."""

    def __init__(self, tokenizer: TextTokenizer, config: Qwen3TTSConfig, limit: int,
                 engine: EngineConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.limit = limit
        self.engine = engine

    @classmethod
    def for_model(cls, tokenizer: TextTokenizer, config: Qwen3TTSConfig, settings: ServerSettings,
                  engine: EngineConfig | None = None) -> PromptLimit:
        return cls(tokenizer, config, settings.prompt_token_limit(config.tts_model_type, config.tts_model_size),
                   engine)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, settings: ServerSettings,
                       engine: EngineConfig | None = None) -> PromptLimit:
        """The tokenizer and config files only: no weights are read."""
        return cls.for_model(TextTokenizer.from_dir(model_dir), load_model_config(Path(model_dir)), settings,
                             engine)

    def count(self, inp: SpeechInput) -> int:
        """Prompt tokens of `inp` as the engine will build it (`build_spec` + `build_prompt`). Reference audio
        not encoded yet counts its frames from its duration, which can differ from the encoder's by one."""
        return self.sizes(inp)[0]

    def sizes(self, inp: SpeechInput) -> tuple[int, int]:
        """(prompt tokens, tokens of the text to speak) of `inp`: `count`, and what the frame cap counts."""
        tok, kind = self.tokenizer, self.config.tts_model_type
        text_ids = (target_text_ids_of(tok, list(inp.text_ids)) if inp.text_ids is not None
                    else target_text_ids(tok, inp.text))
        non_streaming = inp.non_streaming_mode if inp.non_streaming_mode is not None else kind != "base"
        icl = kind == "base" and not inp.x_vector_only and (inp.ref_audio is not None or inp.ref_code is not None)
        spec = PromptSpec(
            text_ids=text_ids, language=inp.language or "auto", speaker=inp.speaker,
            instruct_ids=instruct_text_ids(tok, inp.instructions),
            ref_ids=ref_text_ids(tok, inp.ref_text) if icl and inp.ref_text else None,
            x_vector_only=not icl, non_streaming_mode=non_streaming,
        )
        return prompt_length(spec, self.config, _ref_frames(inp) if icl else 0), target_text_tokens(spec)

    def check(self, inp: SpeechInput, ask: LengthAsk | None = None) -> FrameBudget | None:
        """Refuses `inp` over the limit; returns its frame limit under `ask` (None without `engine`)."""
        n, text_tokens = self.sizes(inp)
        if n > self.limit:
            raise ApiError(400, f"prompt is {n} tokens; the limit is {self.limit} (--max-prompt-tokens)",
                           "prompt_too_long", "input")
        if self.engine is None:
            return None
        return frame_budget(self.engine, n, text_tokens, ask or LengthAsk())


def _ref_frames(inp: SpeechInput) -> int:
    if inp.ref_code is not None:
        return len(inp.ref_code)
    if inp.ref_audio is None:
        return 0
    return math.ceil(len(inp.ref_audio) * CODEC_FRAME_RATE / inp.ref_sample_rate)
