import weakref

import pytest

from legato.engine.request import InvalidTransitionError, Request, RequestStatus

S = RequestStatus
LIVE = [S.WAITING, S.WAITING_FOR_HANDOFF, S.RUNNING]
FINISHED = [S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.FINISHED_ABORTED, S.FINISHED_ERROR]

# Every legal edge; all others must raise.
LEGAL = {
    (S.WAITING, S.RUNNING), (S.WAITING, S.WAITING_FOR_HANDOFF), (S.WAITING, S.FINISHED_ABORTED),
    (S.WAITING, S.FINISHED_ERROR),
    (S.WAITING_FOR_HANDOFF, S.RUNNING), (S.WAITING_FOR_HANDOFF, S.FINISHED_ABORTED),
    (S.WAITING_FOR_HANDOFF, S.FINISHED_ERROR),
    (S.RUNNING, S.FINISHED_STOPPED), (S.RUNNING, S.FINISHED_LENGTH), (S.RUNNING, S.FINISHED_ABORTED),
    (S.RUNNING, S.FINISHED_ERROR),
}

# A shortest legal path from WAITING to each status.
PATH = {
    S.WAITING: [],
    S.WAITING_FOR_HANDOFF: [S.WAITING_FOR_HANDOFF],
    S.RUNNING: [S.RUNNING],
    S.FINISHED_STOPPED: [S.RUNNING, S.FINISHED_STOPPED],
    S.FINISHED_LENGTH: [S.RUNNING, S.FINISHED_LENGTH],
    S.FINISHED_ABORTED: [S.FINISHED_ABORTED],
    S.FINISHED_ERROR: [S.FINISHED_ERROR],
}


def request_in(status: RequestStatus) -> Request:
    req = Request("r", prompt_len=10, max_frames=5)
    for s in PATH[status]:
        req.transition(s)
    assert req.status is status
    return req


def test_defaults():
    req = Request("a", prompt_len=7, max_frames=3)
    assert req.status is S.WAITING
    assert (req.num_computed_tokens, req.num_frames, req.block_table, req.slot) == (0, 0, [], None)
    assert req.max_tokens == 10
    assert req.in_prefill
    assert not req.is_finished and req.finish_reason is None
    assert req.arrival_time > 0
    assert weakref.ref(req)() is req


@pytest.mark.parametrize("src", list(S))
@pytest.mark.parametrize("dst", list(S))
def test_transitions(src, dst):
    req = request_in(src)
    if (src, dst) in LEGAL:
        req.transition(dst)
        assert req.status is dst
    else:
        with pytest.raises(InvalidTransitionError, match=f"{src.name} -> {dst.name}"):
            req.transition(dst)
        assert req.status is src


@pytest.mark.parametrize("status,reason", [(S.FINISHED_STOPPED, "stop"), (S.FINISHED_LENGTH, "length"),
                                           (S.FINISHED_ABORTED, "abort"), (S.FINISHED_ERROR, "error")])
def test_finish_reason(status, reason):
    req = request_in(status)
    assert req.is_finished and status.is_finished
    assert req.finish_reason == reason


def test_live_statuses_are_not_finished():
    assert not any(s.is_finished for s in LIVE)


def test_status_is_read_only():
    req = Request("a", prompt_len=1, max_frames=1)
    with pytest.raises(AttributeError):
        req.status = S.RUNNING


@pytest.mark.parametrize("kwargs", [dict(prompt_len=0, max_frames=1), dict(prompt_len=1, max_frames=0),
                                    dict(prompt_len=-3, max_frames=1), dict(prompt_len=2.0, max_frames=1)])
def test_invalid_sizes(kwargs):
    with pytest.raises(ValueError):
        Request("bad", **kwargs)


def test_identity_equality():
    a, b = Request("x", 1, 1), Request("x", 1, 1)
    assert a != b and len({a, b}) == 2


def test_in_prefill_tracks_computed_tokens():
    req = Request("a", prompt_len=4, max_frames=2)
    req.num_computed_tokens = 3
    assert req.in_prefill
    req.num_computed_tokens = 4
    assert not req.in_prefill
