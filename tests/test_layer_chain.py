"""The decoder layer's chain form (`matmuls.CHAIN`, off by default): each norm inside the matmul after it, each
residual add in the epilogue of the projection before it. On the CPU its two matmuls fall back to torch's ops, so
the chain's wiring must give the residual form's results to the bit there; its kernels are checked under Triton's
interpreter (`small_matmul_checks.py`) and on CUDA (tests/test_gpu.py)."""

from __future__ import annotations

import torch

from legato.layers import matmuls
from legato.models.qwen3_tts.decoder_layer import DecoderLayer, pack_projections
from legato.models.qwen3_tts.talker import Talker
from legato.models.qwen3_tts.testing import randomize_
from legato.models.qwen3_tts.tiny import tiny_config


def _code_predictor_run(talker: Talker) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    past, first = (torch.randn(3, talker.config.hidden_size, generator=gen) for _ in range(2))
    logits: list[torch.Tensor] = []

    def sample(scores, g):
        logits.append(scores)
        return scores.argmax(-1)

    with torch.inference_mode():
        codes = talker.code_predictor.predict_residuals(past, first, sample)
    return codes, torch.stack(logits)


def test_the_chain_form_gives_the_residual_forms_codes_and_logits_to_the_bit(monkeypatch):
    talker = Talker(tiny_config("base").talker_config)
    randomize_(talker, seed=1, std=0.1)
    talker.eval()
    pack_projections(talker)
    codes, logits = _code_predictor_run(talker)

    steps = []
    chain_step = DecoderLayer._chain_step

    def counted(self, *args):
        steps.append(1)
        return chain_step(self, *args)

    monkeypatch.setattr(DecoderLayer, "_chain_step", counted)
    monkeypatch.setattr(matmuls, "chains", lambda x, *weights: True)  # the CPU has no kernel to ask about
    chained_codes, chained_logits = _code_predictor_run(talker)
    layers = len(talker.code_predictor.model.layers)
    assert len(steps) == layers * talker.code_predictor.num_residual_groups  # every layer of every pass chained
    assert torch.equal(chained_codes, codes) and torch.equal(chained_logits, logits)


def test_the_chain_form_is_off_by_default_and_never_taken_on_the_cpu():
    x, w = torch.zeros(1, 8), torch.zeros(16, 8)
    assert not matmuls.CHAIN
    try:
        matmuls.CHAIN = True
        assert not matmuls.chains(x, w)  # CPU tensors: the few-row GEMM cannot take them
    finally:
        matmuls.CHAIN = False
