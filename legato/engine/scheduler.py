"""Continuous-batching scheduler: who runs in the next step, and what changed after it.

A step is ``schedule()`` -> the runner executes the :class:`SchedulerOutput` -> ``update(results)``; the two
calls alternate, and any output that scheduled work must go through ``update`` before the next
``schedule``. Blocks and slots are only handed out inside ``schedule()``, so an abort between the two calls
can free them at once: nothing reuses them until the in-flight step has been reported.

Policy:

* **No preemption, ever.** A request is admitted only if the blocks for its whole life
  (``prompt_len + max_frames``) can be reserved. Blocks are allocated lazily as it grows, but the
  reservation makes that growth infallible. The price is that ``max_frames`` should be a tight bound.
  A request that could never fit (more than the whole cache, or ``max_model_len``) is rejected at ``add``.
* **Decodes first.** Every running request past its prompt decodes every step (1 token each; the config
  guarantees the budget covers a full batch). Unfinished chunked prefills continue next, then admissions.
* **Strict FIFO admission.** The head of the waiting queue is admitted or nobody behind it is: small
  requests never overtake a large one, so none waits forever. With chunked prefill off, a prompt is
  prefilled whole in one step or the head waits for a step with enough budget.
* **Fair prefill** (``fair_prefill``, chunked prefill, not batch-invariant). What the decodes leave of
  the budget is split among every prompt being prefilled by water-filling (``fair_shares``): a short
  prompt admitted behind a long one is prefilled whole in its first step, and the long one still gets
  at least one token every step. Another prompt is admitted only while those already prefilling, counted
  at one KV block each (or what they have left), leave some budget. Off, and in batch-invariant mode,
  chunks go to prompts in admission order, each taking what it can of what is left (a long prompt takes
  the whole budget until it is done; batch-invariant chunks are cut at fixed sizes, which fair shares
  would make depend on the load).
* **Handoff requests** (``kv_handoff``) are admitted in the same queue, take no token budget, receive
  blocks for their prompt and a slot, and wait in WAITING_FOR_HANDOFF until ``handoff_complete``.

Not thread-safe: one engine loop owns the scheduler and feeds it aborts and handoff events between steps.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from legato.engine.block_manager import BlockManager
from legato.engine.config import EngineConfig
from legato.engine.request import Request, RequestStatus


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full; the caller should shed load (HTTP 429/503)."""


class DuplicateRequestError(ValueError):
    """A request id that is already live on this engine (HTTP 409: ids name one request at a time)."""


class RequestTooLargeError(ValueError):
    """The request could never run on this engine (too long for max_model_len, the KV cache or the budget)."""


class PrefillChunk(NamedTuple):
    """Compute prompt positions [start, start + num_tokens) of ``request``."""

    request: Request
    start: int
    num_tokens: int

    @property
    def is_last(self) -> bool:
        """This chunk ends the prompt: the runner samples the first codebook-0 token after it."""
        return self.start + self.num_tokens == self.request.prompt_len


@dataclass(slots=True)
class SchedulerOutput:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    """One token each, at position ``num_computed_tokens``."""
    waiting_for_text: list[Request] = field(default_factory=list)
    """Running, out of text whose close has not come (`Request.waits_for_text`): not decoding this step."""
    new_requests: list[Request] = field(default_factory=list)
    """Admitted this step (a slot was just assigned): the runner resets that slot's per-request state."""
    kv_receives: list[Request] = field(default_factory=list)
    """Handoff requests given destination blocks this step: the KV connector may start receiving."""
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner to execute (kv_receives need no model step)."""
        return not self.prefills and not self.decodes


@dataclass(slots=True)
class StepResult:
    """What the runner reports for one scheduled request after a step."""

    request_id: str
    num_tokens: int
    """Tokens whose KV was written: the chunk length, or 1 for a decode."""
    num_frames: int = 0
    """Frames completed this step."""
    stopped: bool = False
    """Codec EOS was sampled."""
    error: str | None = None
    """Set when this request failed; it finishes with FINISHED_ERROR."""


@dataclass(slots=True)
class SchedulerStats:
    num_finished: int = 0
    num_ignored_aborts: int = 0
    """abort()/fail() calls for unknown or already finished requests (duplicates included)."""
    num_ignored_handoffs: int = 0
    """Handoff completions/failures for requests not waiting for one (late, duplicate or unknown)."""
    num_ignored_results: int = 0
    """Step results for requests finished while the step ran (e.g. aborted)."""


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        if block_manager.block_size != config.block_size:
            raise ValueError(f"block manager block_size {block_manager.block_size} != config {config.block_size}")
        if config.num_kv_blocks is not None and block_manager.num_blocks != config.num_kv_blocks:
            raise ValueError(f"block manager has {block_manager.num_blocks} blocks, config {config.num_kv_blocks}")
        if block_manager.enable_prefix_caching != config.enable_prefix_caching:
            raise ValueError("block manager and config disagree on enable_prefix_caching")
        self.config = config
        self.block_manager = block_manager
        self.stats = SchedulerStats()
        self._waiting: OrderedDict[str, Request] = OrderedDict()
        self._receiving: dict[str, Request] = {}
        # Admission order; dicts give O(1) removal on finish and abort.
        self._running: dict[str, Request] = {}
        self._free_slots = list(range(config.max_num_seqs))
        # Request id -> tokens scheduled in the step awaiting update().
        self._in_flight: dict[str, int] = {}
        self._steps_since_admit = 0  # steps since one admitted a waiting prompt (`prefill_interval`)

    # ---- queries -------------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_receiving(self) -> int:
        return len(self._receiving)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._receiving or self._running)

    def get(self, request_id: str) -> Request | None:
        """The live (unfinished) request with this id, if any."""
        return self._running.get(request_id) or self._receiving.get(request_id) or self._waiting.get(request_id)

    # ---- intake --------------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        """Queue ``req``. Raises QueueFullError, RequestTooLargeError, or ValueError (duplicate id / not WAITING)."""
        if req.status is not RequestStatus.WAITING:
            raise ValueError(f"request {req.request_id!r} is {req.status.name}, expected WAITING")
        if self.get(req.request_id) is not None:
            raise DuplicateRequestError(f"request id {req.request_id!r} is already in flight")
        cfg, bm = self.config, self.block_manager
        if req.max_tokens > cfg.max_model_len:
            raise RequestTooLargeError(f"request {req.request_id!r}: prompt_len {req.prompt_len} + max_frames "
                                       f"{req.max_frames} exceeds max_model_len {cfg.max_model_len}")
        if bm.num_blocks_for(req.max_tokens) > bm.num_blocks:
            # Name what the caller can change: a probe's 10,000-character `synth` text met this with only block
            # counts to go on (the CPU cache holds 4,096 positions a sequence).
            raise RequestTooLargeError(
                f"request {req.request_id!r}: prompt_len {req.prompt_len} + max_frames {req.max_frames} needs "
                f"{bm.num_blocks_for(req.max_tokens)} KV blocks, the cache has {bm.num_blocks} "
                f"({bm.num_blocks * bm.block_size} positions): shorten the text or lower max_new_tokens")
        if not req.kv_handoff and not cfg.enable_chunked_prefill and req.prompt_len > cfg.max_num_batched_tokens:
            raise RequestTooLargeError(f"request {req.request_id!r}: prompt_len {req.prompt_len} exceeds "
                                       f"max_num_batched_tokens {cfg.max_num_batched_tokens} with chunked prefill off")
        if len(self._waiting) >= cfg.max_waiting:
            raise QueueFullError(f"waiting queue full ({cfg.max_waiting} requests)")
        self._waiting[req.request_id] = req

    # ---- the step ------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self._in_flight:
            raise RuntimeError("schedule() called before update() reported the previous step")
        bm = self.block_manager
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        partial: list[Request] = []
        for req in self._running.values():
            if req.in_prefill:
                partial.append(req)
                continue
            if req.waits_for_text:
                # Its next frame needs a text token that has not arrived: it keeps its blocks and slot and sits
                # this step out (feeding tts_pad instead would tell the model the text is over).
                out.waiting_for_text.append(req)
                continue
            # EngineConfig guarantees max_num_batched_tokens >= max_num_seqs: every decode fits.
            if not bm.append_slot(req):
                raise RuntimeError(f"request {req.request_id!r} outgrew its reservation")
            out.decodes.append(req)
            self._in_flight[req.request_id] = 1
            budget -= 1

        hold = not self._may_admit(out)
        if self._fair:
            budget -= self._schedule_fair(partial, budget, out, hold)
            out.num_batched_tokens = self.config.max_num_batched_tokens - budget
            self._count_admits(out)
            return out

        for req in partial:
            if budget == 0:
                break
            if self.config.batch_invariant and min(req.prompt_len - req.num_computed_tokens,
                                                   self.invariant_chunk) > budget:
                break  # a chunk is never cut by what else runs this step
            budget -= self._schedule_chunk(req, budget, out)

        while self._waiting and self._free_slots:
            req = next(iter(self._waiting.values()))
            if req.kv_handoff:
                if not self._admit_handoff(req, out):
                    break
                continue
            if budget == 0 or hold:
                break
            cached = bm.match_prefix(req)
            chunk = req.prompt_len - cached
            if self.config.batch_invariant:
                chunk = min(chunk, self.invariant_chunk)
                if chunk > budget:
                    break
            elif self.config.enable_chunked_prefill:
                chunk = min(chunk, budget)
            elif chunk > budget:
                break
            cached = bm.allocate(req, cached + chunk, reserve_tokens=req.max_tokens)
            if cached is None:
                break
            req.num_computed_tokens = req.num_cached_tokens = cached
            self._admit(req, RequestStatus.RUNNING, out)
            self._running[req.request_id] = req
            budget -= self._schedule_chunk(req, budget, out)

        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        self._count_admits(out)
        return out

    def _may_admit(self, out: SchedulerOutput) -> bool:
        """Whether this step may admit waiting prompts (`prefill_interval`): every k-th step, or at once when
        nothing decodes (an idle engine, or one only prefilling, gains nothing by waiting)."""
        k = self.config.prefill_interval
        return k <= 1 or not out.decodes or self._steps_since_admit + 1 >= k

    def _count_admits(self, out: SchedulerOutput) -> None:
        if any(not r.kv_handoff for r in out.new_requests):
            self._steps_since_admit = 0
        else:
            self._steps_since_admit += 1

    def update(self, results: Sequence[StepResult]) -> list[Request]:
        """Apply the runner's report of the last step; returns the requests that finished.

        Every scheduled request still live must have exactly one result. Results for requests that
        finished meanwhile (aborted) are counted and ignored.
        """
        scheduled, self._in_flight = self._in_flight, {}
        live: list[tuple[Request, int, StepResult]] = []
        seen: set[str] = set()
        for res in results:
            req = self._running.get(res.request_id)
            n = scheduled.get(res.request_id)
            if req is None:
                self.stats.num_ignored_results += 1
                continue
            if n is None or res.request_id in seen:
                raise ValueError(f"unexpected result for {res.request_id!r}: not scheduled in this step or duplicated")
            if res.num_tokens != n:
                raise ValueError(f"request {res.request_id!r}: scheduled {n} tokens, runner reports {res.num_tokens}")
            if res.num_frames < 0 or req.num_frames + res.num_frames > req.max_frames:
                raise ValueError(f"request {res.request_id!r}: {res.num_frames} new frames exceed max_frames")
            seen.add(res.request_id)
            live.append((req, n, res))
        missing = [rid for rid in scheduled if rid not in seen and rid in self._running]
        if missing:
            raise ValueError(f"no result for scheduled requests {missing}")

        finished = []
        for req, n, res in live:
            start = req.num_computed_tokens
            req.num_computed_tokens += n
            if start < req.prompt_len:
                self.block_manager.cache_blocks(req, start, req.num_computed_tokens)
            req.num_frames += res.num_frames
            if res.error is not None:
                self._finish(req, RequestStatus.FINISHED_ERROR, res.error)
            elif res.stopped:
                self._finish(req, RequestStatus.FINISHED_STOPPED)
            elif req.num_frames >= req.max_frames:
                self._finish(req, RequestStatus.FINISHED_LENGTH)
            else:
                continue
            finished.append(req)
        return finished

    # ---- out-of-band events --------------------------------------------------------------------------

    def abort(self, request_id: str, reason: str = "aborted") -> Request | None:
        """Finish a live request as FINISHED_ABORTED, freeing its blocks and slot now. Unknown ids are counted."""
        return self._end(request_id, RequestStatus.FINISHED_ABORTED, reason)

    def stop(self, request_id: str) -> Request | None:
        """Finish a running request as FINISHED_STOPPED: its stop token arrived after the step that produced
        it was counted (the engine reads results one step late). Returns None if it is not running."""
        req = self._running.get(request_id)
        if req is None:
            return None
        self._finish(req, RequestStatus.FINISHED_STOPPED)
        return req

    def fail(self, request_id: str, reason: str) -> Request | None:
        """Finish a live request as FINISHED_ERROR (e.g. its codec stream failed). Unknown ids are counted."""
        return self._end(request_id, RequestStatus.FINISHED_ERROR, reason)

    def handoff_complete(self, request_id: str) -> bool:
        """The prompt KV of a WAITING_FOR_HANDOFF request has landed: it becomes RUNNING, ready to decode.

        Returns False (counted) if no request is waiting for a handoff under this id.
        """
        req = self._receiving.pop(request_id, None)
        if req is None:
            self.stats.num_ignored_handoffs += 1
            return False
        req.transition(RequestStatus.RUNNING)
        req.num_computed_tokens = req.prompt_len
        self.block_manager.cache_blocks(req, 0, req.prompt_len)
        self._running[request_id] = req
        return True

    def handoff_failed(self, request_id: str, reason: str) -> Request | None:
        """The handoff for a WAITING_FOR_HANDOFF request failed: it finishes with FINISHED_ERROR.

        To keep destination blocks out of use until no late write can land, quarantine
        ``req.block_table`` in the block manager before calling this.
        """
        if request_id not in self._receiving:
            self.stats.num_ignored_handoffs += 1
            return None
        return self._end(request_id, RequestStatus.FINISHED_ERROR, reason)

    # ---- internals -----------------------------------------------------------------------------------

    @property
    def _fair(self) -> bool:
        # Batch-invariant mode cuts chunks at fixed sizes whatever else runs; fair shares depend on the load,
        # so they would make a seeded request's codes depend on it too. Unchunked prompts are never split.
        cfg = self.config
        return cfg.fair_prefill and cfg.enable_chunked_prefill and not cfg.batch_invariant

    def _schedule_fair(self, partial: list[Request], budget: int, out: SchedulerOutput, hold: bool) -> int:
        """Admit in FIFO order (prompts only when not ``hold``), then split ``budget`` among every prompt being
        prefilled (``fair_shares``), so a long prompt cannot hold the whole budget while short ones behind it
        wait. Returns tokens used."""
        bm = self.block_manager
        prefilling = list(partial)
        floor = self.config.block_size  # a share below one KV block is not worth admitting another request for
        demand = sum(min(r.prompt_len - r.num_computed_tokens, floor) for r in prefilling)
        while self._waiting and self._free_slots:
            req = next(iter(self._waiting.values()))
            if req.kv_handoff:
                if not self._admit_handoff(req, out):
                    break
                continue
            if demand >= budget or hold:
                break
            # Blocks for one token now; the chunk grows into the reservation once its share is known.
            cached = bm.allocate(req, bm.match_prefix(req) + 1, reserve_tokens=req.max_tokens)
            if cached is None:
                break
            req.num_computed_tokens = req.num_cached_tokens = cached
            self._admit(req, RequestStatus.RUNNING, out)
            self._running[req.request_id] = req
            prefilling.append(req)
            demand += min(req.prompt_len - cached, floor)
        shares = fair_shares([r.prompt_len - r.num_computed_tokens for r in prefilling], budget)
        return sum(self._schedule_chunk(r, n, out) for r, n in zip(prefilling, shares, strict=True) if n)

    def _admit_handoff(self, req: Request, out: SchedulerOutput) -> bool:
        if self.block_manager.allocate(req, req.prompt_len, reserve_tokens=req.max_tokens,
                                       use_prefix_cache=False) is None:
            return False
        self._admit(req, RequestStatus.WAITING_FOR_HANDOFF, out)
        self._receiving[req.request_id] = req
        out.kv_receives.append(req)
        return True

    @property
    def invariant_chunk(self) -> int:
        """Batch-invariant prefill chunk: what the budget leaves beside a full decode batch, always."""
        return self.config.max_num_batched_tokens - self.config.max_num_seqs

    def _schedule_chunk(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        n = min(req.prompt_len - req.num_computed_tokens, budget)
        if self.config.batch_invariant:
            n = min(n, self.invariant_chunk)
        if not self.block_manager.grow(req, req.num_computed_tokens + n):
            raise RuntimeError(f"request {req.request_id!r} outgrew its reservation")
        out.prefills.append(PrefillChunk(req, req.num_computed_tokens, n))
        self._in_flight[req.request_id] = n
        return n

    def _admit(self, req: Request, status: RequestStatus, out: SchedulerOutput) -> None:
        del self._waiting[req.request_id]
        req.transition(status)
        req.slot = heapq.heappop(self._free_slots)
        out.new_requests.append(req)

    def _end(self, request_id: str, status: RequestStatus, reason: str) -> Request | None:
        req = self._waiting.pop(request_id, None)
        if req is not None:
            req.transition(status)
            req.error = reason
            self.stats.num_finished += 1
            return req
        req = self._running.get(request_id) or self._receiving.get(request_id)
        if req is None:
            self.stats.num_ignored_aborts += 1
            return None
        self._finish(req, status, reason)
        return req

    def _finish(self, req: Request, status: RequestStatus, reason: str | None = None) -> None:
        req.transition(status)
        req.error = reason
        self._running.pop(req.request_id, None)
        self._receiving.pop(req.request_id, None)
        self.block_manager.free(req)
        heapq.heappush(self._free_slots, req.slot)
        req.slot = None
        self.stats.num_finished += 1


def fair_shares(demands: Sequence[int], budget: int) -> list[int]:
    """Split ``budget`` tokens among ``demands`` (in FIFO order) by water-filling: every demand gets the same
    level, a demand below it gets all it asks and its leftover is shared again, and what cannot be split
    evenly goes one token each to the earliest. Every demand gets at least one token when there are no more
    demands than tokens; the sum never exceeds ``budget``."""
    shares = [0] * len(demands)
    open_ = [i for i, d in enumerate(demands) if d > 0]
    left = budget
    while open_ and left > 0:
        level = left // len(open_)
        if level == 0:
            for i in open_[:left]:
                shares[i] += 1
            break
        still = []
        for i in open_:
            give = min(level, demands[i] - shares[i])
            shares[i] += give
            left -= give
            if shares[i] < demands[i]:
                still.append(i)
        open_ = still
    return shares
