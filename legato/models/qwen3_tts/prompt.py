"""Talker prompts for every Qwen3-TTS mode: what a prompt depends on, its layout's lengths and limits, and the chat
templates that tokenise its text (`prompt_build` builds the embeddings).

A prompt is a sequence of talker input embeddings, each the sum of a text-track and a codec-track
embedding (either may be absent), plus the `trailing_text` embeddings that decode step k adds to its
input (then `tts_pad` once they run out). See shared/reference/qwen3-tts-model.md §3 for the layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .config import Qwen3TTSConfig

# Template slices (§3.1): "<|im_start|>assistant\n" is 3 tokens, "<|im_end|>\n<|im_start|>assistant\n"
# closes the target with 5, "<|im_end|>\n" closes the reference text with 2.
ROLE_LEN = 3
TARGET_TAIL = 5
REF_TAIL = 2


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


def target_text_ids(tokenizer: TextTokenizer, text: str) -> list[int]:
    """Token ids of the text to speak, wrapped in the assistant template the model was trained on."""
    return list(tokenizer.encode(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"))


def target_text_ids_of(tokenizer: TextTokenizer, ids: Sequence[int]) -> list[int]:
    """`target_text_ids` for text given as token ids: the same template, tokenised on its own, around them."""
    head = list(tokenizer.encode("<|im_start|>assistant\n"))
    tail = list(tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n"))
    if len(head) != ROLE_LEN or len(tail) != TARGET_TAIL:
        raise PromptError("the text tokenizer does not split the chat template as the model expects")
    return head + list(ids) + tail


def ref_text_ids(tokenizer: TextTokenizer, ref_text: str) -> list[int]:
    """Token ids of the transcript of the reference audio (voice-clone ICL mode)."""
    return list(tokenizer.encode(f"<|im_start|>assistant\n{ref_text}<|im_end|>\n"))


def instruct_text_ids(tokenizer: TextTokenizer, instruct: str | None) -> list[int] | None:
    """Token ids of a style / voice instruction, or None when there is none (empty counts as none)."""
    if not instruct:
        return None
    return list(tokenizer.encode(f"<|im_start|>user\n{instruct}<|im_end|>\n"))


class PromptError(ValueError):
    """The request cannot be turned into a prompt for this model (a client error); the message says why."""


@dataclass
class PromptSpec:
    """Everything a prompt depends on, already tokenised.

    text_ids: the templated target text (`target_text_ids`), at least one text token.
    language: "auto" or a language name of the model (case-insensitive).
    speaker: CustomVoice preset speaker name.
    instruct_ids: templated instruction (`instruct_text_ids`): VoiceDesign, and CustomVoice on 1.7B
        (the 0.6B CustomVoice model ignores it, as the reference does).
    speaker_embedding: Base only, the x-vector [hidden].
    x_vector_only: Base only: True clones from the x-vector alone; False is ICL and also needs
        ref_ids (templated transcript, `ref_text_ids`) and ref_code (T_ref, 16) codec codes.
    non_streaming_mode: feed the whole text in the prompt instead of one token per decode step.
    text_open: the text is still arriving (streaming text input): `text_ids` hold what is known so far, the
        trailing text ends without tts_eos, and the engine appends the rest (`Engine.append_text`) and the
        eos (at the close). Streaming-text layout only; an in-context clone's prompt exists once its text
        fills the reference's positions (`open_text_missing`).
    """

    text_ids: Sequence[int] | torch.Tensor
    language: str = "auto"
    speaker: str | None = None
    instruct_ids: Sequence[int] | torch.Tensor | None = None
    ref_ids: Sequence[int] | torch.Tensor | None = None
    ref_code: torch.Tensor | None = None
    speaker_embedding: torch.Tensor | None = None
    x_vector_only: bool = False
    non_streaming_mode: bool = False
    text_open: bool = False


@dataclass
class TalkerPrompt:
    """embeds [L, H] is the prefill input; decode step k adds trailing_text[k] ([n, H]) to its frame
    embedding, or tts_pad [H] once k >= n."""

    embeds: torch.Tensor
    trailing_text: torch.Tensor
    tts_pad: torch.Tensor

    @property
    def length(self) -> int:
        return self.embeds.shape[0]

    def text_for_step(self, step: int) -> torch.Tensor:
        return self.trailing_text[step] if step < self.trailing_text.shape[0] else self.tts_pad


def target_text_tokens(spec: PromptSpec) -> int:
    """Tokens of the text to speak (the templated `text_ids` without their template)."""
    return max(0, len(spec.text_ids) - ROLE_LEN - TARGET_TAIL)


def open_text_missing(spec: PromptSpec) -> int:
    """Text tokens an open request still needs before its prompt exists: 0 but for in-context clones. Their
    prompt lays the reference transcript and the target text beside codec_bos and the reference frames
    (1 + T_ref positions), and pads a shorter text with "text over": the prompt of an open text that does not
    yet fill those positions cannot be written until more text comes, or the text closes."""
    if spec.x_vector_only or spec.ref_code is None or spec.ref_ids is None or not spec.text_open:
        return 0
    ref_tokens = max(0, len(spec.ref_ids) - ROLE_LEN - REF_TAIL)
    return max(0, 1 + int(spec.ref_code.shape[0]) - ref_tokens - target_text_tokens(spec))


def with_more_text(spec: PromptSpec, ids: Sequence[int], close: bool) -> PromptSpec:
    """`spec` with target-text token ids appended (pieces cut as `segment_ids` cuts them); `close` ends the text."""
    text = [int(i) for i in spec.text_ids]
    merged = text[:-TARGET_TAIL] + [int(i) for i in ids] + text[-TARGET_TAIL:]
    return dataclasses.replace(spec, text_ids=merged, text_open=spec.text_open and not close)


# Positions a prompt holds beside its texts and reference frames, at most: the instruction's template
# (<|im_start|>user\n ... <|im_end|>\n, 5), the role (3), the codec control prefix (think, think_bos,
# language, think_eos, speaker slot, pad: 6) and the body's closing eos + codec_bos (2).
PROMPT_OVERHEAD = 16
# The tokenizer's real worst case for text in the model's languages. The Qwen2 tokenizer is a byte-level BPE:
# it starts from a text's UTF-8 bytes and only merges, so a text never has more tokens than bytes, and every
# script the model speaks (Latin, Cyrillic, CJK, kana, Hangul) is in the Basic Multilingual Plane, 3 bytes a
# character at most. Text without merges in the vocabulary comes close: 'Привет' repeated is 2 tokens a
# character, Hangul syllables up to 3 (measured on the embedded tiny model's vocabulary). A limit of one token
# per character refused such text inside the character limit; at 3 nothing of these scripts is refused, and
# what can still exceed it is characters of 4 bytes (emoji and other symbols) making most of the input.
TOKENS_PER_CHAR = 3.0


def takes_instructions(model_type: str, model_size: str) -> bool:
    """Whether a model's prompt holds `instructions` (VoiceDesign; CustomVoice but the 0.6B, which drops it)."""
    return model_type == "voice_design" or (model_type == "custom_voice" and model_size != "0b6")


def default_max_prompt_tokens(model_type: str, model_size: str, max_input_chars: int,
                              max_ref_audio_seconds: float, frame_rate: float = 12.5) -> int:
    """The prompt-token limit that the largest legitimate request fits: its text at `max_input_chars` of
    ordinary text, an instruction as long (models that take one), the reference transcript as long plus
    `max_ref_audio_seconds` of reference frames (Base: in-context cloning), and `PROMPT_OVERHEAD`:

        chars * TOKENS_PER_CHAR * (1 + instructions + base) + base * ceil(seconds * frame_rate) + 16
    """
    texts = 1 + int(takes_instructions(model_type, model_size)) + int(model_type == "base")
    ref_frames = math.ceil(max_ref_audio_seconds * frame_rate) if model_type == "base" else 0
    return math.ceil(max_input_chars * TOKENS_PER_CHAR) * texts + ref_frames + PROMPT_OVERHEAD


def prompt_length(spec: PromptSpec, cfg: Qwen3TTSConfig, ref_frames: int | None = None) -> int:
    """The talker positions `build_prompt(spec, ...)` gives, from token counts alone (no weights), so a
    front end without the model can hold a request to a prompt-token limit. `ref_frames` stands in for
    `spec.ref_code`'s length when the reference clip is not encoded yet. Assumes a spec `build_prompt`
    accepts (it does not validate)."""
    kind = cfg.tts_model_type
    instruct = 0
    if spec.instruct_ids is not None and takes_instructions(kind, cfg.tts_model_size):
        instruct = len(spec.instruct_ids)
    lang = (spec.language or "").lower()
    dialect = kind == "custom_voice" and (cfg.talker_config.spk_is_dialect or {}).get((spec.speaker or "").lower())
    tags = 4 if lang != "auto" or dialect else 3  # a dialect speaker brings its dialect's language tag
    control = tags + int(kind != "voice_design") + 1  # + speaker slot + codec_pad; codec_bos opens the body
    text = len(spec.text_ids) - ROLE_LEN - TARGET_TAIL
    if kind == "base" and not spec.x_vector_only:
        frames = ref_frames if ref_frames is not None else len(spec.ref_code if spec.ref_code is not None else ())
        codec = 1 + frames  # codec_bos + the reference frames
        if not spec.non_streaming_mode:
            body = codec  # text beyond the reference frames trails into the decode steps
        else:
            body = max(0, len(spec.ref_ids or ()) - ROLE_LEN - REF_TAIL) + text + 1 + codec
    elif spec.non_streaming_mode:
        body = text + 2  # the text, tts_eos, then tts_pad + codec_bos
    else:
        body = 1  # one text token with codec_bos; the rest trails
    return instruct + ROLE_LEN + control + body


def supported_languages(cfg: Qwen3TTSConfig) -> list[str]:
    """Languages a request may name; dialects are reached only through a CustomVoice speaker."""
    return ["auto"] + [k for k in cfg.talker_config.codec_language_id if "dialect" not in k]
