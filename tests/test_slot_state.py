"""Per-slot device state: a step's new requests reset their slots in one batched write."""

from __future__ import annotations

import dataclasses

import torch

from legato.engine.slot_state import NEVER_EOS, SlotAssignment, SlotState
from legato.models.qwen3_tts.sampling import SamplingParams


def _state() -> SlotState:
    s = SlotState(6, 8, 32, 5, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for t in (s.past_hidden, s.trailing):  # dirty, as slots are when a finished request leaves them
        t.normal_(generator=g)
    s.frames.fill_(7)
    s.seen.fill_(True)
    s.trailing_len.fill_(3)
    return s


def _tensors(s: SlotState) -> dict[str, torch.Tensor]:
    out = {k: getattr(s, k) for k in ("frames", "seen", "trailing", "trailing_len")}
    p = s.params
    for f in ("seed", "repetition_penalty", "min_new_tokens"):
        out[f] = getattr(p, f)
    for head in ("talker", "subtalker"):
        for f in dataclasses.fields(getattr(p, head)):
            out[f"{head}.{f.name}"] = getattr(getattr(p, head), f.name)
    return out


def test_assign_many_writes_what_assigning_each_slot_writes():
    g = torch.Generator().manual_seed(0)
    items = [
        SlotAssignment(1, torch.randn(4, 8, generator=g), SamplingParams(seed=3, temperature=0.7, top_k=9,
                       subtalker_do_sample=False, repetition_penalty=1.3), 11, False),
        SlotAssignment(4, torch.randn(2, 8, generator=g), SamplingParams(do_sample=False, top_p=0.5,
                       subtalker_top_k=5, min_new_tokens=3), 12, True),
    ]
    one, many = _state(), _state()
    for a in items:
        one.assign(a.slot, a.trailing_text, a.params, a.seed, a.ignore_eos)
    many.assign_many(items)
    for name, t in _tensors(one).items():
        assert torch.equal(t, _tensors(many)[name]), name
    assert many.params.min_new_tokens[4].item() == NEVER_EOS and many.params.min_new_tokens[1].item() == 2
    assert many.params.talker.top_k[1].item() == 9 and many.params.subtalker.do_sample[1].item() is False
    assert many.trailing_len.tolist() == [3, 4, 3, 3, 2, 3, 3] and many.frames[[1, 4]].tolist() == [0, 0]
    assert not many.seen[1].any() and many.seen[0].all()
