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


def test_gather_params_gives_each_knob_of_the_slots_as_a_contiguous_row():
    """A step's knobs come from three gathers (one per dtype) instead of one per knob; each knob must still equal
    indexing that knob's slot row, and be contiguous (the draw kernel reads row b at offset b)."""
    g = torch.Generator().manual_seed(2)
    s = _state()
    s.assign_many([SlotAssignment(slot, torch.randn(2, 8, generator=g),
                                  SamplingParams(seed=slot, temperature=0.5 + slot / 10, top_k=slot + 1,
                                                 top_p=0.9 - slot / 20, subtalker_temperature=1.0 + slot / 10,
                                                 subtalker_top_k=slot + 20, subtalker_top_p=0.8,
                                                 do_sample=slot % 2 == 0, subtalker_do_sample=slot % 3 == 0,
                                                 repetition_penalty=1.0 + slot / 100, min_new_tokens=slot),
                                  100 + slot, slot == 5) for slot in range(6)])
    slots = torch.tensor([4, 1, 6, 1])  # a repeated slot and the scratch row, as a padded graph bucket has
    frame = torch.tensor([3, 4, 5, 6])
    got, every = _tensors(s), s.gather_params(slots, frame)
    assert torch.equal(every.frame, frame)
    for name, row in got.items():
        if name in ("frames", "seen", "trailing", "trailing_len"):
            continue
        head, _, field = name.rpartition(".")
        value = getattr(getattr(every, head), field) if head else getattr(every, field)
        assert value.is_contiguous() and torch.equal(value, row[slots]), name
    assert every.seed.tolist() == [104, 101, 0, 101] and every.min_new_tokens[0].item() == 4
    assert every.talker.do_sample.tolist() == [True, False, False, False]
