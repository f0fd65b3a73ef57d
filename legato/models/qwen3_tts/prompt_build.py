"""Talker prompts for many requests at once: the host lays each one out, the device builds them all in a few launches.

A prompt row is a text-track vector plus a codec-track vector (either may be absent; reference doc §3). Built one
request at a time, a prompt costs about a dozen small device launches; the server's admission thread pays them for
every request of a burst, each behind the GIL beside the engine thread. Here each request's layout is worked out on
the host (`_Layout`: which piece and row each track of each row comes from), then the batch's pieces go into one
table and every prompt of the batch is two gathers and an add; its trailing text one more gather.

Same bits as a prompt built alone, whatever it is batched with: a request's own text is projected alone, at its own
length (a matrix product's rows can depend on how many rows it has); reference frames are embedded per request;
shared pieces come from the same cache (`prompt_parts`); lookups, gathers and concatenation copy; a row's two
tracks are added once, element-wise; a row with one track gets a zero row added, which leaves every value as it is.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from legato.layers.host import upload

from .config import Qwen3TTSConfig
from .prompt import (
    REF_TAIL,
    ROLE_LEN,
    TARGET_TAIL,
    PromptError,
    PromptSpec,
    TalkerPrompt,
    open_text_missing,
    supported_languages,
)
from .prompt_parts import PromptParts, parts_of
from .talker import Talker


@dataclass(eq=False)
class _Piece:
    """Rows a layout reads: a tensor already on the device, or one the batch makes (`kind`)."""

    kind: str  # "ready" | "text" (project host ids) | "frames" (embed host codes) | "vector" (upload host rows)
    host: torch.Tensor | list[int] | None = None
    ready: torch.Tensor | None = None

    @property
    def key(self) -> int:
        """Pieces with one key are one set of rows in the batch's table: a cached tensor is there once, however
        many requests read it."""
        return id(self.ready) if self.ready is not None else id(self)

    @property
    def rows(self) -> int:
        if self.ready is not None:
            return int(self.ready.shape[0])
        return len(self.host) if isinstance(self.host, list) else int(self.host.shape[0])


# One track of a run of rows: (piece, first row, step); step 0 repeats the row (a broadcast), None: no track.
_Track = tuple[_Piece, int, int] | None


@dataclass
class _Layout:
    """One request's prompt as runs of rows, each row = text track + codec track, and its trailing text."""

    tts_pad: torch.Tensor
    voice: _Piece | None = None  # its speaker embedding (checked for the whole batch at once)
    runs: list[tuple[int, _Track, _Track]] = field(default_factory=list)  # (rows, text track, codec track)
    trailing: list[tuple[int, _Track]] = field(default_factory=list)

    def add(self, n: int, text: _Track, codec: _Track) -> None:
        if n > 0:
            self.runs.append((n, text, codec))

    def trail(self, n: int, text: _Track) -> None:
        if n > 0:
            self.trailing.append((n, text))


def build_prompt(spec: PromptSpec, talker: Talker, cfg: Qwen3TTSConfig) -> TalkerPrompt:
    """The talker prompt of one request (raises PromptError for invalid requests)."""
    out = build_prompts([spec], talker, cfg)[0]
    if isinstance(out, Exception):
        raise out
    return out


@torch.no_grad()
def build_prompts(specs: Sequence[PromptSpec], talker: Talker,
                  cfg: Qwen3TTSConfig) -> list[TalkerPrompt | PromptError]:
    """The talker prompt of each spec, or the PromptError that refuses it (one bad request fails alone). Each
    prompt equals, bit for bit, the one its spec gets alone. Prompts of one batch are views of shared buffers."""
    shared = parts_of(talker)  # what every request (or many) share: computed once, the same bits
    laid: list[_Layout | PromptError] = []
    for spec in specs:
        try:
            laid.append(_lay_out(spec, talker, cfg, shared))
        except PromptError as e:
            laid.append(e)
    _refuse_non_finite_voices(laid)
    layouts = [x for x in laid if isinstance(x, _Layout)]
    if not layouts:
        return laid
    built = iter(_assemble(layouts, talker, shared.zero_row(talker)))
    return [x if isinstance(x, PromptError) else next(built) for x in laid]


def _refuse_non_finite_voices(laid: list[_Layout | PromptError]) -> None:
    """Replaces the layout of each request whose speaker embedding holds a NaN or infinity by its refusal (the
    batch's embeddings checked in one pass, on the host)."""
    voices = [(i, lay.voice) for i, lay in enumerate(laid) if isinstance(lay, _Layout) and lay.voice is not None]
    if not voices:
        return
    finite = torch.isfinite(torch.cat([v.host for _, v in voices])).all(dim=1).tolist()
    for (i, _), ok in zip(voices, finite, strict=True):
        if not ok:
            laid[i] = PromptError("speaker_embedding holds non-finite values")


def _lay_out(spec: PromptSpec, talker: Talker, cfg: Qwen3TTSConfig, shared: PromptParts) -> _Layout:
    """Checks `spec` and says where each row of its prompt comes from (host work only, but for cached pieces
    computed the first time they are needed)."""
    tc = cfg.talker_config
    device = talker.codec_head.weight.device
    dtype = talker.codec_head.weight.dtype
    kind = cfg.tts_model_type

    ids = _id_list(spec.text_ids, "text_ids", tc.text_vocab_size)
    if len(ids) < ROLE_LEN + TARGET_TAIL + 1:
        raise PromptError("text_ids must hold the assistant template around at least one text token")
    language_id = _language_id(spec.language, cfg)
    speaker, language_id = _speaker_slot(spec, talker, cfg, shared, language_id, device, dtype)
    instruct = _instruct(spec, cfg)
    icl = kind == "base" and not spec.x_vector_only
    if icl:
        ref_ids, ref_code = _icl_inputs(spec, cfg)
    if spec.text_open and spec.non_streaming_mode:
        # The non-streaming layout puts the whole text in the prompt: it does not exist before the text does.
        raise PromptError("text that is still arriving needs the streaming-text layout (non_streaming_mode off)")
    if spec.text_open and icl and (missing := open_text_missing(spec)) > 0:
        raise PromptError(f"an in-context clone's open text needs {missing} more text token(s) before its prompt "
                          "exists (its reference frames carry the text beside them)")

    special = shared.text(talker, (cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id), device)
    specials = _Piece("ready", ready=special)
    bos, eos, pad = (specials, 0, 1), (specials, 1, 1), (specials, 2, 0)
    out = _Layout(tts_pad=special[2], voice=speaker if speaker is not None and speaker.kind == "vector" else None)

    if instruct is not None:
        out.add(len(instruct), (_Piece("ready", ready=shared.text(talker, instruct, device)), 0, 1), None)
    out.add(ROLE_LEN, (_Piece("ready", ready=shared.text(talker, tuple(ids[:ROLE_LEN]), device)), 0, 1), None)

    # Codec control prefix: think/language tags and the optional speaker slot against tts_pad, then codec_pad
    # against tts_bos; codec_bos is held back for the body. The control ids are one cached lookup, codec_pad last.
    if language_id is None:
        tag_ids = [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id]
    else:
        tag_ids = [tc.codec_think_id, tc.codec_think_bos_id, language_id, tc.codec_think_eos_id]
    tags = len(tag_ids)
    control = _Piece("ready", ready=shared.codec(talker, (*tag_ids, tc.codec_pad_id, tc.codec_bos_id,
                                                          tc.codec_pad_id), device))
    codec_bos, codec_pad = (control, tags + 1, 1), (control, tags + 2, 0)
    out.add(tags, pad, (control, 0, 1))
    if speaker is not None:
        out.add(1, pad, (speaker, 0, 1))
    out.add(1, bos, (control, tags, 1))

    body = ids[ROLE_LEN:-TARGET_TAIL]
    if icl:
        _icl_body(out, ref_ids, body, ref_code, codec_bos, codec_pad, eos, pad, spec)
    elif spec.non_streaming_mode:
        # The whole text, then tts_eos, against codec_pad; then tts_pad + codec_bos starts the audio.
        text = _Piece("text", host=body)
        out.add(text.rows, (text, 0, 1), codec_pad)
        out.add(1, eos, codec_pad)
        out.add(1, pad, codec_bos)
        out.trail(1, pad)
    else:
        # One text token rides with codec_bos; the rest trails into the decode steps.
        first = _Piece("ready", ready=shared.text(talker, (ids[ROLE_LEN],), device))
        out.add(1, (first, 0, 1), codec_bos)
        rest = _Piece("text", host=ids[ROLE_LEN + 1:-TARGET_TAIL])
        out.trail(rest.rows, (rest, 0, 1))
        if not spec.text_open:  # an open text gets its eos when it closes
            out.trail(1, eos)
    return out


def _icl_body(out: _Layout, ref_ids: list[int], text_ids: list[int], ref_code: torch.Tensor,
              codec_bos: _Track, codec_pad: _Track, eos: _Track, pad: _Track, spec: PromptSpec) -> None:
    """In-context body: reference + target text (projected together) against codec_bos + the reference frames. An
    open text (at least as long as the codec track, `open_text_missing`) trails without its eos, which comes at
    its close."""
    text = _Piece("text", host=ref_ids + text_ids)
    frames = _Piece("frames", host=ref_code)
    with_eos = not spec.text_open
    m, n = text.rows, 1 + frames.rows  # text rows (before the eos), codec rows

    def text_rows(start: int, count: int) -> list[tuple[int, _Track]]:
        """Rows [start, start + count) of the text track: the projected text, then the eos."""
        runs = []
        if start < m:
            k = min(count, m - start)
            runs.append((k, (text, start, 1)))
            start, count = start + k, count - k
        if count > 0 and with_eos and start == m:
            runs.append((1, eos))
        return runs

    codec = [(1, codec_bos), (frames.rows, (frames, 0, 1))]  # the codec track's n rows
    total = m + int(with_eos)
    if spec.non_streaming_mode:
        for k, track in text_rows(0, total):
            out.add(k, track, codec_pad)
        for k, track in codec:
            out.add(k, pad, track)
        out.trail(1, pad)
        return
    # Streaming text: align the text with the codec track; text beyond the reference trails.
    if total > n or spec.text_open:  # an open text is never shorter here, and trails on (maybe from empty)
        _zip(out, text_rows(0, n), codec)
        for k, track in text_rows(n, total - n):
            out.trail(k, track)
        return
    _zip(out, text_rows(0, total) + ([(n - total, pad)] if n > total else []), codec)
    out.trail(1, pad)


def _zip(out: _Layout, text: list[tuple[int, _Track]], codec: list[tuple[int, _Track]]) -> None:
    """Adds rows pairing two tracks given as runs (of equal total length), cutting runs where the other cuts."""
    text, codec = [list(r) for r in text], [list(r) for r in codec]
    while text and codec:
        k = min(text[0][0], codec[0][0])
        out.add(k, text[0][1], codec[0][1])
        for runs in (text, codec):
            runs[0][0] -= k
            piece, row, step = runs[0][1]
            runs[0][1] = (piece, row + k * step, step)
            if runs[0][0] == 0:
                runs.pop(0)


def _assemble(layouts: list[_Layout], talker: Talker, zero_row: torch.Tensor) -> list[TalkerPrompt]:
    """The device part of a batch: its pieces made, put in one table, and every prompt gathered from it."""
    device = talker.codec_head.weight.device
    pieces: dict[int, _Piece] = {}  # in first-use order
    for lay in layouts:
        for _, *tracks in lay.runs:
            for track in tracks:
                if track is not None:
                    pieces.setdefault(track[0].key, track[0])
        for _, track in lay.trailing:
            if track is not None:
                pieces.setdefault(track[0].key, track[0])
    order = list(pieces.values())
    offsets, at = {}, 0
    for piece in order:
        offsets[piece.key] = at
        at += piece.rows
    zero = at  # the row a missing track reads

    def rows(n: int, track: _Track) -> list[int]:
        if track is None:
            return [zero] * n
        piece, row, step = track
        first = offsets[piece.key] + row
        return list(range(first, first + n)) if step else [first] * n

    text_idx, codec_idx, trail_idx, bounds = [], [], [], []
    for lay in layouts:
        start, trail_start = len(text_idx), len(trail_idx)
        for n, text, codec in lay.runs:
            text_idx += rows(n, text)
            codec_idx += rows(n, codec)
        for n, track in lay.trailing:
            trail_idx += rows(n, track)
        bounds.append((start, len(text_idx), trail_start, len(trail_idx)))

    # Every integer the device needs in one upload: the texts' ids, the reference codes, then the gathers' indices.
    texts = [p for p in order if p.kind == "text"]
    frames = [p for p in order if p.kind == "frames"]
    vectors = [p for p in order if p.kind == "vector"]
    text_ids = [i for p in texts for i in p.host]
    index = text_idx + codec_idx + trail_idx
    host = torch.tensor(text_ids + index, dtype=torch.long)
    if frames:
        host = torch.cat([host, *(p.host.reshape(-1) for p in frames)])
    ids, index, codes = _cut(upload(host, device), [len(text_ids), len(index), sum(p.host.numel() for p in frames)])
    made: dict[int, torch.Tensor] = {}
    if texts:  # one lookup for all texts; each text then projected alone, at its own length
        for p, looked_up in zip(texts, _cut(talker.model.text_embedding(ids), [p.rows for p in texts]), strict=True):
            made[id(p)] = talker.text_projection(looked_up)
    for p, code in zip(frames, _cut(codes, [p.host.numel() for p in frames]), strict=True):
        made[id(p)] = talker.embed_frame(code.view(p.host.shape))
    if vectors:
        uploaded = upload(torch.cat([p.host for p in vectors]), device)
        made.update((id(p), v) for p, v in zip(vectors, _cut(uploaded, [p.rows for p in vectors]), strict=True))
    table = torch.cat([*(made[id(p)] if p.kind != "ready" else p.ready for p in order), zero_row])
    text_rows, codec_rows, trail_rows = _cut(index, [len(text_idx), len(codec_idx), len(trail_idx)])
    embeds = table.index_select(0, text_rows) + table.index_select(0, codec_rows)
    trailing = table.index_select(0, trail_rows)
    return [TalkerPrompt(embeds=embeds[a:b], trailing_text=trailing[c:d], tts_pad=lay.tts_pad)
            for lay, (a, b, c, d) in zip(layouts, bounds, strict=True)]


def _cut(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Consecutive slices of `t` along its first dimension, of these sizes."""
    out, at = [], 0
    for n in sizes:
        out.append(t[at:at + n])
        at += n
    return out


def _id_list(ids: Sequence[int] | torch.Tensor, name: str, vocab: int) -> list[int]:
    """`ids` checked, as a list of ints (a host tensor per request would cost more than the checks)."""
    try:
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
                raise TypeError
            ids = ids.tolist()
        out = [operator.index(i) for i in ids]  # ints (numpy's too), not floats or nested sequences
    except TypeError:
        raise PromptError(f"{name} must be a 1-D sequence of integer token ids") from None
    if out and (min(out) < 0 or max(out) >= vocab):
        raise PromptError(f"{name} holds token ids outside [0, {vocab})")
    return out


def _language_id(language: str | None, cfg: Qwen3TTSConfig) -> int | None:
    lang = (language or "").lower()
    if lang not in supported_languages(cfg):
        raise PromptError(f"unsupported language {language!r}; supported: {supported_languages(cfg)}")
    return None if lang == "auto" else cfg.talker_config.codec_language_id[lang]


def _speaker_slot(spec: PromptSpec, talker: Talker, cfg: Qwen3TTSConfig, shared: PromptParts, language_id: int | None,
                  device: torch.device, dtype: torch.dtype) -> tuple[_Piece | None, int | None]:
    """The codec-track row of the speaker slot (or None) and the language id after any dialect override."""
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
        spk = tc.spk_id[name]
        spk = (int(spk),) if isinstance(spk, int) else tuple(int(i) for i in spk)  # an id, or a one-id list
        if len(spk) != 1:
            raise PromptError(f"speaker {name!r} has {len(spk)} codec ids in the model's config; one is needed")
        return _Piece("ready", ready=shared.codec(talker, spk, device)), language_id
    emb = spec.speaker_embedding
    if emb is None:
        raise PromptError("a base (voice clone) model needs a speaker embedding")
    if not isinstance(emb, torch.Tensor) or emb.numel() != tc.hidden_size or emb.dim() not in (1, 2):
        raise PromptError(f"speaker_embedding must be a vector of {tc.hidden_size} values")
    emb = emb.detach().to("cpu", dtype).reshape(-1)  # checked on the host (no wait for the device), per batch
    return _Piece("vector", host=emb.view(1, -1)), language_id


def _instruct(spec: PromptSpec, cfg: Qwen3TTSConfig) -> tuple[int, ...] | None:
    """The instruction's token ids (checked), or None where the prompt holds none."""
    if spec.instruct_ids is None:
        return None
    ids = tuple(_id_list(spec.instruct_ids, "instruct_ids", cfg.talker_config.text_vocab_size))
    if not ids:
        return None
    if cfg.tts_model_type == "base":
        raise PromptError("a base (voice clone) model does not take an instruction")
    if cfg.tts_model_type == "custom_voice" and cfg.tts_model_size == "0b6":
        return None  # the reference drops it for the 0.6B CustomVoice model
    return ids


def _icl_inputs(spec: PromptSpec, cfg: Qwen3TTSConfig) -> tuple[list[int], torch.Tensor]:
    """The reference transcript's ids (without its template) and the reference codes, checked, on the host."""
    tc = cfg.talker_config
    if spec.ref_ids is None or spec.ref_code is None:
        raise PromptError("in-context voice cloning needs ref_ids (reference transcript) and ref_code")
    ref_ids = _id_list(spec.ref_ids, "ref_ids", tc.text_vocab_size)
    if len(ref_ids) < ROLE_LEN + REF_TAIL + 1:
        raise PromptError("ref_ids must hold the reference template around a non-empty transcript")
    code = spec.ref_code
    groups = tc.num_code_groups
    codebook = tc.code_predictor_config.vocab_size
    if not isinstance(code, torch.Tensor) or code.dim() != 2 or code.shape[1] != groups or code.shape[0] < 1:
        raise PromptError(f"ref_code must be a (frames, {groups}) tensor with at least one frame")
    if code.is_floating_point() or code.is_complex() or int(code.min()) < 0 or int(code.max()) >= codebook:
        raise PromptError(f"ref_code must hold integer codes in [0, {codebook})")
    return ref_ids[ROLE_LEN:-REF_TAIL], code.detach().to("cpu", torch.long)
