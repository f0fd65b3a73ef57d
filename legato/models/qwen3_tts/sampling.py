"""Sampling parameters and batched logits processing for the talker and the code predictor.

The processors follow transformers' order exactly (`GenerationMixin._get_logits_processor`, 4.57.3):
RepetitionPenalty -> MinNewTokens(EOS) -> SuppressTokens -> Temperature -> TopK -> TopP -> sample.
The first three are talker rules and apply even in greedy mode; the code predictor gets only the
warpers. Every function works on [B, V] logits with per-row parameters, so one call serves a whole
decode batch with mixed settings and fixed shapes (no per-request loop, CUDA-graph friendly).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# probs [B, V] (rows sum to 1) -> token ids [B]; swap in a counter-based sampler for the engine.
Draw = Callable[[torch.Tensor], torch.Tensor]


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it."""


@dataclass
class SamplingParams:
    """Per-request generation settings. Defaults are the official ones (the `generation_config.json`
    shipped with the checkpoints; the wrapper's hard defaults only differ in max_new_tokens = 2048).

    `max_new_tokens` counts codebook-0 tokens as the reference does, so it yields at most
    `max_new_tokens - 1` frames."""

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    min_new_tokens: int = 2
    max_new_tokens: int = 8192
    subtalker_do_sample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_generation_defaults(cls, defaults: dict[str, Any], **overrides: Any) -> SamplingParams:
        """Params from a model's `generation_config.json` values (HF key names, e.g. `subtalker_dosample`),
        with `overrides` (our field names) taking precedence where they are not None."""
        names = {"subtalker_dosample": "subtalker_do_sample"}
        fields = {f for f in cls.__dataclass_fields__}
        values = {names.get(k, k): v for k, v in defaults.items() if names.get(k, k) in fields}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def validate(self) -> None:
        _check_warp("", self.do_sample, self.temperature, self.top_k, self.top_p)
        _check_warp("subtalker_", self.subtalker_do_sample, self.subtalker_temperature, self.subtalker_top_k,
                    self.subtalker_top_p)
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise SamplingParamsError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not _int(self.min_new_tokens) or self.min_new_tokens < 0:
            raise SamplingParamsError(f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        if not _int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise SamplingParamsError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and (not _int(self.seed) or not 0 <= self.seed < 2**63):
            raise SamplingParamsError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_warp(prefix: str, do_sample: bool, temperature: float, top_k: int, top_p: float) -> None:
    if not isinstance(do_sample, bool):
        raise SamplingParamsError(f"{prefix}do_sample must be a bool, got {do_sample!r}")
    # Greedy rows ignore the warpers, so only sampled rows need a usable temperature.
    if not _finite(temperature) or (do_sample and temperature <= 0):
        raise SamplingParamsError(f"{prefix}temperature must be > 0 when sampling, got {temperature!r}")
    if not _int(top_k) or top_k < 0:
        raise SamplingParamsError(f"{prefix}top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not _finite(top_p) or not 0 < top_p <= 1:
        raise SamplingParamsError(f"{prefix}top_p must be in (0, 1], got {top_p!r}")


@dataclass
class WarpTensors:
    """Per-row warper settings of a batch: do_sample [B] bool, temperature [B] f32 (1 on greedy rows),
    top_k [B] int64 (0 = off), top_p [B] f32. `any_sample` is the host-side OR of do_sample, so the
    all-greedy case skips the warpers without a device sync."""

    do_sample: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    any_sample: bool = True

    @classmethod
    def build(cls, params: Sequence[SamplingParams], subtalker: bool, device: torch.device | str | None = None
              ) -> WarpTensors:
        p = "subtalker_" if subtalker else ""
        do = [getattr(x, f"{p}do_sample") for x in params]
        temp = [getattr(x, f"{p}temperature") if d else 1.0 for x, d in zip(params, do, strict=True)]
        return cls(
            do_sample=torch.tensor(do, dtype=torch.bool, device=device),
            temperature=torch.tensor(temp, dtype=torch.float32, device=device),
            top_k=torch.tensor([getattr(x, f"{p}top_k") for x in params], dtype=torch.long, device=device),
            top_p=torch.tensor([getattr(x, f"{p}top_p") for x in params], dtype=torch.float32, device=device),
            any_sample=any(do),
        )


@dataclass
class TalkerRules:
    """The talker-only processors of a batch: repetition_penalty [B] f32, min_new_tokens [B] int64,
    the EOS id and a [V] bool mask of suppressed ids (codec ids 2048.. except EOS)."""

    repetition_penalty: torch.Tensor
    min_new_tokens: torch.Tensor
    eos_id: int
    suppress: torch.Tensor

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab_size: int, eos_id: int,
              device: torch.device | str | None = None) -> TalkerRules:
        return cls(
            repetition_penalty=torch.tensor([x.repetition_penalty for x in params], dtype=torch.float32,
                                            device=device),
            min_new_tokens=torch.tensor([x.min_new_tokens for x in params], dtype=torch.long, device=device),
            eos_id=eos_id,
            suppress=suppress_mask(vocab_size, eos_id, device),
        )


def suppress_mask(vocab_size: int, eos_id: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The reference suppresses the top 1024 codec ids (control tokens and speaker ids), EOS excepted."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[max(vocab_size - 1024, 0):] = True
    mask[eos_id] = False
    return mask


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Penalise ids already generated (`seen` [B, V] bool): divide positive logits, multiply negative
    ones, once per id however often it occurred."""
    penalty = penalty.to(logits.dtype).unsqueeze(1)
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def apply_min_new_tokens(logits: torch.Tensor, num_generated: torch.Tensor, min_new_tokens: torch.Tensor,
                         eos_id: int) -> torch.Tensor:
    """Mask EOS on rows that have generated fewer than `min_new_tokens` tokens."""
    block = (num_generated < min_new_tokens).unsqueeze(1)
    is_eos = torch.arange(logits.shape[-1], device=logits.device) == eos_id
    return logits.masked_fill(block & is_eos, -math.inf)


def apply_talker_rules(logits: torch.Tensor, seen: torch.Tensor, num_generated: torch.Tensor,
                       rules: TalkerRules) -> torch.Tensor:
    """Repetition penalty -> min-new-tokens EOS mask -> suppression, on fp32 [B, V] logits."""
    logits = apply_repetition_penalty(logits, seen, rules.repetition_penalty)
    logits = apply_min_new_tokens(logits, num_generated, rules.min_new_tokens, rules.eos_id)
    return logits.masked_fill(rules.suppress, -math.inf)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return logits / temperature.to(logits.dtype).unsqueeze(1)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k logits (ties with the k-th kept); top_k 0 leaves the row alone."""
    vocab = logits.shape[-1]
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab))
    ordered = torch.sort(logits, dim=-1, descending=True).values
    kth = ordered.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, -math.inf)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter: drop the low tail whose cumulative probability is <= 1 - top_p, keeping at least
    the most likely id. With top_p = 1 only zero-probability ids go, which changes no distribution."""
    ordered, order = torch.sort(logits, dim=-1, descending=False)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    drop = drop.scatter(1, order, drop)
    return logits.masked_fill(drop, -math.inf)


def multinomial_draw(generator: torch.Generator | None = None) -> Draw:
    """The reference draw: one `torch.multinomial` sample per row."""

    def draw(probs: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)

    return draw


def choose_tokens(logits: torch.Tensor, warp: WarpTensors, draw: Draw) -> torch.Tensor:
    """Next ids [B] from processed fp32 logits [B, V]: argmax on greedy rows, a draw from the
    temperature/top-k/top-p-warped distribution on sampled rows."""
    greedy = logits.argmax(dim=-1)
    if not warp.any_sample:
        return greedy
    warped = apply_top_p(apply_top_k(apply_temperature(logits, warp.temperature), warp.top_k), warp.top_p)
    sampled = draw(warped.softmax(dim=-1))
    return torch.where(warp.do_sample, sampled, greedy)
