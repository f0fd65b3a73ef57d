"""A plain eager generation loop for one request: the executable definition of the decode rules that
the batched engine must reproduce (shared/reference/qwen3-tts-model.md §4).

Prefill gives the hidden state and codebook 0 of frame 0. Decode step k then (1) predicts codebooks
1..15 of frame k from that hidden state, (2) feeds the talker the 16-codebook embedding sum of frame k
plus text-track entry k (tts_pad once the trailing text is used up), and (3) takes codebook 0 of frame
k+1 from the new logits. Generation stops at EOS (never emitted as a frame) or after `max_new_tokens`
codebook-0 tokens, the last of which never gets its residuals: at most `max_new_tokens - 1` frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .decoder_layer import ContiguousKVCache
from .prompt import TalkerPrompt
from .sampling import SamplingParams, TalkerRules, WarpTensors, apply_talker_rules, choose_tokens, multinomial_draw
from .talker import Talker


@dataclass
class GenerationTrace:
    """Optional record of the raw (unprocessed) logits of a run, for parity tests and debugging:
    talker_logits[t] is [vocab] for codebook-0 token t; predictor_logits[k] is [15, 2048] for frame k."""

    talker_logits: list[torch.Tensor] = field(default_factory=list)
    predictor_logits: list[torch.Tensor] = field(default_factory=list)


@torch.no_grad()
def generate_codes(
    talker: Talker,
    prompt: TalkerPrompt,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    trace: GenerationTrace | None = None,
) -> torch.Tensor:
    """Codec codes [T, 16] (int64) of one request. Greedy settings are deterministic; sampled ones
    draw from `generator` (seeded from `params.seed` when no generator is given)."""
    cfg = talker.config
    device = prompt.embeds.device
    if generator is None and params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    draw = multinomial_draw(generator)
    rules = TalkerRules.build([params], cfg.vocab_size, cfg.codec_eos_token_id, device)
    warp = WarpTensors.build([params], subtalker=False, device=device)
    sub_warp = WarpTensors.build([params], subtalker=True, device=device)

    step_logits: list[torch.Tensor] = []  # the current frame's code-predictor logits, when tracing

    def pick_residual(logits: torch.Tensor, group: int) -> torch.Tensor:
        logits = logits.float()  # the head's dtype comes in (code_predictor.CodeSampler)
        if trace is not None:
            step_logits.append(logits[0])
        return choose_tokens(logits, sub_warp, draw)

    seen = torch.zeros(1, cfg.vocab_size, dtype=torch.bool, device=device)
    generated = torch.zeros(1, dtype=torch.long, device=device)

    def pick_first(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if trace is not None:
            trace.talker_logits.append(logits[0])
        code = choose_tokens(apply_talker_rules(logits, seen, generated, rules), warp, draw)
        seen.scatter_(1, code.unsqueeze(1), True)
        generated.add_(1)
        return code

    length = prompt.length
    cache = ContiguousKVCache(
        cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, length + params.max_new_tokens,
        prompt.embeds.dtype, device,
    )
    hidden = talker(prompt.embeds.unsqueeze(0), torch.arange(length, device=device).unsqueeze(0), cache)
    cache.advance(length)
    past_hidden = hidden[:, -1]
    code = pick_first(talker.logits(past_hidden))

    predictor_cache = talker.code_predictor.new_cache(1, past_hidden.dtype, device)
    frames: list[torch.Tensor] = []
    for step in range(params.max_new_tokens - 1):
        if int(code) == cfg.codec_eos_token_id:
            break
        step_logits.clear()
        residual = talker.code_predictor.predict_residuals(
            past_hidden, talker.embed_codec(code), pick_residual, predictor_cache
        )
        if trace is not None:
            trace.predictor_logits.append(torch.stack(step_logits))
        frame = torch.cat([code.unsqueeze(1), residual], dim=1)  # [1, 16]
        frames.append(frame[0])
        embed = talker.embed_frame(frame) + prompt.text_for_step(step)
        position = torch.full((1, 1), length + step, dtype=torch.long, device=device)
        hidden = talker(embed.unsqueeze(1), position, cache)
        cache.advance(1)
        past_hidden = hidden[:, -1]
        code = pick_first(talker.logits(past_hidden))

    if not frames:
        return torch.zeros(0, cfg.num_code_groups, dtype=torch.long, device=device)
    return torch.stack(frames)
