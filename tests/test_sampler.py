"""Engine sampler: transformers-exact processors, greedy/sampled mixing, seen-mask bookkeeping, placement
invariance and the sampled distribution."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from legato.engine.sampler import HeadTensors, Sampler, SamplingTensors, draw, warp

V, EOS, SUPPRESS = 3072, 2150, (2048, 3072)
RESIDUAL_V = 2048
INF = float("inf")


def params(**overrides) -> SimpleNamespace:
    """Duck-typed request parameters with the official defaults."""
    base = dict(
        do_sample=True, temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05, min_new_tokens=2,
        max_new_tokens=4096, subtalker_do_sample=True, subtalker_temperature=0.9, subtalker_top_k=50,
        subtalker_top_p=1.0, seed=0,
    )
    base.update(overrides)
    return SimpleNamespace(**base)


def hf_processors(scores: torch.Tensor, ids: list[int], p: SimpleNamespace) -> torch.Tensor:
    """transformers' talker processors on one row [1, V] given the request's generated ids."""
    input_ids = torch.tensor([ids], dtype=torch.long).reshape(1, len(ids))
    scores = RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty))(input_ids, scores.clone())
    scores = MinNewTokensLengthLogitsProcessor(0, p.min_new_tokens, EOS)(input_ids, scores)
    suppressed = [i for i in range(*SUPPRESS) if i != EOS]
    return SuppressTokensLogitsProcessor(suppressed)(input_ids, scores)


def hf_warpers(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' warpers on one row [1, V], added exactly when generate would add them."""
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(float(temperature))(None, scores)
    if top_k != 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores


def heads(rows: list[tuple[float, int, float]], do_sample: bool = True) -> HeadTensors:
    return HeadTensors(
        do_sample=torch.full((len(rows),), do_sample),
        temperature=torch.tensor([r[0] for r in rows], dtype=torch.float32),
        top_k=torch.tensor([r[1] for r in rows], dtype=torch.int64),
        top_p=torch.tensor([r[2] for r in rows], dtype=torch.float32),
    )


def random_requests(n: int, gen: torch.Generator) -> tuple[list[SimpleNamespace], list[int]]:
    """Mixed greedy / sampled requests with varied parameters, seeds and frame counts."""
    choice = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=gen))]  # noqa: E731
    reqs, frames = [], []
    for _ in range(n):
        reqs.append(params(
            do_sample=choice([True, True, True, False]),
            temperature=choice([0.0, 0.5, 0.9, 1.0, 1.4]),
            top_k=choice([0, 1, 5, 50, V]),
            top_p=choice([1.0, 0.95, 0.8, 0.3]),
            repetition_penalty=choice([1.0, 1.05, 1.3]),
            min_new_tokens=choice([0, 2, 5]),
            subtalker_do_sample=choice([True, True, False]),
            subtalker_temperature=choice([0.6, 0.9, 1.2]),
            subtalker_top_k=choice([0, 3, 50]),
            subtalker_top_p=choice([1.0, 0.9, 0.5]),
            seed=int(torch.randint(0, 2**62, (1,), generator=gen)),
        ))
        frames.append(int(torch.randint(0, 8, (1,), generator=gen)))
    return reqs, frames


def test_processors_match_transformers():
    gen = torch.Generator().manual_seed(0)
    frames = [0, 1, 2, 5, 9, 30]
    reqs = [
        params(repetition_penalty=1.0, min_new_tokens=2),
        params(repetition_penalty=1.05, min_new_tokens=2),
        params(repetition_penalty=1.3, min_new_tokens=2),
        params(repetition_penalty=0.8, min_new_tokens=10),
        params(repetition_penalty=2.0, min_new_tokens=0),
        params(repetition_penalty=1.05, min_new_tokens=31),
    ]
    logits = torch.randn(len(reqs), V, generator=gen) * 4
    seen = torch.zeros(len(reqs), V, dtype=torch.bool)
    history = []
    for r, f in enumerate(frames):  # repeats in the history are intended: the penalty applies once per id
        ids = torch.randint(0, 2048, (f,), generator=gen).tolist() + ([EOS] if f > 20 else [])
        history.append(ids)
        seen[r, ids] = True
    st = SamplingTensors.from_params(reqs, [len(h) for h in history], "cpu")
    ours = Sampler(EOS, SUPPRESS).process_codebook0(logits, st, seen)
    for r, p in enumerate(reqs):
        assert torch.equal(ours[r : r + 1], hf_processors(logits[r : r + 1], history[r], p)), r


WARP_ROWS = [
    (0.9, 50, 1.0), (1.0, 0, 1.0), (0.7, 0, 0.8), (1.3, 10, 0.5), (0.5, 1, 1.0),
    (2.0, V, 0.95), (0.9, 5000, 0.3), (1.0, 0, 0.0), (0.9, 50, 0.9), (1.1, 200, 0.99),
]


@pytest.mark.parametrize("quantize", [False, True])
def test_warpers_match_transformers(quantize):
    logits = torch.randn(len(WARP_ROWS), V, generator=torch.Generator().manual_seed(1)) * 3
    logits[:, SUPPRESS[0]:] = -INF  # as after suppression: -inf entries must stay harmless
    if quantize:  # bf16 logits carry many exact ties, which top-k must keep like transformers
        logits = logits.bfloat16().float()
    ours = warp(logits, heads(WARP_ROWS))
    for r, (t, k, p) in enumerate(WARP_ROWS):
        if quantize and p < 1.0:
            continue  # ties straddling the top-p cut are kept whole on purpose; see test_top_p_keeps_ties
        assert torch.equal(ours[r : r + 1], hf_warpers(logits[r : r + 1], t, k, p)), WARP_ROWS[r]


def test_top_p_keeps_ties_at_the_cut():
    # p = softmax([3, 1, 1, 1, 0, 0, 0, 0]) ~ [.62, .084 x3, .031 x4]: top_p = 0.65 cuts inside the tied 1s.
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    ours = warp(logits, heads([(1.0, 0, 0.65)]))
    assert torch.isfinite(ours[0]).tolist() == [True] * 4 + [False] * 4
    hf = TopPLogitsWarper(0.65)(None, logits.clone())
    assert int(torch.isfinite(hf[0, 1:4]).sum()) == 1  # transformers keeps one of the three, by sort order


def test_greedy_rows_take_argmax_of_processed_logits():
    gen = torch.Generator().manual_seed(2)
    reqs = [
        params(do_sample=False, seed=1), params(do_sample=True, temperature=0.0, seed=2),
        params(do_sample=True, seed=3), params(do_sample=False, top_k=1, top_p=0.1, seed=4),
    ]
    logits = torch.randn(4, V, generator=gen) * 2
    logits[:, 2100] = 50.0  # a suppressed id that must not win even greedily
    seen = torch.zeros(4, V, dtype=torch.bool)
    top = logits[:, :2048].argmax(dim=-1)
    seen[torch.arange(4), top] = True  # the penalty may move the argmax: greedy must see it
    st = SamplingTensors.from_params(reqs, [3] * 4, "cpu")
    tokens = Sampler(EOS, SUPPRESS).sample_codebook0(logits, st, seen.clone())
    for r in (0, 1, 3):
        hf = hf_processors(logits[r : r + 1], [int(top[r])], reqs[r])
        assert int(tokens[r]) == int(hf.argmax())
    # Greedy rows ignore the seed.
    st.seed.add_(12345)
    assert torch.equal(Sampler(EOS, SUPPRESS).sample_codebook0(logits, st, seen.clone())[[0, 1, 3]], tokens[[0, 1, 3]])


def test_min_new_tokens_and_suppression():
    batch = 64
    logits = torch.zeros(batch, V)
    logits[:, EOS] = 100.0
    logits[:, SUPPRESS[0] : SUPPRESS[0] + 50] = 90.0
    frames = torch.arange(batch) % 4
    reqs = [params(seed=i, min_new_tokens=2, do_sample=i % 3 != 0, top_k=0) for i in range(batch)]
    st = SamplingTensors.from_params(reqs, frames, "cpu")
    tokens = Sampler(EOS, SUPPRESS).sample_codebook0(logits, st, torch.zeros(batch, V, dtype=torch.bool))
    early = frames < 2
    assert bool((tokens[early] < SUPPRESS[0]).all())
    assert bool((tokens[~early] == EOS).all())


def test_seen_mask_through_slots():
    gen = torch.Generator().manual_seed(3)
    reqs, frames = random_requests(3, gen)
    logits = torch.randn(3, V, generator=gen)
    seen = torch.rand(10, V, generator=gen) < 0.05
    slots = torch.tensor([7, 2, 9])
    sampler = Sampler(EOS, SUPPRESS)
    st = SamplingTensors.from_params(reqs, frames, "cpu")
    direct = seen[slots].clone()
    want = sampler.sample_codebook0(logits, st, direct)  # seen in batch order
    before = seen.clone()
    got = sampler.sample_codebook0(logits, st, seen, slots)
    assert torch.equal(got, want)
    assert torch.equal(seen[slots], direct)
    expected = before.clone()
    expected[slots, got] = True
    assert torch.equal(seen, expected)  # only the sampled ids of the batch's slots changed


def test_placement_invariance_across_batches():
    gen = torch.Generator().manual_seed(4)
    n = 24
    reqs, frames = random_requests(n, gen)
    c0_logits = torch.randn(n, V, generator=gen) * 3
    res_logits = torch.randn(n, RESIDUAL_V, generator=gen) * 3
    seen = torch.rand(n, V, generator=gen) < 0.02
    sampler = Sampler(EOS, SUPPRESS)

    def run(rows: list[int], fillers: int) -> tuple[dict[int, int], dict[int, int]]:
        """Sample `rows` among `fillers` unrelated requests in a shuffled batch; tokens per request row."""
        f_reqs, f_frames = random_requests(fillers, gen)
        all_reqs = [reqs[i] for i in rows] + f_reqs
        all_frames = [frames[i] for i in rows] + f_frames
        c0 = torch.cat([c0_logits[rows], torch.randn(fillers, V, generator=gen) * 3])
        res = torch.cat([res_logits[rows], torch.randn(fillers, RESIDUAL_V, generator=gen) * 3])
        # Fillers all write to one scratch slot, as a graph bucket's padding rows would.
        slots = torch.tensor(rows + [n] * fillers)
        order = torch.randperm(len(all_reqs), generator=gen)
        st = SamplingTensors.from_params([all_reqs[i] for i in order], [all_frames[i] for i in order], "cpu")
        buf = torch.cat([seen, torch.zeros(1, V, dtype=torch.bool)])
        t0 = sampler.sample_codebook0(c0[order], st, buf, slots[order])
        t5 = sampler.sample_residual(res[order], st, codebook=5)
        pos = {int(order[j]): j for j in range(len(order))}
        return ({r: int(t0[pos[i]]) for i, r in enumerate(rows)}, {r: int(t5[pos[i]]) for i, r in enumerate(rows)})

    ref0, ref5 = run(list(range(n)), 0)
    for size, fillers in [(1, 0), (5, 11), (13, 3), (24, 40)]:
        rows = torch.randperm(n, generator=gen)[:size].tolist()
        got0, got5 = run(rows, fillers)
        assert got0 == {r: ref0[r] for r in rows}
        assert got5 == {r: ref5[r] for r in rows}
    # The seeded rows really are random: codebook 0 and codebook 5 draws differ across requests.
    assert len(set(ref0.values())) > n // 2


def test_codebooks_and_frames_draw_independently():
    batch = 256
    reqs = [params(seed=1000 + i, top_k=0, temperature=1.0, subtalker_top_k=0, subtalker_temperature=1.0)
            for i in range(batch)]
    st = SamplingTensors.from_params(reqs, [3] * batch, "cpu")
    flat = torch.zeros(batch, RESIDUAL_V)  # uniform over 2048 ids: equal draws should be ~1/2048 rare
    sampler = Sampler(EOS, SUPPRESS)
    draws = [sampler.sample_residual(flat, st, cb) for cb in (1, 2, 15)]
    st.frame.add_(1)
    draws.append(sampler.sample_residual(flat, st, 1))
    seen = torch.zeros(batch, V, dtype=torch.bool)
    draws.append(sampler.sample_codebook0(torch.zeros(batch, V), st, seen))
    for i in range(len(draws)):
        for j in range(i):
            assert int((draws[i] == draws[j]).sum()) < 5, (i, j)


def chi_square_check(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    n = tokens.numel()
    live = probs > 0
    assert float(counts[~live].sum()) == 0.0, "a filtered token was drawn"
    expected = probs[live].double() * n
    chi2 = float(((counts[live] - expected) ** 2 / expected).sum())
    dof = int(live.sum()) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 0, 1.0), (1.0, 6, 1.0), (1.2, 0, 0.7), (0.9, 12, 0.9)])
def test_residual_draws_follow_softmax_of_warped_logits(temperature, top_k, top_p):
    vocab, draws = 40, 20000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)) * 1.5
    probs = hf_warpers(logits.clone(), temperature, top_k, top_p).softmax(dim=-1)[0]
    seed = torch.arange(draws, dtype=torch.int64) // 100 * 7919 + 11
    frame = torch.arange(draws, dtype=torch.int64) % 100
    w = HeadTensors(
        do_sample=torch.ones(draws, dtype=torch.bool), temperature=torch.full((draws,), temperature),
        top_k=torch.full((draws,), top_k), top_p=torch.full((draws,), top_p),
    )
    chi_square_check(draw(logits.expand(draws, vocab), w, seed, frame, 3), probs)


def test_codebook0_draws_follow_softmax_of_processed_logits():
    vocab, eos, draws = 40, 33, 20000
    sampler = Sampler(eos, (30, 40))
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(6)) * 1.5
    history = [0, 1, 2, 5]  # ids that the repetition penalty pushes down
    req = params(temperature=0.7, top_k=20, top_p=0.95, repetition_penalty=1.5, min_new_tokens=0)
    scores = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([history]), logits.clone())
    scores = SuppressTokensLogitsProcessor([i for i in range(30, 40) if i != eos])(None, scores)
    probs = hf_warpers(scores, 0.7, 20, 0.95).softmax(dim=-1)[0]
    reqs = [SimpleNamespace(**{**vars(req), "seed": i // 50}) for i in range(draws)]
    st = SamplingTensors.from_params(reqs, [i % 50 for i in range(draws)], "cpu")
    seen = torch.zeros(draws, vocab, dtype=torch.bool)
    seen[:, history] = True
    tokens = sampler.sample_codebook0(logits.expand(draws, vocab), st, seen)
    assert probs[eos] > 0 and probs[35] == 0
    chi_square_check(tokens, probs)


def test_from_params_copy_and_validation():
    reqs = [params(seed=2**63 - 1, top_k=7, subtalker_top_p=0.5), params(seed=0, do_sample=False)]
    st = SamplingTensors.from_params(reqs, [4, 0], "cpu")
    assert st.seed.tolist() == [2**63 - 1, 0] and st.frame.tolist() == [4, 0]
    assert st.talker.top_k.tolist() == [7, 50] and st.talker.do_sample.tolist() == [True, False]
    assert st.subtalker.top_p.tolist() == [0.5, 1.0] and st.repetition_penalty.dtype == torch.float32
    static = SamplingTensors.from_params([params(), params()], [0, 0], "cpu")
    static.copy_(st)
    assert torch.equal(static.seed, st.seed) and torch.equal(static.subtalker.top_p, st.subtalker.top_p)
    for bad in (dict(seed=None), dict(seed=-1), dict(top_p=1.5), dict(subtalker_top_k=-1), dict(temperature=-1.0)):
        with pytest.raises(ValueError):
            SamplingTensors.from_params([params(**bad)], [0], "cpu")
    with pytest.raises(ValueError):
        SamplingTensors.from_params(reqs, [0], "cpu")


def test_from_talker_config_matches_official_rules():
    from legato.models.qwen3_tts.config import TalkerConfig

    sampler = Sampler.from_talker_config(TalkerConfig())
    assert sampler.eos_token_id == EOS and sampler.suppress_range == SUPPRESS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture_and_batch_size_invariance():
    gen = torch.Generator().manual_seed(7)
    n = 64
    reqs, frames = random_requests(n, gen)
    c0 = (torch.randn(n, V, generator=gen) * 3).cuda()
    res = (torch.randn(n, RESIDUAL_V, generator=gen) * 3).cuda()
    sampler = Sampler(EOS, SUPPRESS)
    st = SamplingTensors.from_params(reqs, frames, "cuda")
    seen = torch.zeros(n, V, dtype=torch.bool, device="cuda")
    eager0 = sampler.sample_codebook0(c0, st, seen.clone())
    eager5 = sampler.sample_residual(res, st, 5)
    for i in range(n):  # one row alone (B=1 takes other kernel paths) gives the batch's tokens
        one = SamplingTensors.from_params([reqs[i]], [frames[i]], "cuda")
        assert int(sampler.sample_codebook0(c0[i : i + 1], one, seen[i : i + 1].clone())) == int(eager0[i])
        assert int(sampler.sample_residual(res[i : i + 1], one, 5)) == int(eager5[i])
    static_seen = seen.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the default stream before capture
        sampler.sample_codebook0(c0, st, static_seen.clone())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out0 = sampler.sample_codebook0(c0, st, static_seen)
        out5 = sampler.sample_residual(res, st, 5)
    static_seen.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out0, eager0) and torch.equal(out5, eager5)
    assert bool(static_seen[torch.arange(n, device="cuda"), out0].all())


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_sampler_gives_eager_tokens():
    gen = torch.Generator().manual_seed(8)
    n = 48
    reqs, frames = random_requests(n, gen)
    c0 = (torch.randn(n, V, generator=gen) * 3).cuda()
    res = (torch.randn(n, RESIDUAL_V, generator=gen) * 3).cuda()
    seen = torch.rand(n, V, generator=gen).cuda() < 0.02
    eager, fused = Sampler(EOS, SUPPRESS), Sampler(EOS, SUPPRESS, compile=True)
    for rows in (list(range(n)), [5], [3, 1, 4]):  # dynamic batch: no recompiles, same tokens
        st = SamplingTensors.from_params([reqs[i] for i in rows], [frames[i] for i in rows], "cuda")
        want0 = eager.sample_codebook0(c0[rows], st, seen[rows].clone())
        assert torch.equal(fused.sample_codebook0(c0[rows], st, seen[rows].clone()), want0)
        for cb in (1, 15):
            assert torch.equal(fused.sample_residual(res[rows], st, cb), eager.sample_residual(res[rows], st, cb))
