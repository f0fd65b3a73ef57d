"""Streaming codec decode: any chunking of an utterance reproduces the whole-utterance waveform."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from codec_helpers import random_codes, randomize_codec_weights_, tiny_codec_decoder

from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.models.qwen3_tts.codec_streaming import ChunkSchedule, CodecStreamState, decode_chunks
from legato.models.qwen3_tts.config import CodecDecoderConfig

TOL = 1e-5
SPF = 1920


@pytest.fixture(scope="module")
def decoder() -> CodecDecoder:
    return tiny_codec_decoder(seed=3)


def _whole(decoder: CodecDecoder, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return decoder(codes)


def _stream(decoder: CodecDecoder, codes: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    state = decoder.new_stream_state(codes.shape[0])
    pieces, start = [], 0
    for n in schedule:
        wav, state = decoder.stream_step(codes[:, start : start + n], state)
        assert wav.shape == (codes.shape[0], 1, n * SPF)
        pieces.append(wav)
        start += n
    assert start == codes.shape[1]
    assert state.position.tolist() == [start] * codes.shape[0]
    return torch.cat(pieces, dim=-1)


def test_chunk_schedule():
    assert ChunkSchedule().split(60) == [1, 4, 25, 25, 5]
    assert ChunkSchedule(first=4, ramp=(), steady=10).split(25) == [4, 10, 10, 1]
    assert ChunkSchedule().split(0) == []
    with pytest.raises(ValueError):
        ChunkSchedule(first=0)


@pytest.mark.parametrize("frames", [1, 5, 30, 73, 150])
def test_engine_schedule_matches_whole_forward(decoder, frames):
    """First chunk 1 frame, then 4, then 25 at a time."""
    codes = random_codes(2, frames, seed=frames)
    want = _whole(decoder, codes)
    assert want.std() > 0.01
    got = _stream(decoder, codes, ChunkSchedule(first=1, ramp=(4,), steady=25).split(frames))
    assert (got - want).abs().max().item() < TOL


def test_random_schedules_match_whole_forward(decoder):
    rng = random.Random(0)
    for trial in range(3):
        frames = rng.randint(1, 150)
        codes = random_codes(2, frames, seed=100 + trial)
        schedule, left = [], frames
        while left:
            schedule.append(min(left, rng.randint(1, 40)))
            left -= schedule[-1]
        got = _stream(decoder, codes, schedule)
        assert (got - _whole(decoder, codes)).abs().max().item() < TOL, (frames, schedule)


def test_stream_is_exact_in_float64(decoder):
    """In fp64 the streamed and whole waveforms agree to rounding: the streaming is exact, not approximate."""
    dec64 = copy.deepcopy(decoder).double()
    codes = random_codes(1, 100, seed=9)
    got = _stream(dec64, codes, [1, 4, 25, 3, 67])
    assert got.dtype == torch.float64
    assert (got - _whole(dec64, codes)).abs().max().item() < 1e-11


def test_batch_with_unequal_chunks_and_histories(decoder):
    """Three requests joining at different steps, with unequal (and empty) chunks, in one batched step each."""
    rng = random.Random(1)
    totals = [40, 97, 150]
    joins = [0, 2, 5]  # step at which each request sends its first chunk
    codes = [random_codes(1, t, seed=200 + i)[0] for i, t in enumerate(totals)]
    states = [decoder.new_stream_state() for _ in totals]
    done = [0, 0, 0]
    pieces: list[list[torch.Tensor]] = [[], [], []]
    step = 0
    while done != totals:
        chunks = []
        for i in range(3):
            first = done[i] == 0
            n = 0 if step < joins[i] else (1 if first else rng.choice([0, 3, 4, 11, 25]))
            n = min(n, totals[i] - done[i])
            chunks.append(codes[i][done[i] : done[i] + n])
        wavs, states = decode_chunks(decoder, chunks, states)
        for i in range(3):
            assert wavs[i].shape == (chunks[i].shape[0] * SPF,)
            pieces[i].append(wavs[i])
            done[i] += chunks[i].shape[0]
        step += 1
    for i in range(3):
        want = _whole(decoder, codes[i][None])[0, 0]
        assert (torch.cat(pieces[i]) - want).abs().max().item() < TOL, i
        assert states[i].position.item() == totals[i]


def test_padding_never_reaches_the_state(decoder):
    """The frames past a request's `lengths` may hold any codes: outputs and state are unaffected."""
    history = random_codes(2, 9, seed=11)
    _, state = decoder.stream_step(history, decoder.new_stream_state(2))
    chunk = random_codes(2, 6, seed=12)
    other = chunk.clone()
    other[1, 2:] = random_codes(1, 4, seed=13)[0]
    lengths = torch.tensor([6, 2])
    wav_a, state_a = decoder.stream_step(chunk, state, lengths)
    wav_b, state_b = decoder.stream_step(other, state, lengths)
    assert torch.equal(wav_a[1, :, : 2 * SPF], wav_b[1, :, : 2 * SPF])
    assert state_a.position.tolist() == [15, 11]
    for key, buf in state_a.buffers.items():
        assert torch.equal(buf, state_b.buffers[key]), key
    # And the short request's state equals decoding just its 2 valid frames.
    _, alone = decoder.stream_step(chunk[1:, :2], state.select([1]))
    for key, buf in alone.buffers.items():
        assert (buf[0] - state_a.buffers[key][1]).abs().max().item() < TOL, key


def test_requests_are_independent_and_state_resets(decoder):
    codes_a = random_codes(1, 30, seed=21)
    codes_b = random_codes(1, 30, seed=22)
    want_a = _whole(decoder, codes_a)
    # B has a history of 17 frames, A none; then both decode together.
    _, state_b = decoder.stream_step(codes_b[:, :17], decoder.new_stream_state())
    joint = CodecStreamState.cat([decoder.new_stream_state(), state_b])
    before = {k: v.clone() for k, v in joint.buffers.items()}
    wav, state = decoder.stream_step(torch.cat([codes_a[:, :13], codes_b[:, 17:]]), joint)
    assert all(torch.equal(v, before[k]) for k, v in joint.buffers.items())  # the input state is not modified
    assert state.position.tolist() == [13, 30]
    assert (wav[0] - want_a[0, :, : 13 * SPF]).abs().max().item() < TOL
    assert (wav[1] - _whole(decoder, codes_b)[0, :, 17 * SPF :]).abs().max().item() < TOL
    # A continues alone (select), B's slot is recycled with a fresh state for a new utterance.
    state_a = state.select([0])
    rest, _ = decoder.stream_step(codes_a[:, 13:], state_a)
    assert (rest[0] - want_a[0, :, 13 * SPF :]).abs().max().item() < TOL
    fresh = _stream(decoder, codes_b[:, :5], [1, 4])
    assert (fresh - _whole(decoder, codes_b[:, :5])).abs().max().item() < TOL


def test_state_layout(decoder):
    cfg = decoder.config
    state = decoder.new_stream_state(3)
    assert decoder.samples_per_frame == SPF
    assert state.batch_size == 3 and state.position.tolist() == [0, 0, 0]
    shapes = {k: tuple(v.shape) for k, v in state.buffers.items()}
    window_kv = (3, cfg.num_key_value_heads, cfg.sliding_window - 1, cfg.head_dim)
    assert shapes["pre_conv.tail"] == (3, cfg.codebook_dim, 2)
    assert shapes["pre_transformer.layers.0.self_attn.k"] == window_kv
    assert shapes["upsample.0.1.dwconv.tail"] == (3, cfg.latent_dim, 6)
    assert "upsample.0.0.overhang" not in shapes  # kernel == stride: nothing overhangs
    assert shapes["decoder.1.block.1.overhang"] == (3, cfg.decoder_dim // 2, cfg.upsample_rates[0])
    assert shapes["decoder.1.block.4.conv1.tail"] == (3, cfg.decoder_dim // 2, 6 * 9)
    assert "decoder.1.block.4.conv2.tail" not in shapes  # k=1 needs no context
    parts = state.split()
    assert len(parts) == 3 and all(p.batch_size == 1 for p in parts)
    again = CodecStreamState.cat(parts)
    assert all(torch.equal(again.buffers[k], v) for k, v in state.buffers.items())


@pytest.mark.slow
def test_full_size_stream_matches_whole_forward():
    dec = randomize_codec_weights_(CodecDecoder(CodecDecoderConfig()).eval(), seed=4)
    codes = random_codes(1, 3, seed=31)
    want = _whole(dec, codes)
    assert want.std() > 0.01
    got = _stream(dec, codes, [1, 2])
    assert (got - want).abs().max().item() < TOL


def test_the_engine_chunk_schedule_ramps_to_the_steady_size():
    from legato.engine.codec_streamer import next_chunk_frames

    def sizes(first, steady, ramp, frames=80):
        out, emitted = [], 0
        while emitted < frames:
            out.append(next_chunk_frames(emitted, first, steady, ramp))
            emitted += out[-1]
        return out

    assert sizes(1, 25, True)[:8] == [1, 1, 2, 4, 8, 16, 25, 25]  # each chunk = the audio already sent
    assert sizes(3, 25, True)[:6] == [3, 3, 6, 12, 24, 25]
    assert sizes(1, 25, False)[:3] == [1, 25, 25]
    assert sizes(30, 25, True)[:3] == [30, 25, 25]  # a first chunk above the steady size is kept


def _stream_through_streamer(decoder, schedule, codes: torch.Tensor, ref: torch.Tensor | None, bursts: list[int]):
    """Pushes `codes` [T, 16] into a CodecStreamer in bursts (flushing after each), then finishes it."""
    from legato.engine.codec_streamer import CodecStreamer

    streamer = CodecStreamer(decoder, schedule)
    streamer.open("r", ref)
    pieces, done = [], 0
    for n in bursts:
        for frame in codes[done : done + n]:
            streamer.push("r", frame)
        done += n
        audio, failed = streamer.flush(set())
        assert not failed
        if "r" in audio:
            pieces.append(audio["r"])
    assert done == codes.shape[0]
    audio, failed = streamer.flush({"r"})
    assert not failed and "r" not in streamer.streams
    pieces.append(audio.get("r", np.zeros(0, np.float32)))
    return np.concatenate(pieces)


@pytest.mark.parametrize(("window", "context", "ref_frames"), [(20, 5, 0), (20, 5, 7), (16, 0, 3), (30, 29, 11)])
def test_streamer_follows_the_windowed_decode(decoder, window, context, ref_frames):
    """Streamed in chunks (1, then ramped, with bursts of frames arriving at once), a long utterance equals
    `CodecDecoder.decode` with the same windows, reference frames of an in-context clone counted in."""
    from legato.engine.codec_streamer import StreamSchedule

    rng = random.Random(window + context + ref_frames)
    total = 3 * window + 7
    codes = random_codes(1, ref_frames + total, seed=40 + ref_frames)[0]
    ref, gen = (codes[:ref_frames], codes[ref_frames:]) if ref_frames else (None, codes)
    want = decoder.decode(codes[None], chunk_size=window, left_context=context)[0][ref_frames * SPF :].numpy()
    bursts, left = [], total
    while left:
        bursts.append(min(left, rng.choice([1, 1, 2, 5, 9])))
        left -= bursts[-1]
    schedule = StreamSchedule(first_chunk_frames=1, chunk_frames=6, chunk_ramp=True, window_frames=window,
                              window_context=context)
    got = _stream_through_streamer(decoder, schedule, gen, ref, bursts)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < TOL
    # Full-context streaming is the whole-utterance forward instead, which differs past the first window.
    full = StreamSchedule(first_chunk_frames=1, chunk_frames=6, window_frames=None)
    whole = _whole(decoder, codes[None])[0, 0, ref_frames * SPF :].numpy()
    assert np.abs(_stream_through_streamer(decoder, full, gen, ref, bursts) - whole).max() < TOL
    assert np.abs(whole - want).max() > 1e-3


def test_stream_schedule_refuses_bad_windows():
    from legato.engine.codec_streamer import StreamSchedule

    for window, context in ((10, 10), (10, -1)):
        with pytest.raises(ValueError, match="window"):
            StreamSchedule(window_frames=window, window_context=context)
    with pytest.raises(ValueError, match="chunk sizes"):
        StreamSchedule(first_chunk_frames=0)


def test_the_state_bank_serves_streams_that_come_and_go(decoder):
    """Streams open, prime (several clones sharing a reference length, batched), decode in batches of
    equal chunks, finish and hand their rows to new streams, and the bank grows past its capacity; each
    stream's audio equals its own whole decode within 1e-5."""
    from legato.engine.codec_streamer import CodecStreamer, StreamSchedule

    rng = random.Random(7)
    streamer = CodecStreamer(decoder, StreamSchedule(first_chunk_frames=1, chunk_frames=5, chunk_ramp=True,
                                                     window_frames=None), capacity=2)
    shared_ref = random_codes(1, 6, seed=50)[0]
    plans = {}
    for i in range(7):
        ref = shared_ref if i % 3 == 0 else (random_codes(1, 4, seed=60 + i)[0] if i % 3 == 1 else None)
        plans[f"s{i}"] = (ref, random_codes(1, rng.randint(3, 23), seed=70 + i)[0], i // 2)  # joins at step i // 2
    got = {rid: [] for rid in plans}
    done, step, fed = set(), 0, {rid: 0 for rid in plans}
    while len(done) < len(plans):
        for rid, (ref, _codes_of, join) in plans.items():
            if join == step:
                streamer.open(rid, ref)
        for rid, (_ref, codes, join) in plans.items():
            if join <= step and rid not in done:
                for _ in range(rng.choice([0, 1, 1, 2, 3])):
                    if fed[rid] < codes.shape[0]:
                        streamer.push(rid, codes[fed[rid]])
                        fed[rid] += 1
        ending = {rid for rid, (_r, codes, join) in plans.items()
                  if join <= step and rid not in done and fed[rid] == codes.shape[0] and rng.random() < 0.5}
        audio, failed = streamer.flush(ending)
        assert not failed
        for rid, pcm in audio.items():
            got[rid].append(pcm)
        done |= ending
        step += 1
        assert step < 200
    assert streamer.capacity >= 4 and not streamer.streams
    assert len(streamer._free_slots) == streamer.codec.slots - 1  # every slot is free again but the scratch slot
    for rid, (ref, codes, _join) in plans.items():
        full = codes if ref is None else torch.cat([ref, codes])
        want = _whole(decoder, full[None])[0, 0, (0 if ref is None else ref.shape[0]) * SPF :].numpy()
        pcm = np.concatenate(got[rid])
        assert pcm.shape == want.shape and np.abs(pcm - want).max() < TOL, rid


def test_codec_graph_lookup_buckets_streams_and_splits_lengths():
    """Which captured graph a decode of b streams x n frames replays: the smallest stream-count bucket that
    holds b; a tail may replay a longer chunk (padded); a length no graph has splits into graph sizes."""
    from legato.engine.codec_graphs import CodecGraphs

    graphs = CodecGraphs()
    assert not graphs and graphs.max_batch == 0 and graphs.exact(1, 1) is None and graphs.pieces(1, 3) == []
    graphs.graphs = {(b, n): (b, n) for b in (1, 2, 4) for n in (1, 4, 8)}
    assert graphs.max_batch == 4
    assert graphs.exact(3, 4) == (4, 4) and graphs.exact(1, 2) is None and graphs.exact(5, 1) is None
    assert graphs.longer(2, 4) == (2, 8) and graphs.longer(2, 8) is None
    assert graphs.pieces(3, 21) == [8, 8, 4, 1] and sum(graphs.pieces(1, 7)) == 7
    graphs.graphs = {(1, 4): (1, 4)}
    assert graphs.pieces(1, 8) == []  # without a one-frame graph not every length splits
