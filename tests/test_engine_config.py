import dataclasses

import pytest

from legato.engine.config import EngineConfig


def test_defaults():
    cfg = EngineConfig()
    assert cfg.block_size == 16 and cfg.num_kv_blocks is None
    assert cfg.first_chunk_frames == 1 and cfg.chunk_frames == 25
    assert not hasattr(cfg, "__dict__")  # slots


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len",
                                  "max_waiting", "cuda_graph_max_batch", "first_chunk_frames", "chunk_frames",
                                  "num_kv_blocks"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_positive_ints(name, value):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**{name: value})


def test_budget_must_cover_a_full_decode_batch():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)
    assert EngineConfig(max_num_seqs=8, max_num_batched_tokens=8).max_num_batched_tokens == 8


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01])
def test_memory_utilization(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)


def test_dtype_and_device():
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="fp8")
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device="")
    cfg = EngineConfig(dtype="float32", device="cpu", num_kv_blocks=10)
    assert dataclasses.replace(cfg, num_kv_blocks=20).num_kv_blocks == 20


def test_codec_dtype_is_bf16_on_cuda_by_default_and_float32_stays_the_exact_path():
    from legato.engine.config import codec_dtype_name

    assert EngineConfig().codec_dtype == "auto"
    assert codec_dtype_name("auto", "cuda:1") == "bfloat16" and codec_dtype_name("auto", "cpu") == "float32"
    assert codec_dtype_name("float32", "cuda") == "float32"
    for bad in ("float16", "fp8", "half"):  # float16 has no fidelity report
        with pytest.raises(ValueError, match="codec_dtype"):
            EngineConfig(codec_dtype=bad)


def test_block_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(block_size=12)
    assert EngineConfig(block_size=32).block_size == 32


def test_the_code_predictor_stack_needs_cuda_half_precision_and_one_replica_group():
    assert EngineConfig(device="cuda:0", dtype="bfloat16", code_predictor_stack=True).code_predictor_stack
    for bad in (dict(device="cpu", dtype="float32"), dict(device="cuda", dtype="float32"),
                dict(device="cuda", dtype="bfloat16", mtp_replicas=2)):
        with pytest.raises(ValueError, match="code_predictor_stack needs"):
            EngineConfig(code_predictor_stack=True, **bad)
    with pytest.raises(ValueError, match="code_predictor_stack must be a bool"):
        EngineConfig(code_predictor_stack="yes")
