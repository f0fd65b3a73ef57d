"""Programmatic dependent launch (`legato/layers/pdl.py`): where it applies. Its kernels' PDL forms compile for
Hopper in test_small_matmul.py and test_decoder_stack.py; tests/test_gpu.py holds the engine's codes equal with
it on and off."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from legato.layers import pdl


def test_cpu_tensors_never_launch_with_pdl_even_inside_a_scope():
    with pdl.scope():
        assert not pdl.launch(torch.zeros(2))


def test_a_scope_nests_and_belongs_to_the_thread_that_opened_it():
    seen: dict[str, int] = {}

    def other_thread() -> None:
        seen["other"] = getattr(pdl._scopes, "depth", 0)

    with pdl.scope():
        with pdl.scope():
            seen["inner"] = pdl._scopes.depth
        seen["outer"] = pdl._scopes.depth
        t = threading.Thread(target=other_thread)
        t.start()
        t.join(timeout=10)
    assert seen == {"inner": 2, "outer": 1, "other": 0}
    assert pdl._scopes.depth == 0


def test_a_scope_closes_when_its_body_raises():
    try:
        with pdl.scope():
            raise ValueError("boom")
    except ValueError:
        pass
    assert pdl._scopes.depth == 0


def test_the_engine_runs_its_decode_frame_inside_a_scope():
    """Only the decode step (talker and code predictor, what a GPU run measured and tested with PDL) opens a
    scope: prefill and the codec launch as before."""
    from legato.engine.model_runner import ModelRunner

    depths = []

    def frame(*args):
        depths.append(pdl._scopes.depth)
        return "codes", "next"

    runner = SimpleNamespace(_frame=frame)
    assert ModelRunner._decode_step(runner, None, None, None, None, None, None) == ("codes", "next")
    assert depths == [1] and getattr(pdl._scopes, "depth", 0) == 0
