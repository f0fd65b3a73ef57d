"""The time-major streaming codec decoder equals the module decoder: whole utterances, any chunking, streams
joining and leaving mid-run, slots reused after a reset, and the full-size config (fp32, CPU path)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from codec_helpers import random_codes, randomize_codec_weights_, tiny_codec_decoder

from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.models.qwen3_tts.config import CodecDecoderConfig
from legato.models.qwen3_tts.streaming_codec import StreamingCodecDecoder

TOL = 1e-5
SPF = 1920


@pytest.fixture(scope="module")
def decoder() -> CodecDecoder:
    return tiny_codec_decoder(seed=5)


def _whole(decoder: CodecDecoder, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return decoder(codes)[:, 0]


def test_one_call_equals_the_whole_forward(decoder):
    codes = random_codes(3, 9, seed=1)
    fast = StreamingCodecDecoder(decoder, slots=4)
    slots = torch.tensor([2, 0, 3])
    fast.reset(slots)
    wav = fast.step(slots, codes)
    assert wav.dtype == torch.float32 and wav.shape == (3, 9 * SPF)
    assert (wav - _whole(decoder, codes)).abs().max() < TOL
    assert fast.bank.position[slots].tolist() == [9, 9, 9] and fast.bank.position[1] == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_chunkings_equal_the_whole_forward(decoder, seed):
    """Chunks of 1..40 frames (past the 72-frame attention window and the 32-frame call limit)."""
    rng = random.Random(seed)
    total = 150
    codes = random_codes(2, total, seed=10 + seed)
    fast = StreamingCodecDecoder(decoder, slots=3)
    slots = torch.tensor([1, 2])
    fast.reset(slots)
    pieces, at = [], 0
    while at < total:
        n = min(total - at, rng.choice([1, 1, 2, 3, 4, 7, 25, 40]))
        pieces.append(fast.step(slots, codes[:, at: at + n]))
        at += n
    assert (torch.cat(pieces, dim=1) - _whole(decoder, codes)).abs().max() < TOL


def test_streams_join_and_leave_mid_run_and_slots_are_reused(decoder):
    """Each step decodes one frame of every live stream in one call, whatever their positions; a finished
    stream's slot goes to a new stream after a reset (its old contents must not leak into the new one)."""
    rng = random.Random(4)
    fast = StreamingCodecDecoder(decoder, slots=4)
    plans = {f"s{i}": (random_codes(1, rng.randint(5, 90), seed=30 + i)[0], rng.randint(0, 40)) for i in range(6)}
    free, slot_of, fed, got = [0, 1, 2, 3], {}, {}, {rid: [] for rid in plans}
    for step in range(400):
        for rid, (_codes_of, join) in plans.items():
            if join <= step and rid not in slot_of and rid not in fed and free:
                slot_of[rid] = free.pop(0)
                fed[rid] = 0
                fast.reset(torch.tensor([slot_of[rid]]))
        live = [rid for rid in slot_of if fed[rid] < plans[rid][0].shape[0]]
        if live:
            codes = torch.stack([plans[r][0][fed[r]: fed[r] + 1] for r in live])
            wav = fast.step(torch.tensor([slot_of[r] for r in live]), codes)
            for r, w in zip(live, wav, strict=True):
                got[r].append(w)
                fed[r] += 1
        for rid in [r for r in slot_of if fed[r] == plans[r][0].shape[0]]:
            free.append(slot_of.pop(rid))
        if all(rid in fed and rid not in slot_of for rid in plans):
            break
    for rid, (codes, _join) in plans.items():
        want = _whole(decoder, codes[None])[0]
        assert (torch.cat(got[rid]) - want).abs().max() < TOL, rid


def test_a_slot_reset_ignores_what_the_slot_held(decoder):
    """Garbage (even NaN) left in a slot's histories and rings never reaches a stream started on it."""
    fast = StreamingCodecDecoder(decoder, slots=2)
    for buf in [*fast.bank.hist.values(), fast.bank.keys, fast.bank.values]:
        buf.fill_(float("nan"))
    fast.bank.position.fill_(1234)
    fast.bank.calls.fill_(7)
    slot = torch.tensor([1])
    fast.reset(slot)
    codes = random_codes(1, 80, seed=3)
    wav = torch.cat([fast.step(slot, codes[:, i: i + 8]) for i in range(0, 80, 8)], dim=1)
    assert torch.isfinite(wav).all() and (wav - _whole(decoder, codes)).abs().max() < TOL


def test_bad_codes_are_refused(decoder):
    fast = StreamingCodecDecoder(decoder, slots=2)
    with pytest.raises(ValueError, match="codes must be"):
        fast.step(torch.tensor([0]), torch.zeros(1, 3, 15, dtype=torch.long))
    with pytest.raises(ValueError, match="codes must be"):
        fast.step(torch.tensor([0, 1]), torch.zeros(1, 3, 16, dtype=torch.long))


def test_the_kernels_are_refused_off_cuda(decoder, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA device|Triton is not installed"):
        StreamingCodecDecoder(decoder, slots=2, kernels=True)


def test_resize_keeps_the_state(decoder):
    codes = random_codes(1, 20, seed=8)
    fast = StreamingCodecDecoder(decoder, slots=2)
    slot = torch.tensor([1])
    fast.reset(slot)
    first = fast.step(slot, codes[:, :11])
    fast.resize(5)
    assert fast.slots == 5
    rest = fast.step(slot, codes[:, 11:])
    assert (torch.cat([first, rest], dim=1) - _whole(decoder, codes)).abs().max() < TOL


@pytest.mark.skipif(not os.environ.get("LEGATO_SLOW_TESTS"), reason="slow: set LEGATO_SLOW_TESTS=1")
def test_full_size_stream_matches_whole_forward():
    """The released shapes (16 heads of 64, 8 layers, 1536 -> 96 channels), chunks of 1, 4 and 7 frames."""
    dec = randomize_codec_weights_(CodecDecoder(CodecDecoderConfig()).eval(), seed=2)
    codes = random_codes(2, 12, seed=9)
    fast = StreamingCodecDecoder(dec, slots=2)
    slots = torch.tensor([0, 1])
    fast.reset(slots)
    wav = torch.cat([fast.step(slots, codes[:, a:b]) for a, b in ((0, 1), (1, 5), (5, 12))], dim=1)
    assert (wav - _whole(dec, codes)).abs().max() < TOL
