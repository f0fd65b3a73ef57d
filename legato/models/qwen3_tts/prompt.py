"""Talker prompt construction for every Qwen3-TTS mode, and the chat templates that tokenise its text.

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

from legato.layers.host import upload

from .config import Qwen3TTSConfig
from .prompt_parts import parts_of
from .talker import Talker

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


@torch.no_grad()
def build_prompt(spec: PromptSpec, talker: Talker, cfg: Qwen3TTSConfig) -> TalkerPrompt:
    """The talker prompt of one request (raises PromptError for invalid requests)."""
    tc = cfg.talker_config
    device = talker.codec_head.weight.device
    dtype = talker.codec_head.weight.dtype
    kind = cfg.tts_model_type

    host_ids = _host_ids(spec.text_ids, "text_ids", tc.text_vocab_size)
    if host_ids.numel() < ROLE_LEN + TARGET_TAIL + 1:
        raise PromptError("text_ids must hold the assistant template around at least one text token")
    text_ids = upload(host_ids, device)
    language_id = _language_id(spec.language, cfg)
    speaker_slot, language_id = _speaker_slot(spec, talker, cfg, language_id, device, dtype)
    instruct = _instruct(spec, cfg)
    icl = kind == "base" and not spec.x_vector_only
    if icl:
        ref_ids, ref_code = _icl_inputs(spec, cfg, device)
    if spec.text_open and spec.non_streaming_mode:
        # The non-streaming layout puts the whole text in the prompt: it does not exist before the text does.
        raise PromptError("text that is still arriving needs the streaming-text layout (non_streaming_mode off)")
    if spec.text_open and icl and (missing := open_text_missing(spec)) > 0:
        raise PromptError(f"an in-context clone's open text needs {missing} more text token(s) before its prompt "
                          "exists (its reference frames carry the text beside them)")

    text = talker.embed_text
    shared = parts_of(talker)  # what every request (or many) share: computed once, the same bits
    special = (cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id)
    bos_t, eos_t, pad_t = shared.text(talker, special, device).chunk(3, dim=0)
    first = host_ids.tolist()[:ROLE_LEN + 1]

    parts = [] if instruct is None else [shared.text(talker, instruct, device)]
    parts.append(shared.text(talker, tuple(first[:ROLE_LEN]), device))

    # Codec control prefix: think/language tags, the optional speaker slot, then pad + bos. Its text
    # track is tts_pad..., tts_bos, and codec_bos is held back for the body. Every codec id of the prompt is
    # looked up in one gather (exact, however the ids are grouped): tags, pad + bos, and a codec_pad last.
    if language_id is None:
        tag_ids = [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id]
    else:
        tag_ids = [tc.codec_think_id, tc.codec_think_bos_id, language_id, tc.codec_think_eos_id]
    looked_up = shared.codec(talker, (*tag_ids, tc.codec_pad_id, tc.codec_bos_id, tc.codec_pad_id), device)
    tags, pad_bos, codec_pad = looked_up[:-3], looked_up[-3:-1], looked_up[-1:]
    slot = [] if speaker_slot is None else [speaker_slot.view(1, -1)]
    control = torch.cat([tags, *slot, pad_bos], dim=0)
    parts.append(torch.cat([pad_t.expand(control.shape[0] - 2, -1), bos_t], dim=0) + control[:-1])
    codec_bos = control[-1:]

    body_text = text_ids[ROLE_LEN:-TARGET_TAIL]
    if icl:
        body, trailing = _icl_body(talker, ref_ids, body_text, ref_code, codec_bos, eos_t, pad_t,
                                   codec_pad, spec.non_streaming_mode, spec.text_open)
        parts.append(body)
    elif spec.non_streaming_mode:
        # The whole text against codec_pad, then tts_pad + codec_bos starts the audio.
        all_text = torch.cat([text(body_text), eos_t], dim=0)
        parts.append(all_text + codec_pad.expand(all_text.shape[0], -1))
        parts.append(pad_t + codec_bos)
        trailing = pad_t
    else:
        # One text token rides with codec_bos; the rest trails into the decode steps.
        parts.append(shared.text(talker, (first[ROLE_LEN],), device) + codec_bos)
        trailing = text(text_ids[ROLE_LEN + 1:-TARGET_TAIL])
        if not spec.text_open:  # an open text gets its eos when it closes
            trailing = torch.cat([trailing, eos_t], dim=0)

    return TalkerPrompt(embeds=torch.cat(parts, dim=0), trailing_text=trailing, tts_pad=pad_t[0])


def _icl_body(talker: Talker, ref_ids: torch.Tensor, text_ids: torch.Tensor, ref_code: torch.Tensor,
              codec_bos: torch.Tensor, eos_t: torch.Tensor, pad_t: torch.Tensor, codec_pad: torch.Tensor,
              non_streaming: bool, text_open: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """In-context body: reference + target text against codec_bos + the reference frames. An open text (at
    least as long as the codec track, `open_text_missing`) trails without its eos, which comes at its close."""
    text = talker.embed_text(torch.cat([ref_ids, text_ids]))
    if not text_open:
        text = torch.cat([text, eos_t], dim=0)
    codec = torch.cat([codec_bos, talker.embed_frame(ref_code)], dim=0)
    if non_streaming:
        return torch.cat([text + codec_pad.expand_as(text), codec + pad_t], dim=0), pad_t
    # Streaming text: align text with the codec track; text beyond the reference trails.
    n = codec.shape[0]
    if text.shape[0] > n or text_open:  # an open text is never shorter here, and trails on (maybe from empty)
        return text[:n] + codec, text[n:]
    text = torch.cat([text, pad_t.expand(n - text.shape[0], -1)], dim=0)
    return text + codec, pad_t


def _host_ids(ids: Sequence[int] | torch.Tensor, name: str, vocab: int) -> torch.Tensor:
    """`ids` checked, as a host int64 tensor."""
    t = ids.detach().to("cpu") if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.long)
    if t.dim() != 1 or t.is_floating_point() or t.is_complex():
        raise PromptError(f"{name} must be a 1-D sequence of integer token ids")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise PromptError(f"{name} holds token ids outside [0, {vocab})")
    return t.to(torch.long)


def _ids(ids: Sequence[int] | torch.Tensor, name: str, vocab: int, device: torch.device) -> torch.Tensor:
    return upload(_host_ids(ids, name, vocab), device)


def _language_id(language: str | None, cfg: Qwen3TTSConfig) -> int | None:
    lang = (language or "").lower()
    if lang not in supported_languages(cfg):
        raise PromptError(f"unsupported language {language!r}; supported: {supported_languages(cfg)}")
    return None if lang == "auto" else cfg.talker_config.codec_language_id[lang]


def _speaker_slot(spec: PromptSpec, talker: Talker, cfg: Qwen3TTSConfig, language_id: int | None,
                  device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor | None, int | None]:
    """The codec-track vector of the speaker slot (or None) and the language id after any dialect
    override."""
    tc = cfg.talker_config
    kind = cfg.tts_model_type
    if kind != "custom_voice" and spec.speaker:
        raise PromptError(f"a {kind} model has no preset speakers (got speaker {spec.speaker!r})")
    if kind != "base" and (spec.speaker_embedding is not None or spec.ref_code is not None
                           or spec.ref_ids is not None):
        raise PromptError(f"a {kind} model does not take a reference voice")
    if kind == "voice_design":
        return None, language_id
    if kind == "custom_voice":
        name = (spec.speaker or "").lower()
        if not name:
            raise PromptError(f"a custom_voice model needs a speaker; supported: {sorted(tc.spk_id)}")
        if name not in tc.spk_id:
            raise PromptError(f"unknown speaker {spec.speaker!r}; supported: {sorted(tc.spk_id)}")
        dialect = (tc.spk_is_dialect or {}).get(name)
        # A dialect speaker talks its dialect whenever the language is Chinese or left to the model.
        if dialect and (spec.language or "").lower() in ("chinese", "auto"):
            if dialect not in tc.codec_language_id:
                raise PromptError(f"speaker {name!r} needs dialect {dialect!r}, which the model lacks")
            language_id = tc.codec_language_id[dialect]
        spk = upload(torch.tensor(tc.spk_id[name], dtype=torch.long), device)
        return talker.embed_codec(spk), language_id
    emb = spec.speaker_embedding
    if emb is None:
        raise PromptError("a base (voice clone) model needs a speaker embedding")
    if not isinstance(emb, torch.Tensor) or emb.numel() != tc.hidden_size or emb.dim() not in (1, 2):
        raise PromptError(f"speaker_embedding must be a vector of {tc.hidden_size} values")
    emb = emb.detach().to("cpu", dtype).reshape(-1)  # checked on the host: no wait for the device
    if not bool(torch.isfinite(emb).all()):
        raise PromptError("speaker_embedding holds non-finite values")
    return upload(emb, device), language_id


def _instruct(spec: PromptSpec, cfg: Qwen3TTSConfig) -> tuple[int, ...] | None:
    """The instruction's token ids (checked), or None where the prompt holds none."""
    if spec.instruct_ids is None:
        return None
    ids = tuple(_host_ids(spec.instruct_ids, "instruct_ids", cfg.talker_config.text_vocab_size).tolist())
    if not ids:
        return None
    if cfg.tts_model_type == "base":
        raise PromptError("a base (voice clone) model does not take an instruction")
    if cfg.tts_model_type == "custom_voice" and cfg.tts_model_size == "0b6":
        return None  # the reference drops it for the 0.6B CustomVoice model
    return ids


def _icl_inputs(spec: PromptSpec, cfg: Qwen3TTSConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tc = cfg.talker_config
    if spec.ref_ids is None or spec.ref_code is None:
        raise PromptError("in-context voice cloning needs ref_ids (reference transcript) and ref_code")
    ref_ids = _ids(spec.ref_ids, "ref_ids", tc.text_vocab_size, device)
    if ref_ids.numel() < ROLE_LEN + REF_TAIL + 1:
        raise PromptError("ref_ids must hold the reference template around a non-empty transcript")
    code = spec.ref_code
    groups = tc.num_code_groups
    codebook = tc.code_predictor_config.vocab_size
    if not isinstance(code, torch.Tensor) or code.dim() != 2 or code.shape[1] != groups or code.shape[0] < 1:
        raise PromptError(f"ref_code must be a (frames, {groups}) tensor with at least one frame")
    if code.is_floating_point() or code.is_complex() or int(code.min()) < 0 or int(code.max()) >= codebook:
        raise PromptError(f"ref_code must hold integer codes in [0, {codebook})")
    return ref_ids[ROLE_LEN:-REF_TAIL], upload(code.to(torch.long), device)
