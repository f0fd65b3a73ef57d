"""Prefill-decode disaggregation inside the engine: building a `Handoff` at the end of a prefill, and landing
one in a decode worker's blocks and slot.

A handoff carries exactly the state a single engine holds for the request after its prefill: the prompt
KV, the last hidden state, the first codebook-0 token (already in the repetition-penalty history), the
trailing text, the sampling parameters and seed. Landing it reproduces that state bit for bit, so the
decode worker generates the codes a `single` engine would.
"""

from __future__ import annotations

import hashlib
import json

import torch

from legato.engine.model_runner import ModelRunner
from legato.engine.request import Request
from legato.kv_transfer.handoff import Handoff, KVLayout, gather_blocks, scatter_blocks
from legato.models.qwen3_tts.loader import LoadedModel
from legato.models.qwen3_tts.prompt import TalkerPrompt


def model_hash(loaded: LoadedModel) -> str:
    """Identifies the weights a KV cache was computed with (config + checkpoint name): a handoff between
    engines whose hashes differ is refused at handshake."""
    blob = json.dumps({"config": loaded.config.to_dict(), "path": loaded.path.name}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def make_handoff(
    runner: ModelRunner,
    req: Request,
    prompt: TalkerPrompt,
    engine_req,
    seed: int,
    first_token: int,
    ref_code: torch.Tensor | None,
    layout: KVLayout,
    text_tokens: int = 0,
) -> Handoff:
    """The handoff of a request whose prefill just ended (call before its blocks are freed). A request whose
    text is still open hands that on, with `text_tokens` (its target-text tokens so far)."""
    return Handoff(
        request_id=req.request_id,
        layout=layout,
        num_tokens=req.prompt_len,
        kv=gather_blocks(runner.kv.k, runner.kv.v, list(req.block_table), req.prompt_len),
        last_hidden=runner.slots.past_hidden[req.slot].clone(),
        first_token=int(first_token),
        trailing_text=prompt.trailing_text.to(runner.dtype).clone(),
        sampling=engine_req.sampling,
        seed=seed,
        max_frames=req.max_frames,
        ignore_eos=engine_req.ignore_eos,
        first_chunk_frames=engine_req.first_chunk_frames,
        ref_code=None if ref_code is None else ref_code.to(torch.int64).cpu(),
        text_open=req.text_frames is not None,
        text_tokens=text_tokens,
    )


@torch.inference_mode()
def receive_handoff(runner: ModelRunner, slot: int, block_table: list[int], h: Handoff) -> None:
    """Writes the handoff's KV into `block_table` and its post-prefill state into `slot` (whose sampling
    parameters and trailing text `SlotState.assign` has just set)."""
    scatter_blocks(runner.kv.k, runner.kv.v, block_table, h.kv)
    s = runner.slots
    s.past_hidden[slot] = h.last_hidden.to(device=s.past_hidden.device, dtype=s.past_hidden.dtype)
    s.last_c0[slot] = h.first_token
    s.seen[slot, h.first_token] = True
    s.frames[slot] = 0
