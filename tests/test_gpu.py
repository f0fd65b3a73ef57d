"""CUDA paths (Triton kernels, CUDA-graph decode) against their CPU/eager twins. Skipped without a GPU;
the CPU paths of the same code run in test_engine.py and test_paged_attention.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import engine_config, run_all, tiny_model

from legato.engine.codec_schedule import StreamSchedule, next_chunk_frames
from legato.engine.engine import Engine, EngineRequest
from legato.engine.mtp_replicas import group_buckets
from legato.layers.paged_attention import decode_attention, decode_attention_reference
from legato.layers.snake import snake_beta, snake_beta_reference
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.loader import load_model
from legato.models.qwen3_tts.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU twins run elsewhere)"),
]


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(16, 8, 128), (4, 2, 16), (8, 8, 64)])
def test_triton_decode_attention_matches_reference(dtype, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    blocks, block_size, bsz = 64, 16, 5
    kc = torch.randn(blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    tables = torch.randperm(blocks, device="cuda")[: bsz * 8].view(bsz, 8).to(torch.int32)
    lens = torch.tensor([1, 16, 17, 100, 128], device="cuda", dtype=torch.int32)
    q = torch.randn(bsz, heads, head_dim, device="cuda", dtype=dtype)
    got = decode_attention(q, kc, vc, tables, lens, head_dim**-0.5)
    ref = decode_attention_reference(q, kc, vc, tables, lens, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - ref.float()).abs().max() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(16, 8, 128), (4, 2, 16)])
def test_triton_packed_prefill_matches_reference(dtype, heads, kv_heads, head_dim):
    from legato.layers.packed_prefill import PackedPrefill, packed_prefill_attention, packed_prefill_reference

    torch.manual_seed(0)
    blocks, block_size = 128, 16
    kc = torch.randn(blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    lengths, starts = [5, 131, 1, 64, 200], [0, 10, 129, 16, 0]
    perm = torch.randperm(blocks - 1).tolist()
    tables = [[perm.pop() for _ in range(-(-(s + m) // block_size))] for s, m in zip(starts, lengths, strict=True)]
    meta = PackedPrefill.build(lengths, starts, tables, block_size, blocks - 1, torch.device("cuda"))
    q = torch.randn(sum(lengths), heads, head_dim, device="cuda", dtype=dtype)
    got = packed_prefill_attention(q, kc, vc, meta, head_dim**-0.5)
    ref = packed_prefill_reference(q.float(), kc.float(), vc.float(), meta, head_dim**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert (got.float() - ref).abs().max() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_snake_matches_reference(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 96, 5000, device="cuda", dtype=dtype)
    a, b = torch.randn(96, device="cuda", dtype=dtype), torch.randn(96, device="cuda", dtype=dtype)
    # sin² is scaled by 1/e^beta (up to ~20 here), so the tolerance is relative to that gain.
    gain = float((1.0 / b.float().exp()).max())
    tol = (5e-6 if dtype == torch.float32 else 1e-2) * max(gain, 1.0)
    err = (snake_beta(x, a, b).float() - snake_beta_reference(x.float(), a.float(), b.float())).abs().max()
    assert err < tol, (float(err), tol)


def test_a_voice_encoded_on_a_side_stream_thread_equals_one_on_the_default_stream(tmp_path):
    """The voice encoder's thread (`side_stream_thread`) runs on a stream of its own, so its encodes do not queue
    behind the engine's steps on the default stream; what it encodes is the same voice."""
    from concurrent.futures import ThreadPoolExecutor

    from legato.models.qwen3_tts.inputs import extract_voice
    from legato.pipeline.threads import side_stream_thread

    lm = load_model(tiny_model(tmp_path, "base").path, device="cuda")
    clip = np.random.default_rng(3).standard_normal(24000).astype(np.float32) * 0.1
    want = extract_voice(lm, clip, 24000)
    with ThreadPoolExecutor(1, initializer=side_stream_thread, initargs=(torch.device("cuda"),)) as pool:
        default = torch.cuda.default_stream()
        assert pool.submit(lambda: torch.cuda.current_stream() != default).result(timeout=60)
        got = pool.submit(extract_voice, lm, clip, 24000).result(timeout=60)
    assert torch.equal(got.speaker_embedding, want.speaker_embedding)
    assert torch.equal(got.ref_code, want.ref_code)


def test_the_encoders_matrix_product_convs_equal_cudnn_on_cuda(tmp_path):
    """The CUDA default of both voice encoders (convolutions as matrix products: no cuDNN plan per clip length)
    against cuDNN, TF32 off: the speaker embedding to fp32 rounding, the codec encoder's codes equal."""
    from legato.models.qwen3_tts.mimi_layers import CausalStridedConv
    from legato.models.qwen3_tts.speaker_encoder import SameConv

    lm = load_model(tiny_model(tmp_path, "base").path, device="cuda")
    speaker, codec = lm.model.speaker_encoder, lm.speech_tokenizer.encoder
    wav = torch.from_numpy(np.random.default_rng(5).standard_normal(24000 + 777).astype(np.float32) * 0.1).cuda()

    def both(kind, run):
        convs = [m for m in (speaker if kind is SameConv else codec).modules() if isinstance(m, kind)]
        assert convs and all(m.gemm is None for m in convs)
        try:
            got = run()
            for m in convs:
                m.gemm = False
            want = run()
        finally:
            for m in convs:
                m.gemm = None
        return got, want

    with torch.inference_mode():
        got, want = both(SameConv, lambda: speaker.embed(wav))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        (got_lat, got_codes), (want_lat, want_codes) = both(
            CausalStridedConv, lambda: (codec.latents(wav[None]), codec.encode(wav)))
    torch.testing.assert_close(got_lat, want_lat, rtol=1e-4, atol=1e-4)
    assert torch.equal(got_codes, want_codes)


def test_graph_decode_equals_cpu_engine(tmp_path):
    """fp32 with TF32 off: the CUDA-graph engine on the GPU gives the CPU engine's codes for seeded requests."""
    cpu = tiny_model(tmp_path, "base")
    gpu = load_model(cpu.path, device="cuda")
    emb = torch.randn(64, generator=torch.Generator().manual_seed(0))

    def reqs(lm):
        spec = build_spec(lm, SpeechInput("Hello there, how are you?", language="english",
                                          speaker_embedding=emb, x_vector_only=True))
        return [EngineRequest(f"g{i}", spec, SamplingParams(seed=i, max_new_tokens=12)) for i in range(6)]

    want = run_all(Engine(cpu, engine_config()), reqs(cpu))
    got = run_all(Engine(gpu, engine_config(device="cuda", cuda_graph_max_batch=8)), reqs(gpu))
    eager = run_all(Engine(gpu, engine_config(device="cuda", enforce_eager=True)), reqs(gpu))
    for i in range(6):
        assert torch.equal(got.frames(f"g{i}"), eager.frames(f"g{i}"))
        assert torch.equal(got.frames(f"g{i}"), want.frames(f"g{i}"))


def test_mtp_replicas_on_cuda_match_one_group(tmp_path):
    """mtp_replicas=2 on CUDA (one stream, graph pool and bucket set per group; groups of 4 rows replayed as
    a 3-row and a padded 1-row chunk) gives the codes of K=1 with graphs, of K=2 eager and of the CPU engine,
    with requests of different lengths leaving and two joining mid-run."""
    cpu = tiny_model(tmp_path, "base")
    gpu = load_model(cpu.path, device="cuda")
    emb = torch.randn(64, generator=torch.Generator().manual_seed(1))

    def run(lm, **kw):
        spec = build_spec(lm, SpeechInput("Hello there, how are you?", language="english",
                                          speaker_embedding=emb, x_vector_only=True))
        reqs = [EngineRequest(f"g{i}", spec, SamplingParams(seed=i, max_new_tokens=8 + 2 * i)) for i in range(8)]
        reqs[5].sampling = SamplingParams(do_sample=False, subtalker_do_sample=False, max_new_tokens=14)
        engine = Engine(lm, engine_config(**kw))
        return engine, run_all(engine, reqs[:6], join_at={5: reqs[6:]})

    _, want = run(cpu)
    _, one = run(gpu, device="cuda", cuda_graph_max_batch=6)
    engine, two = run(gpu, device="cuda", cuda_graph_max_batch=6, mtp_replicas=2)
    _, eager = run(gpu, device="cuda", enforce_eager=True, mtp_replicas=2)
    reps = engine.runner.replicas
    assert all(r.stream is not None and sorted(r.graphs) == sorted(group_buckets(6, 2)) for r in reps)
    assert all(rows > 0 for rows in engine.runner.replica_rows)
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    print(f"graph memory reserved: K=2 {engine.runner.graph_bytes / 2**20:.1f} MiB")
    for i in range(8):
        rid = f"g{i}"
        assert torch.equal(two.frames(rid), one.frames(rid)), rid
        assert torch.equal(two.frames(rid), eager.frames(rid)), rid
        assert torch.equal(two.frames(rid), want.frames(rid)), rid


def test_batch_invariant_codes_do_not_depend_on_the_batch():
    """The 0.6B config in bf16 (random weights), where GEMM tilings and split reductions change with the
    batch shape: with `batch_invariant`, each seeded request gives the same codes alone and in a batch of
    12 that grows and shrinks (rows padded to chunks of 8, graphs of that one size). H200 probe of the same
    property across topologies: docs/benchmarks.md."""
    from legato.models.qwen3_tts.config import SpeechTokenizerConfig, preset
    from legato.models.qwen3_tts.testing import random_model

    lm = random_model(preset("0.6B", "base"), SpeechTokenizerConfig(), device="cuda", dtype=torch.bfloat16)
    hidden = lm.config.talker_config.hidden_size
    emb = torch.randn(hidden, generator=torch.Generator().manual_seed(2))
    spec = build_spec(lm, SpeechInput("Please call Stella and ask her to bring these things.", language="english",
                                      speaker_embedding=emb, x_vector_only=True))

    def reqs():
        return [EngineRequest(f"b{i}", spec, SamplingParams(seed=i, max_new_tokens=10 + 3 * (i % 4)),
                              ignore_eos=True, stream_audio=False) for i in range(12)]

    engine = Engine(lm, engine_config(device="cuda", dtype="bfloat16", max_num_seqs=16, num_kv_blocks=512,
                                      batch_invariant=True, invariant_rows=8))
    assert sorted(engine.runner.replicas[0].graphs) == [8]
    alone = {}
    for r in reqs():
        alone[r.request_id] = run_all(engine, [r]).frames(r.request_id)
    batch = reqs()
    together = run_all(engine, batch[:9], join_at={4: batch[9:]})
    for r in batch:
        assert torch.equal(together.frames(r.request_id), alone[r.request_id]), r.request_id
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def _random_0_6b_and_requests():
    """The 0.6B config in bf16 with random weights, and `reqs(tag)`: nine seeded x-vector requests of fixed lengths
    (12 to 20 frames) over three prompts."""
    from legato.models.qwen3_tts.config import SpeechTokenizerConfig, preset
    from legato.models.qwen3_tts.testing import random_model

    lm = random_model(preset("0.6B", "base"), SpeechTokenizerConfig(), device="cuda", dtype=torch.bfloat16)
    hidden = lm.config.talker_config.hidden_size
    g = torch.Generator().manual_seed(3)
    specs = [build_spec(lm, SpeechInput(t, language="english", speaker_embedding=torch.randn(hidden, generator=g),
                                        x_vector_only=True))
             for t in ("Hello there, how are you?", "Short.", "A somewhat longer sentence to speak, with commas.")]

    def reqs(tag):
        return [EngineRequest(f"{tag}{i}", specs[i % 3], SamplingParams(seed=i, max_new_tokens=30), max_frames=12 + i,
                              ignore_eos=True, stream_audio=False) for i in range(9)]

    return lm, reqs


def test_programmatic_dependent_launch_gives_the_same_codes_on_the_0_6b_config():
    """PDL (layers/pdl.py) changes when a kernel starts, never what it computes: the engine's CUDA-graph decode
    gives the same codes bit for bit with it as without, requests joining mid-run, the stack off and on."""
    from legato.layers import pdl

    lm, reqs = _random_0_6b_and_requests()

    def run(on, **kw):
        old, pdl.ENABLED = pdl.ENABLED, on
        try:
            r = reqs("p")
            engine = Engine(lm, engine_config(device="cuda", dtype="bfloat16", num_kv_blocks=512, **kw))
            return run_all(engine, r[:6], join_at={3: r[6:]})
        finally:
            pdl.ENABLED = old

    for kw in ({}, {"code_predictor_stack": True}):
        off, on = run(False, **kw), run(True, **kw)
        for i in range(9):
            assert torch.equal(off.frames(f"p{i}"), on.frames(f"p{i}")), (kw, i)
            assert on.frames(f"p{i}").shape[0] == 12 + i


def test_async_loop_equals_sync_loop_on_the_0_6b_config():
    """The 0.6B config in bf16 (random weights): with fixed lengths both loops run the same batches, so the
    asynchronous loop (results read one step late) gives the synchronous loop's codes bit for bit, with
    requests joining mid-run; and the packed prefill of many prompts gives each prompt's codes alone."""
    lm, reqs = _random_0_6b_and_requests()

    def run(**kw):
        r = reqs("a")
        engine = Engine(lm, engine_config(device="cuda", dtype="bfloat16", num_kv_blocks=512, **kw))
        return run_all(engine, r[:6], join_at={3: r[6:]})

    sync, asyn = run(async_scheduling=False), run(async_scheduling=True)
    for i in range(9):
        assert torch.equal(sync.frames(f"a{i}"), asyn.frames(f"a{i}")), i
        assert sync.frames(f"a{i}").shape[0] == 12 + i
    # With the one-launch code predictor (the last request runs its last 11 frames alone, one-row passes): the
    # same. On the H200 (8d8f8b0, 2026-12-04) the first half passed and this half failed: the second engine's
    # first six requests all ended with the stack's give-up error before any of them ran a one-row pass. The
    # give-up count read barriers first made inside a graph capture (their zeroing captured, not run); b9b44f8
    # makes them rows of a pool zeroed before any capture and starts each engine's count from the device's.
    sync, asyn = run(async_scheduling=False, code_predictor_stack=True), run(async_scheduling=True,
                                                                            code_predictor_stack=True)
    for i in range(9):
        assert torch.equal(sync.frames(f"a{i}"), asyn.frames(f"a{i}")), ("stack", i)


def test_codec_graphs_give_the_eager_codec_audio(tmp_path):
    """The codec's CUDA graphs (per row count and frames, the state in place in its slots) give the audio of
    the eager codec, float32, with the chunk ramp and in-context priming; decoding every step
    gives the chunks and audio of decoding each chunk when due."""
    cpu = tiny_model(tmp_path, "base")
    gpu = load_model(cpu.path, device="cuda")
    g = torch.Generator().manual_seed(2)
    emb, ref = torch.randn(64, generator=g), torch.randint(0, 2048, (9, 16), generator=g)
    specs = [build_spec(gpu, SpeechInput("Hello there, how are you?", speaker_embedding=emb, x_vector_only=True)),
             build_spec(gpu, SpeechInput("Another one.", speaker_embedding=emb, ref_code=ref, ref_text="Ref."))]

    def run(**kw):
        reqs = [EngineRequest(f"c{i}", specs[i % 2], SamplingParams(seed=i, max_new_tokens=40), max_frames=30,
                              ignore_eos=True) for i in range(5)]
        engine = Engine(gpu, engine_config(device="cuda", chunk_ramp=True, chunk_frames=8, codec_dtype="float32", **kw))
        return engine, run_all(engine, reqs)

    engine, graphs = run()
    assert engine.codec.graphs, "the codec captured no graphs"
    _, eager = run(enforce_eager=True)
    _, chunked = run(codec_decode_every_step=False)  # each chunk decoded when due, as graphs
    schedule = StreamSchedule.of(engine.config)
    for i in range(5):
        rid = f"c{i}"
        assert torch.equal(graphs.frames(rid), eager.frames(rid))
        assert abs(graphs.pcm(rid) - eager.pcm(rid)).max() < 1e-5, rid
        # Both ways cut the audio where the schedule does; audio that comes back within one step goes out
        # together, so which cuts show depends on timing (a stream's last chunks, or two decodes when due).
        frames = graphs.frames(rid).shape[0]
        cuts, emitted = set(), 0
        while emitted < frames:
            emitted = min(frames, emitted + next_chunk_frames(emitted, schedule.first_chunk_frames,
                                                              schedule.chunk_frames, schedule.chunk_ramp))
            cuts.add(emitted)
        for r in (graphs, chunked):
            ends = np.cumsum([a.size for a in r.audio[rid]])
            spf = ends[-1] // frames
            assert ends[-1] == frames * spf and {e // spf for e in ends} <= cuts and not (ends % spf).any(), rid
        assert abs(graphs.pcm(rid) - chunked.pcm(rid)).max() < 1e-5, rid


def test_graph_prefill_equals_eager_prefill(tmp_path):
    """Packed prefill as CUDA graph replays (token buckets) on the 0.6B config in bf16: the codes of the same
    padded forward run eagerly, bit for bit, for mixed prompt lengths joining mid-run; and on a float32
    tiny model, the codes of the unpadded eager forward (greedy)."""
    from legato.models.qwen3_tts.config import SpeechTokenizerConfig, preset
    from legato.models.qwen3_tts.testing import random_model

    def run(lm, specs, prefill, **kw):
        engine = Engine(lm, engine_config(device="cuda", num_kv_blocks=512, **kw))
        assert engine.runner.prefill_buckets is not None and engine.runner.prefill_buckets.graphs
        if prefill == "padded-eager":
            engine.runner.prefill_buckets = engine.runner.make_prefill_buckets(graphs=False)
        elif prefill == "unpadded":
            engine.runner.prefill_buckets = None
        reqs = [EngineRequest(f"r{i}", specs[i % len(specs)], SamplingParams(
            seed=i, max_new_tokens=30, do_sample=i % 2 == 0, subtalker_do_sample=i % 2 == 0), max_frames=10 + i,
            ignore_eos=True, stream_audio=False) for i in range(9)]
        return run_all(engine, reqs[:5], join_at={2: reqs[5:]})

    lm = random_model(preset("0.6B", "base"), SpeechTokenizerConfig(), device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    hidden = lm.config.talker_config.hidden_size
    ref = torch.randint(0, 2048, (23, 16), generator=g)
    specs = [build_spec(lm, SpeechInput(t, language="english", speaker_embedding=torch.randn(hidden, generator=g),
                                        x_vector_only=x, ref_code=None if x else ref,
                                        ref_text=None if x else "A reference transcript."))
             for t, x in (("Hello there, how are you?", True), ("Short.", False),
                          ("A somewhat longer sentence to speak, with commas, and more.", True))]
    graphs, eager = (run(lm, specs, p, dtype="bfloat16") for p in ("graphs", "padded-eager"))
    for i in range(9):
        assert torch.equal(graphs.frames(f"r{i}"), eager.frames(f"r{i}")), i

    tiny = load_model(tiny_model(tmp_path, "base").path, device="cuda")
    emb = torch.randn(64, generator=g)
    tiny_specs = [build_spec(tiny, SpeechInput(t, speaker_embedding=emb, x_vector_only=True))
                  for t in ("Hello there, how are you?", "Short.", "A somewhat longer sentence, with commas.")]
    graphs, unpadded = (run(tiny, tiny_specs, p) for p in ("graphs", "unpadded"))
    for i in range(1, 9, 2):  # the greedy ones
        assert torch.equal(graphs.frames(f"r{i}"), unpadded.frames(f"r{i}")), i


def test_streaming_codec_kernels_equal_their_twins_in_bf16():
    from codec_kernel_checks import run_checks, tolerance

    errors = run_checks("cuda", torch.bfloat16)
    assert all(e <= tolerance(torch.bfloat16) for e in errors.values()), errors


def test_streaming_codec_graphs_equal_eager_and_bf16_keeps_its_fidelity():
    """On the released decoder shapes with every weight random: one frame per call for 6 streams in a graph of
    8 rows equals the same 8-row calls run eagerly (the 2 padding rows on the scratch slot); the bf16 path stays
    above the report's SNR threshold against fp32; the fp32 path equals the module decoder."""
    from codec_helpers import randomize_codec_weights_

    from legato.engine.codec_graphs import CodecGraphs
    from legato.eval.fidelity import SNR_THRESHOLD_DB, snr_db
    from legato.models.qwen3_tts.codec_decoder import CodecDecoder
    from legato.models.qwen3_tts.config import CodecDecoderConfig
    from legato.models.qwen3_tts.streaming_codec import StreamingCodecDecoder

    base = randomize_codec_weights_(CodecDecoder(CodecDecoderConfig()).eval(), seed=6).cuda()
    codes = torch.randint(0, 2048, (6, 30, 16), generator=torch.Generator().manual_seed(1)).cuda()
    slots = list(range(1, 7))
    padded = torch.cat([codes, torch.zeros(2, 30, 16, dtype=codes.dtype, device="cuda")])

    def eager(dtype):
        codec = StreamingCodecDecoder(base, 8, dtype=dtype)
        index = torch.tensor(slots + [0, 0], device="cuda")
        codec.reset(index)
        return torch.cat([codec.step(index, padded[:, i: i + 1]) for i in range(30)], dim=1)[:6]

    fp32, bf16 = eager(torch.float32), eager(torch.bfloat16)
    codec = StreamingCodecDecoder(base, 9, dtype=torch.bfloat16)
    codec.reset(torch.tensor(slots, device="cuda"))
    graphs = CodecGraphs()
    graphs.capture(codec, 0, 8, [1], torch.cuda.Stream())
    assert graphs.exact(6, 1) is not None and graphs.exact(6, 1).batch == 8
    with torch.inference_mode():
        replayed = torch.cat([graphs.exact(6, 1).replay(slots, codes[:, i: i + 1])[:6].clone() for i in range(30)],
                             dim=1)
        module = base(codes)[:, 0]
    err = (fp32 - module).abs().max().item()
    assert err < 1e-4, err
    err = (replayed - bf16).abs().max().item()
    assert err < 1e-6, err
    snr = snr_db(fp32, bf16)
    assert snr >= SNR_THRESHOLD_DB, snr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_attention_equals_its_contract_and_the_unfused_model(dtype):
    """The one-kernel decode attention (both cache layouts) against its PyTorch contract, and the tiny talker
    with it against the talker without it: equal greedy codes in fp32, logits within the parity tolerance."""
    from attention_kernel_checks import model_checks, run_checks

    errors = {**run_checks("cuda", dtype), **model_checks("cuda", dtype)}
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert all(e <= tol for e in errors.values()), errors


def test_skinny_linear_equals_f_linear_and_keeps_the_model_close():
    """The skinny matmul kernel against F.linear in bf16 and fp16 (the 0.6B talker's and code predictor's
    shapes among others), and the tiny code predictor with it against cuBLAS, teacher-forced."""
    from skinny_linear_checks import model_checks, run_checks

    for dtype in (torch.bfloat16, torch.float16):
        errors = {**run_checks("cuda", dtype), **model_checks(dtype)}
        assert all(e <= 1e-2 for e in errors.values()), errors


def test_small_matmul_equals_f_linear_and_keeps_the_model_close():
    """The few-row GEMM against F.linear in bf16 and fp16 (the 0.6B's shapes at every row key through the measured
    table, gated and split-K forms among them), and the tiny code predictor with it against the path before it,
    teacher-forced."""
    from small_matmul_checks import model_checks, run_checks

    for dtype in (torch.bfloat16, torch.float16):
        errors = {**run_checks("cuda", dtype), **model_checks(dtype)}
        assert all(e <= 1e-2 for e in errors.values()), errors


def test_lookup_norm_equals_the_lookup_then_the_norm():
    """The code predictor's lookup-and-norm kernel against the index and the compiled norm it replaces, bf16 and
    fp16: the row to the bit, the norm within the parity tolerance."""
    from lookup_norm_checks import run_checks

    for dtype in (torch.bfloat16, torch.float16):
        errors = run_checks("cuda", dtype)
        assert all(e <= 1e-2 for e in errors.values()), errors


def test_projected_lookup_keeps_a_projected_code_predictor_close():
    """`code_predictor.PROJECTED_LOOKUP` (a pass's row and first norm from the projected tables through the
    lookup-and-norm kernel) on the tiny code predictor, which has a projection as the 1.7B's has, bf16 and fp16,
    teacher-forced: logits within the parity tolerance of the gather, projection and norm run apart."""
    from matmul_model_checks import code_predictor_with_and_without

    from legato.models.qwen3_tts import code_predictor

    class Projected:  # the flag as the helper toggles a kernel module's ENABLED
        @property
        def ENABLED(self) -> bool:  # noqa: N802
            return code_predictor.PROJECTED_LOOKUP

        @ENABLED.setter
        def ENABLED(self, on: bool) -> None:  # noqa: N802
            code_predictor.PROJECTED_LOOKUP = on

    built = []
    default = code_predictor.PROJECTED_LOOKUP

    def prepare(talker) -> None:
        talker.code_predictor.project_tables()
        built.append(talker.code_predictor)

    for dtype in (torch.bfloat16, torch.float16):
        errors = code_predictor_with_and_without(Projected(), dtype, prepare=prepare)
        assert all(e <= 1e-2 for e in errors.values()), errors
    assert code_predictor.PROJECTED_LOOKUP is default
    code_predictor.PROJECTED_LOOKUP = True
    try:  # the "on" runs took the kernel's path
        assert all(cp._lookup_tables() is cp.projected_tables for cp in built) and len(built) == 2
    finally:
        code_predictor.PROJECTED_LOOKUP = default


def test_fused_draw_gives_the_eager_and_the_compiled_draws_tokens():
    """The one-program-per-row draw kernel against `sampler.draw`, eager and compiled, on 32k rows of mixed
    settings (greedy, temperature 0, top-k and top-p on and off, ties, -inf ids, seeds and frames past 2**32)."""
    from draw_kernel_checks import run_checks

    differ = run_checks("cuda", {2048: 4096, 3072: 4096}, rounds=4)
    assert not any(differ.values()), differ


def test_the_engine_with_the_code_predictor_stack_on_the_0_6b_config():
    """`code_predictor_stack` on the 0.6B config in bf16 (random weights), eager engines (the graphs are what
    `offline.py --stack` times; two engines with graphs outran a 140 s limit on the H200): requests one at a time
    (one-row passes, the stack's) finish with all their frames and no barrier gives up; three at once, the same
    length, run the unfused layers and give an engine without the stack's codes bit for bit (the step's check row
    changes nothing)."""
    from legato.layers import decoder_stack
    from legato.models.qwen3_tts.config import SpeechTokenizerConfig, preset
    from legato.models.qwen3_tts.testing import random_model

    lm = random_model(preset("0.6B", "base"), SpeechTokenizerConfig(), device="cuda", dtype=torch.bfloat16)
    emb = torch.randn(lm.config.talker_config.hidden_size, generator=torch.Generator().manual_seed(5))
    spec = build_spec(lm, SpeechInput("Hello there, how are you?", language="english", speaker_embedding=emb,
                                      x_vector_only=True))

    def reqs(tag):
        return [EngineRequest(f"{tag}{i}", spec, SamplingParams(seed=i, max_new_tokens=30), max_frames=10,
                              ignore_eos=True, stream_audio=False) for i in range(3)]

    def config(stack):
        return engine_config(device="cuda", dtype="bfloat16", max_num_seqs=4, enforce_eager=True, num_kv_blocks=256,
                             code_predictor_stack=stack)

    stacked = Engine(lm, config(True))
    assert stacked.runner.uses_stack
    for r in reqs("one"):
        got = run_all(stacked, [r])
        assert got.finished[r.request_id] == "length" and got.errors[r.request_id] is None
        assert got.frames(r.request_id).shape[0] == 10
    assert decoder_stack.barrier_errors() == 0
    together = run_all(stacked, reqs("b"))
    plain = run_all(Engine(lm, config(False)), reqs("b"))
    for i in range(3):
        assert torch.equal(together.frames(f"b{i}"), plain.frames(f"b{i}")), i


def test_decoder_stack_equals_the_unfused_code_predictor():
    """The code predictor's one-launch pass (the tiny one and the 0.6B's whole code predictor in bf16, the tiny one
    in fp16) against the unfused layers, teacher-forced: logits and KV caches within the parity tolerance; the one
    launch equal bit for bit to the same phases as separate launches, with each phase's weights requested before or
    after its barrier; no barrier wait given up. Every model in both dtypes outran 300 s on an H100 (2026-12-06):
    the 1.7B's code predictor is the 0.6B's inside the kernel (only its input projection differs, outside it), and
    fp16 rounds where bf16 does, so those runs are left to `python tests/decoder_stack_checks.py cuda`."""
    from decoder_stack_checks import TOLERANCE, run_checks

    for dtype, names in ((torch.bfloat16, {"tiny", "0.6B code predictor"}), (torch.float16, {"tiny"})):
        errors = run_checks("cuda", dtype, names=names)
        assert all(e <= TOLERANCE for e in errors.values()), errors


def test_split_codec_warm_up_on_cuda_keeps_its_graphs_and_its_audio(tmp_path):
    """The codec worker's warm-up (every graph bucket, before it serves) drops no graph, and the streams after it
    decode to the bytes a codec that never warmed up gives."""
    from legato.pipeline.codec_engine import CodecEngine, load_codec_decoder

    decoder = load_codec_decoder(tiny_model(tmp_path, "base").path, "cuda")
    codes = torch.randint(0, 2048, (40, 16), generator=torch.Generator().manual_seed(5))

    def decode(warm: bool) -> dict[str, np.ndarray]:
        eng = CodecEngine(decoder, StreamSchedule(), capacity=6, graphs=True)
        graphs = len(eng.streamer.graphs.graphs)
        if warm:
            assert eng.warm_up() > 0 and eng.num_streams == 0 and eng.frames_decoded == 0
        assert graphs > 0 and len(eng.streamer.graphs.graphs) == graphs and eng.streamer.capacity == 6
        audio: dict[str, list[np.ndarray]] = {f"s{i}": [] for i in range(3)}
        for rid in audio:
            eng.open(rid)
        for t in range(len(codes)):
            for i, rid in enumerate(audio):
                if t < len(codes) - 7 * i:  # streams of different lengths: their tails come at different steps
                    eng.push(rid, codes[t : t + 1])
                elif t == len(codes) - 7 * i:
                    eng.end(rid)
            for out in eng.step():
                audio[out.request_id].append(out.audio)
        eng.end("s0")
        for _ in range(3):
            for out in eng.step():
                audio[out.request_id].append(out.audio)
        assert eng.num_streams == 0
        return {rid: np.concatenate(chunks) for rid, chunks in audio.items()}

    warmed, fresh = decode(True), decode(False)
    assert all(np.array_equal(warmed[rid], fresh[rid]) for rid in fresh)


def test_after_warm_up_no_count_of_prompts_ending_in_a_prefill_step_compiles_anything(tmp_path):
    """The warm-up's groups of prompts (1, 2, 3, 4, 8, 16 ending in one prefill step) leave no Triton specialisation
    of the eager first-token path for a burst to compile: groups of other sizes, of another prompt kind (x-vector,
    where the warm-up used in-context), compile nothing after it (on a cold H100 two draws cost 2.5 s each)."""
    from legato.engine import compile_watch

    lm = load_model(tiny_model(tmp_path, "base").path, device="cuda", dtype=torch.bfloat16)
    engine = Engine(lm, engine_config(device="cuda", dtype="bfloat16", max_num_seqs=32, num_kv_blocks=1024,
                                      max_num_batched_tokens=4096))
    try:
        with compile_watch.warming():
            engine.warm_up()
        before = compile_watch.counts()
        emb = torch.randn(64, generator=torch.Generator().manual_seed(0))
        spec = build_spec(lm, SpeechInput("A burst of prompts at once.", language="english", speaker_embedding=emb,
                                          x_vector_only=True))
        for n in (5, 6, 7, 12, 20, 32):
            run_all(engine, [EngineRequest(f"b{n}_{i}", spec, SamplingParams(seed=i), max_frames=3, ignore_eos=True)
                             for i in range(n)])
        after = compile_watch.counts()
        assert after.triton == before.triton, after.kernels[len(before.kernels):]
        assert after.dynamo == before.dynamo
    finally:
        compile_watch._WATCH.armed = False
