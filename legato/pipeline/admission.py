"""The admission thread: requests made ready for the engine (tokens, voice, prompt) in batches.

Every request passes through here before the engine thread sees it. One request at a time, its prompt cost a
dozen small device launches and the GIL hand-overs around them, so a burst of a few hundred requests (a load
test's first wave, many clients at once) queued for hundreds of milliseconds before its last one reached the
engine. Now the thread takes everything queued (up to `max_batch`), does each request's host part (tokenising,
the voice, checks), and builds the batch's prompts together (`build_prompts`, a few launches for the batch plus
three per request). A request's prompt is the same, bit for bit, whatever it was batched with.

One thread, so requests leave in the order they came; a request that fails here fails alone.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from legato.engine.engine import EngineRequest
from legato.models.qwen3_tts.prompt import PromptSpec, TalkerPrompt
from legato.pipeline.threads import name_native_thread

log = logging.getLogger(__name__)

MAX_BATCH = 64


class AdmissionClosed(RuntimeError):
    """The admission thread stopped (the client is shutting down) before it took this request."""


@dataclasses.dataclass
class _Ticket:
    make: Callable[[], EngineRequest]  # the request's host part, on the admission thread
    done: Future  # its `marks` (set before its result): perf_counter() when the thread took it, and when built


class Admission:
    """One thread that turns `make()` (an EngineRequest without its prompt) into the request with its prompt.
    `build_prompts(specs)` gives each spec's prompt or the exception that refuses it; `needs_prompt(req)` says
    whether a request gets one here (an open in-context text may not have enough text yet)."""

    def __init__(self, build_prompts: Callable[[Sequence[PromptSpec]], list[TalkerPrompt | Exception]],
                 needs_prompt: Callable[[EngineRequest], bool], max_batch: int = MAX_BATCH,
                 name: str = "admission") -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._build = build_prompts
        self._needs_prompt = needs_prompt
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[_Ticket | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self.batches = 0  # batches prepared, and the requests in them (for tests and logs)
        self.requests = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)  # started by the first submit

    def submit(self, make: Callable[[], EngineRequest]) -> Future:
        """Queues a request; the future gives it back with its prompt, or raises what refused it. Its `marks`
        say when the thread took the request (`taken`) and when its prompt was built (`built`)."""
        ticket = _Ticket(make, Future())
        ticket.done.marks = {}
        with self._lock:
            if self._closed:
                ticket.done.set_exception(AdmissionClosed("admission has stopped"))
            else:
                if self._thread.ident is None:
                    self._thread.start()
                self._queue.put(ticket)
        return ticket.done

    def close(self, wait_s: float = 10.0) -> bool:
        """Stops the thread after the batch it is preparing (waiting up to `wait_s` for it); what is still queued
        fails with AdmissionClosed. True once the thread has ended. A thread left running at interpreter exit
        can be inside the device runtime while its statics are torn down, which aborts the process."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        if self._thread.ident is None:
            return True
        if self._thread is not threading.current_thread():
            self._thread.join(wait_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        name_native_thread()
        while True:
            batch = [self._queue.get()]
            while batch[-1] is not None and len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            tickets = [t for t in batch if t is not None]
            if self._closed:  # set before the stop is queued: what is left fails, then the thread ends
                for t in tickets:
                    if t.done.set_running_or_notify_cancel():
                        t.done.set_exception(AdmissionClosed("admission has stopped"))
                if len(tickets) < len(batch):
                    return
                continue
            self._prepare(tickets)

    def _build_alone(self, spec: PromptSpec) -> TalkerPrompt | Exception:
        try:
            return self._build([spec])[0]
        except Exception as e:
            return e

    def _prepare(self, batch: list[_Ticket]) -> None:
        prompted: list[tuple[_Ticket, EngineRequest]] = []
        taken = time.perf_counter()
        for t in batch:
            t.done.marks.update(taken=taken, built=taken)
            if not t.done.set_running_or_notify_cancel():
                continue  # its caller gave up
            try:
                req = t.make()
                if self._needs_prompt(req):
                    prompted.append((t, req))
                else:
                    t.done.set_result(req)
            except Exception as e:  # this request's own failure (bad text, a voice that fails to encode)
                t.done.set_exception(e)
        self.batches += 1
        self.requests += len(batch)
        if not prompted:
            return
        try:
            prompts = self._build([req.spec for _, req in prompted])
        except Exception:  # the batch's device work failed: each request again alone, so a bad one fails alone
            log.exception("building %d prompts together failed; building each alone", len(prompted))
            prompts = [self._build_alone(req.spec) for _, req in prompted]
        built = time.perf_counter()
        for (t, req), prompt in zip(prompted, prompts, strict=True):
            t.done.marks["built"] = built
            if isinstance(prompt, Exception):
                t.done.set_exception(prompt)
            else:
                t.done.set_result(dataclasses.replace(req, prompt=prompt))
