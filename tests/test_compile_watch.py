"""The compile watch: once armed (after the warm-up), every Triton kernel compile and `torch.compile` graph in the
process is one WARNING naming it, counted; before that, nothing is. Hooks already set in Triton still run."""

from __future__ import annotations

import logging

import pytest
import torch

from legato.engine import compile_watch


@pytest.fixture
def watch():
    triton = pytest.importorskip("triton", reason="the Triton hooks need the triton package")
    knobs = triton.knobs.runtime
    saved = knobs.jit_cache_hook, knobs.jit_post_compile_hook
    seen: list[str] = []
    # Hooks someone set before the watch: they must keep running, and the cache hook's answer must stand.
    knobs.jit_cache_hook = lambda *a, **kw: seen.append("lookup") or None
    knobs.jit_post_compile_hook = lambda *a, **kw: seen.append("compiled")
    w = compile_watch._Watch()
    w.install()
    try:
        yield w, knobs, seen
    finally:
        w.armed = False  # its dynamo callbacks stay registered for the process: silent from here on
        knobs.jit_cache_hook, knobs.jit_post_compile_hook = saved


class _Fn:
    name = "_rows_kernel"


# The compile arguments Triton passes its hooks (triton 3.6): argument names in order, the aligned ones' indices,
# the constants by index.
COMPILE = {"signature": {"x_ptr": "*bf16", "m": "i32", "BLOCK": "constexpr"},
           "configs": [{(0,): [["tt.divisibility", 16]]}], "constants": {(2,): 64}}


def _triton_compile(knobs) -> object:
    """What Triton's JIT does around one compile: the cache hook (None lets it compile), then the post hook."""
    answer = knobs.jit_cache_hook(key="k", repr="_rows_kernel[num_warps=4](x_ptr: ()", fn=_Fn(), compile=COMPILE,
                                  is_manual_warmup=False, already_compiled=False)
    knobs.jit_post_compile_hook(key="k", repr="_rows_kernel[num_warps=4](x_ptr: ()", fn=_Fn(), compile=COMPILE,
                                is_manual_warmup=False, already_compiled=False)
    return answer


def test_triton_compiles_count_only_once_armed_and_earlier_hooks_still_run(watch, caplog):
    w, knobs, seen = watch
    with caplog.at_level(logging.WARNING, logger="legato.engine.compile_watch"):
        assert _triton_compile(knobs) is None  # the warm-up's own compile: silent
        assert w.counts.triton == 0 and not caplog.records
        w.armed = True
        assert _triton_compile(knobs) is None
    assert seen == ["lookup", "compiled"] * 2
    assert w.counts.triton == 1 and w.counts.kernels == ["_rows_kernel"] and w.counts.seconds >= 0
    [record] = caplog.records
    message = record.getMessage()
    assert "_rows_kernel compiled after warm-up" in message
    assert "aligned or divisible by 16: x_ptr; constants: {'BLOCK': 64}" in message
    assert compile_watch._specialisation({"signature": {}}) == ""  # arguments of another shape: no detail


def test_a_torch_compile_after_warm_up_is_logged(watch, caplog):
    w, _, _ = watch
    w.armed = True

    def double(x):
        return x * 2

    with caplog.at_level(logging.WARNING, logger="legato.engine.compile_watch"):
        out = torch.compile(double, backend="eager")(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))
    assert w.counts.dynamo == 1 and w.counts.triton == 0
    assert any("torch.compile compiled graph" in r.getMessage() for r in caplog.records)


def test_the_watch_arms_when_the_last_warm_up_under_way_ends():
    """Two warm-ups side by side (a thread-worker split's talker and codec): compiles stay expected until both end."""
    watch = compile_watch._WATCH
    try:
        with compile_watch.warming():
            with compile_watch.warming():
                assert not watch.armed
            assert not watch.armed  # the other one still warms up
        assert watch.armed
        with pytest.raises(RuntimeError), compile_watch.warming():  # a failed warm-up still ends
            raise RuntimeError("warm-up failed")
        assert watch.armed and watch.warming == 0
        got = compile_watch.counts()
        got.kernels.append("not theirs")
        assert "not theirs" not in compile_watch.counts().kernels
    finally:
        watch.armed = False
