"""What the matmul kernels' check scripts (`skinny_linear_checks.py`, `small_matmul_checks.py`) share: the tiny
code predictor with a kernel on and off."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from triton_interpreter import rel_err


def code_predictor_with_and_without(kernel: ModuleType, dtype: torch.dtype,
                                    prepare: Callable[[torch.nn.Module], None] | None = None) -> dict[str, float]:
    """The tiny talker's code predictor (CUDA, packed as the engine serves it) with `kernel.ENABLED` on and off,
    teacher-forced: equal greedy codes are not asked of half precision, logits within the parity tolerance.
    `prepare(talker)`: what an engine builds for the path besides the packed projections."""
    from legato.models.qwen3_tts.decoder_layer import pack_projections
    from legato.models.qwen3_tts.talker import Talker
    from legato.models.qwen3_tts.testing import randomize_
    from legato.models.qwen3_tts.tiny import tiny_config

    cfg = tiny_config("base").talker_config
    talker = Talker(cfg)
    randomize_(talker, seed=1, std=0.1)
    talker.to(device="cuda", dtype=dtype).eval()
    pack_projections(talker)
    if prepare is not None:
        prepare(talker)
    gen = torch.Generator().manual_seed(2)
    past, first = (torch.randn(5, cfg.hidden_size, generator=gen).to("cuda", dtype) for _ in range(2))
    runs = {}
    before = kernel.ENABLED
    for on in (True, False):
        kernel.ENABLED = on
        forced = runs[True][0] if not on else None
        logits: list[torch.Tensor] = []

        def sample(scores, g, logits=logits, forced=forced):
            logits.append(scores)
            return scores.argmax(-1) if forced is None else forced[:, g - 1]

        try:
            with torch.inference_mode():
                codes = talker.code_predictor.predict_residuals(past, first, sample)
        finally:
            kernel.ENABLED = before
        runs[on] = codes, torch.stack(logits)
    return {"model: code predictor logits": rel_err(runs[True][1], runs[False][1])}

