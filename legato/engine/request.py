"""A request's bookkeeping as the scheduler sees it: counts, blocks, a slot and a status machine.

No tensors live here. The prompt is known only by its length (and, for prefix caching, by per-block keys
the caller derives from the prompt content).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    """Queued; holds no blocks and no slot."""
    WAITING_FOR_HANDOFF = "waiting_for_handoff"
    """Holds blocks for its prompt and a slot; its prompt KV is being received from a prefill worker."""
    RUNNING = "running"
    """Holds blocks and a slot; being prefilled here or decoding."""
    FINISHED_STOPPED = "finished_stopped"
    """The talker sampled codec EOS."""
    FINISHED_LENGTH = "finished_length"
    """Reached max_frames."""
    FINISHED_ABORTED = "finished_aborted"
    """Aborted (client gone, cancelled)."""
    FINISHED_ERROR = "finished_error"
    """Failed (handoff failed, runner error)."""

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

# Abort and error are reachable from every live state; normal completion only from RUNNING.
_ANY_END = frozenset({RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})
_LEGAL = {
    RequestStatus.WAITING: frozenset({RequestStatus.RUNNING, RequestStatus.WAITING_FOR_HANDOFF}) | _ANY_END,
    RequestStatus.WAITING_FOR_HANDOFF: frozenset({RequestStatus.RUNNING}) | _ANY_END,
    RequestStatus.RUNNING: _FINISHED,
    RequestStatus.FINISHED_STOPPED: frozenset(),
    RequestStatus.FINISHED_LENGTH: frozenset(),
    RequestStatus.FINISHED_ABORTED: frozenset(),
    RequestStatus.FINISHED_ERROR: frozenset(),
}


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class InvalidTransitionError(RuntimeError):
    """A request was moved between two statuses that have no edge between them."""


@dataclass(eq=False)
class Request:
    """One synthesis request.

    The caller fills the first block of fields; the scheduler owns the rest and changes ``status`` only
    through :meth:`transition`. Equality is identity (requests are hashable and weak-referenceable).
    """

    request_id: str
    prompt_len: int
    """Prompt positions (embeddings) fed to the talker before the first frame."""
    max_frames: int
    """Most frames to generate; the request finishes with FINISHED_LENGTH on reaching it."""
    prefix_keys: Sequence[Hashable] | None = None
    """Prefix-caching keys, one per *full* prompt block, in order. Key i must identify the whole prompt
    content up to the end of block i (e.g. a hash chain), never block i alone."""
    kv_handoff: bool = False
    """The prompt KV is computed by a prefill worker and received here; this engine never prefills it."""
    arrival_time: float = field(default_factory=time.monotonic)
    text_frames: int | None = None
    """Streaming text input: decode steps whose text-track input is known (frame k reads text token k); the
    request sits out decode steps once it has made that many frames. None: all of them (the text is closed)."""

    # Owned by the scheduler.
    num_computed_tokens: int = field(default=0, init=False)
    """Positions whose KV is in the cache (prompt tokens, then one per decode step)."""
    num_cached_tokens: int = field(default=0, init=False)
    """Prompt tokens found in the prefix cache at admission (counted in num_computed_tokens)."""
    num_frames: int = field(default=0, init=False)
    """Frames generated so far."""
    block_table: list[int] = field(default_factory=list, init=False)
    slot: int | None = field(default=None, init=False)
    """Stable index in [0, max_num_seqs) while holding a slot; the runner keys per-request device state on it."""
    error: str | None = field(default=None, init=False)
    """Why it was aborted or failed; None otherwise."""
    _status: RequestStatus = field(default=RequestStatus.WAITING, init=False)

    def __post_init__(self) -> None:
        if not _is_positive_int(self.prompt_len):
            raise ValueError(f"request {self.request_id!r}: prompt_len must be a positive int, got {self.prompt_len!r}")
        if not _is_positive_int(self.max_frames):
            raise ValueError(f"request {self.request_id!r}: max_frames must be a positive int, got {self.max_frames!r}")

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self._status.name}, prompt_len={self.prompt_len}, "
                f"computed={self.num_computed_tokens}, frames={self.num_frames}/{self.max_frames}, slot={self.slot})")

    @property
    def status(self) -> RequestStatus:
        return self._status

    def transition(self, new: RequestStatus) -> None:
        """Move to ``new``; raises InvalidTransitionError if the state machine has no such edge."""
        if new not in _LEGAL[self._status]:
            raise InvalidTransitionError(f"request {self.request_id!r}: illegal transition "
                                         f"{self._status.name} -> {new.name}")
        self._status = new

    @property
    def is_finished(self) -> bool:
        return self._status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length", "abort" or "error" once finished; None before."""
        return _FINISH_REASONS.get(self._status)

    @property
    def max_tokens(self) -> int:
        """Upper bound on the KV positions this request can ever hold: its whole life."""
        return self.prompt_len + self.max_frames

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.prompt_len

    @property
    def waits_for_text(self) -> bool:
        """Past its prompt, it has used every text token it has and its text is not closed."""
        return self.text_frames is not None and not self.in_prefill and self.num_frames >= self.text_frames
