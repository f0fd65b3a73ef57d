"""Batched, placement-invariant token sampler for the talker (codebook 0) and code predictor (codebooks 1..15).

Each row carries its own parameters as tensor entries, so one batch mixes greedy and sampled requests with
different temperature / top-k / top-p. Everything is static-shape tensor work with no host syncs and no
data-dependent Python branches, so a runner can capture it in a CUDA graph.

Sampling is an exponential race (equivalently Gumbel-max): token = argmax(z - log E) where z are the
filtered, temperature-scaled logits and E are per-(seed, frame, codebook, vocab) exponential variates from
`rng.exponential`. That is a draw from softmax(z) (exact up to the uniforms' 32-bit resolution), and every
row's result depends on nothing but its own logits, parameters, seed and frame, so it does not change with
the row's batch position or neighbours.

Processor order and semantics follow transformers 4.57.3 `generate` (see the model reference, section 4.2):
  codebook 0:  RepetitionPenalty -> MinNewTokens(EOS) -> SuppressTokens -> Temperature -> TopK -> TopP -> draw
  codebooks 1+: Temperature -> TopK -> TopP -> draw   (sub-talker parameters, no penalty, no EOS)
Greedy rows (do_sample False, or temperature 0) take the argmax of the logits before the warpers, as
transformers does. One deliberate difference: top-p cuts at a value threshold, so tokens tied with the last
kept token are all kept, where transformers keeps an arbitrary subset decided by its sort order.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from legato.engine import draw_kernel
from legato.engine.rng import exponential

# The official talker suppresses the top 1024 ids of its codec vocabulary (control and speaker ids) except EOS.
_CONTROL_ID_SPAN = 1024
_SEED_LIMIT = 1 << 63
# Top-p sums probabilities as integers scaled by 2**36: exact in any order, and for vocabularies up to 2**16 the
# sums stay below 2**52, exact in float64 too. 2**-36 resolution is far finer than float32's exp.
_MASS_BITS = 36
_MAX_VOCAB = 1 << 16


@dataclass
class HeadTensors:
    """Per-row knobs of one sampling head, each a [B] tensor on the logits' device.

    top_k <= 0 or >= vocab means off; top_p >= 1 means off; a row samples only when do_sample is True and
    temperature > 0, otherwise it is greedy."""

    do_sample: torch.Tensor  # bool
    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float32


@dataclass
class SamplingTensors:
    """Everything the sampler needs about a batch, one row per request, all [B] tensors on one device.

    `frame` is the number of codec frames the request generated before the one being sampled (0 for the
    frame sampled at prefill); it keys the random numbers and drives min_new_tokens. A runner keeps one
    instance as static CUDA-graph inputs and refreshes it with `copy_`."""

    seed: torch.Tensor  # int64, 63-bit non-negative
    frame: torch.Tensor  # int64
    repetition_penalty: torch.Tensor  # float32
    min_new_tokens: torch.Tensor  # int64
    talker: HeadTensors
    subtalker: HeadTensors

    @classmethod
    def from_params(
        cls, params: Sequence[object], frames: Sequence[int] | torch.Tensor, device: torch.device | str
    ) -> SamplingTensors:
        """Build the batch from per-request parameter objects (duck-typed).

        Each object needs the attributes of `legato.models.qwen3_tts.sampling.SamplingParams`: do_sample,
        temperature, top_k, top_p, repetition_penalty, min_new_tokens, subtalker_do_sample,
        subtalker_temperature, subtalker_top_k, subtalker_top_p and seed. The seed must already be resolved
        (see `draw_seed`): drawing one here would give a request a new seed at every step."""
        for p in params:
            _validate(p)

        def col(name: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)

        frame = torch.as_tensor(frames, dtype=torch.int64).to(device)
        if frame.shape != (len(params),):
            raise ValueError(f"frames has shape {tuple(frame.shape)}, expected ({len(params)},)")
        return cls(
            seed=col("seed", torch.int64),
            frame=frame,
            repetition_penalty=col("repetition_penalty", torch.float32),
            min_new_tokens=col("min_new_tokens", torch.int64),
            talker=HeadTensors(
                do_sample=col("do_sample", torch.bool),
                temperature=col("temperature", torch.float32),
                top_k=col("top_k", torch.int64),
                top_p=col("top_p", torch.float32),
            ),
            subtalker=HeadTensors(
                do_sample=col("subtalker_do_sample", torch.bool),
                temperature=col("subtalker_temperature", torch.float32),
                top_k=col("subtalker_top_k", torch.int64),
                top_p=col("subtalker_top_p", torch.float32),
            ),
        )

    def copy_(self, src: SamplingTensors) -> SamplingTensors:
        """Copy every field of `src` (same batch size) into these tensors in place, e.g. static graph inputs."""
        for dst_t, src_t in zip(_leaves(self), _leaves(src), strict=True):
            dst_t.copy_(src_t, non_blocking=True)
        return self


def draw_seed() -> int:
    """A fresh 63-bit seed for a request that came without one; call it once, at admission."""
    return secrets.randbits(63)


def _validate(p: object) -> None:
    seed = getattr(p, "seed", None)
    if not isinstance(seed, int) or not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**63) resolved at admission, got {seed!r}")
    for prefix in ("", "subtalker_"):
        if getattr(p, prefix + "temperature") < 0:
            raise ValueError(f"{prefix}temperature must be >= 0")
        if not 0.0 <= getattr(p, prefix + "top_p") <= 1.0:
            raise ValueError(f"{prefix}top_p must be in [0, 1]")
        if getattr(p, prefix + "top_k") < 0:
            raise ValueError(f"{prefix}top_k must be >= 0 (0 = off)")
    if not p.repetition_penalty > 0:  # type: ignore[attr-defined]
        raise ValueError("repetition_penalty must be > 0")
    if p.min_new_tokens < 0:  # type: ignore[attr-defined]
        raise ValueError("min_new_tokens must be >= 0")


def _leaves(st: SamplingTensors) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for f in fields(st):
        v = getattr(st, f.name)
        if isinstance(v, HeadTensors):
            out.extend(getattr(v, g.name) for g in fields(v))
        else:
            out.append(v)
    return out


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' RepetitionPenalty: seen ids' logits are divided by the row's penalty if positive,
    multiplied if negative. logits [B, V] float32, seen [B, V] bool, penalty [B]."""
    p = penalty[:, None]
    return torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)


def warp(logits: torch.Tensor, w: HeadTensors) -> torch.Tensor:
    """Temperature -> TopK -> TopP on float32 [B, V] logits with per-row parameters; removed ids get -inf.

    Greedy rows are scaled by 1 instead of their temperature (their result is unused, and 0 would make NaNs).
    Both filters become per-row value thresholds over one descending sort, which keeps shapes static and
    makes each row's result independent of how the sort orders equal values."""
    vocab = logits.shape[-1]
    if vocab > _MAX_VOCAB:
        raise ValueError(f"vocabulary of {vocab} exceeds the {_MAX_VOCAB} that exact top-p sums allow")
    sampled = w.do_sample & (w.temperature > 0)
    scaled = logits / torch.where(sampled, w.temperature, 1.0)[:, None]
    desc = torch.sort(scaled, dim=-1, descending=True).values

    # TopK as transformers: drop logits strictly below the k-th largest (ties with it survive).
    k = torch.where(w.top_k <= 0, vocab, w.top_k).clamp(max=vocab)
    kth = desc.gather(1, (k - 1)[:, None])
    desc = desc.masked_fill(desc < kth, float("-inf"))

    # TopP as transformers: in ascending order drop ids whose cumulative probability is <= 1 - top_p, always
    # keeping the largest. In descending order that cumulative is total - (mass strictly before), so the kept
    # ids form a prefix. The masses are summed as fixed-point integers, exact in any order, so the cut cannot
    # move with batch size or scan algorithm.
    mass = (torch.exp(desc - desc[:, :1]) * 2.0**_MASS_BITS).to(torch.int64)
    cum = torch.cumsum(mass, dim=-1)
    total = cum[:, -1:]
    above = (total - (cum - mass)).to(torch.float64)
    drop = above <= (1.0 - w.top_p.to(torch.float64))[:, None] * total.to(torch.float64)
    drop[:, 0] = False
    drop &= (w.top_p < 1.0)[:, None]
    n_keep = vocab - drop.sum(dim=-1, keepdim=True)
    cut = torch.maximum(kth, desc.gather(1, n_keep - 1))
    return scaled.masked_fill(scaled < cut, float("-inf"))


def draw(
    logits: torch.Tensor, w: HeadTensors, seed: torch.Tensor, frame: torch.Tensor, codebook: int | torch.Tensor
) -> torch.Tensor:
    """Tokens int64 [B] from processed float32 logits [B, V]: greedy rows take the argmax, sampled rows win
    an exponential race over the warped logits keyed by (seed, frame, codebook, vocab index)."""
    race = warp(logits, w) - torch.log(exponential(seed, frame, codebook, logits.shape[-1]))
    sampled = w.do_sample & (w.temperature > 0)
    return torch.where(sampled, race.argmax(dim=-1), logits.argmax(dim=-1))


class Sampler:
    """Samples codebook 0 (talker) and codebooks 1..15 (code predictor) for a batch; holds no batch state."""

    def __init__(self, eos_token_id: int, suppress_range: tuple[int, int], compile: bool = False) -> None:
        """eos_token_id: the codec EOS, masked until min_new_tokens frames exist and never suppressed.
        suppress_range: [start, end) of codebook-0 ids that are never sampled (EOS excepted).
        compile: where the draw kernel (engine/draw_kernel.py) is off or unavailable, run `draw` through
        torch.compile (one dynamic-batch compile per vocabulary size). Use it on
        GPU: unfused, Philox is ~300 tiny int64 kernels per call and a B=256 frame (1 + 15 draws) costs
        ~11 ms even inside a CUDA graph, against ~1 ms fused. Tokens are identical either way. Warm each
        shape up before capturing a CUDA graph around the sampler."""
        self.eos_token_id = eos_token_id
        self.suppress_range = suppress_range
        self._compiled = torch.compile(draw, fullgraph=True, dynamic=True) if compile else draw

    def _draw(self, logits: torch.Tensor, w: HeadTensors, seed: torch.Tensor, frame: torch.Tensor,
              codebook: int) -> torch.Tensor:
        # On CUDA one Triton program per row (engine/draw_kernel.py): the same tokens, ~6 kernels fewer a draw,
        # and the codebook a launch argument (a frame's 16 draws fill no codebook tensor).
        if draw_kernel.available(logits):  # widens a half-precision head's logits as it loads them
            return draw_kernel.fused_draw(logits.contiguous(), w.do_sample, w.temperature, w.top_k, w.top_p, seed,
                                          frame, codebook)
        # A tensor, so a compiled draw is not specialised per codebook.
        return self._compiled(logits.float(), w, seed, frame, torch.full_like(seed, codebook))

    @classmethod
    def from_talker_config(cls, talker_config: object, compile: bool = False) -> Sampler:
        """From a config with `vocab_size` and `codec_eos_token_id` (our TalkerConfig), as the official model."""
        vocab = talker_config.vocab_size  # type: ignore[attr-defined]
        eos = talker_config.codec_eos_token_id  # type: ignore[attr-defined]
        return cls(eos, (vocab - _CONTROL_ID_SPAN, vocab), compile=compile)

    def process_codebook0(self, logits: torch.Tensor, st: SamplingTensors, seen: torch.Tensor) -> torch.Tensor:
        """The processors before the warpers: RepetitionPenalty -> MinNewTokens(EOS) -> SuppressTokens.

        logits [B, V] (any float dtype; computed in float32 like transformers), seen [B, V] bool."""
        x = penalize_repeats(logits.float(), seen, st.repetition_penalty)
        ids = torch.arange(x.shape[-1], device=x.device)
        is_eos = ids == self.eos_token_id
        start, end = self.suppress_range
        x = x.masked_fill(is_eos[None, :] & (st.frame < st.min_new_tokens)[:, None], float("-inf"))
        return x.masked_fill(((ids >= start) & (ids < end) & ~is_eos)[None, :], float("-inf"))

    def sample_codebook0(
        self,
        logits: torch.Tensor,
        st: SamplingTensors,
        seen: torch.Tensor,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Codebook-0 tokens int64 [B]; marks each sampled id in `seen` in place.

        seen: bool [S, V], the ids each running slot has generated so far (what the repetition penalty
        looks at); a runner keeps it as a static buffer and clears a slot's row when a request takes the slot.
        slots: int64 [B], the row of `seen` for each batch row; None means seen is [B, V] in batch order.
        Padding rows of a graph bucket should point at a scratch slot, since their ids are recorded too."""
        rows = seen if slots is None else seen.index_select(0, slots)
        tokens = self._draw(self.process_codebook0(logits, st, rows), st.talker, st.seed, st.frame, 0)
        if slots is None:
            seen.scatter_(1, tokens[:, None], True)
        else:
            seen.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.bool))
        return tokens

    def sample_residual(self, logits: torch.Tensor, st: SamplingTensors, codebook: int) -> torch.Tensor:
        """Code-predictor tokens int64 [B] for `codebook` (1..15) from its logits [B, 2048], with the
        sub-talker parameters: Temperature -> TopK -> TopP -> draw, no penalty and no EOS. Logits of any float
        dtype, drawn from as float32 (on CUDA the draw kernel widens them as it loads: no cast kernel a draw)."""
        return self._draw(logits, st.subtalker, st.seed, st.frame, codebook)
