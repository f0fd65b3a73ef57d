"""`legato bench serve --client-procs N`: the bench client run in N processes, its results merged exactly.

One Python process parsing HTTP for hundreds of streams can be the limit of a run (its event loop falls
behind, chunks are read late, TTFP grows on the client's side). Here each process runs the ordinary client
(`client.run_benchmark`) on a share of the requests and of the concurrency cap, all processes start their
timed runs together (a barrier after their warm-ups), and their records are merged back into one run:

- request i goes to process i mod N, with its planned send time from the one arrival process of the whole
  run, and comes back as record i: the records are the same list a single process would have made;
- every time is moved onto one clock, the earliest process start (`time.perf_counter` is the system-wide
  CLOCK_MONOTONIC on Linux, so the processes of one host share it); the duration runs from that start to
  the last process's end;
- aggregates (TTFP percentiles and the rest) are then computed from the union of the records, never as an
  average of per-process figures.

The cap is split: process p takes ceil/floor(cap / N) in-flight requests, so a slot one process leaves idle
is not taken by another; with equal lengths and all requests at once this is the same load.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier

from .client import ClientConfig, RunOutput, arrival_offsets, run_benchmark
from .datasets import BenchRequest
from .metrics import RequestRecord

START_TIMEOUT_S = 600.0  # how long a process waits at the barrier for the others' warm-ups


def split(n: int, procs: int) -> list[list[int]]:
    """Request indices of each process: round robin, so each gets the same mix of lengths."""
    return [list(range(p, n, procs)) for p in range(procs)]


def share(cap: int | None, procs: int, p: int) -> int | None:
    """Process p's share of the in-flight cap (None: uncapped); the shares add up to the cap."""
    if cap is None:
        return None
    return cap // procs + (1 if p < cap % procs else 0)


def merge(parts: list[tuple[list[int], RunOutput]], n: int) -> RunOutput:
    """One run from the runs of several processes: `parts[p] = (indices of process p's requests, its output)`.
    Records come back in request order with their global index, every time on the earliest start's clock."""
    t0 = min(out.t0_s for _, out in parts)
    records: list[RequestRecord | None] = [None] * n
    warmups: list[RequestRecord] = []
    for indices, out in parts:
        shift = out.t0_s - t0
        for i, rec in zip(indices, out.records, strict=True):
            records[i] = dataclasses.replace(rec, index=i, scheduled_s=rec.scheduled_s + shift,
                                             sent_s=None if rec.sent_s is None else rec.sent_s + shift)
        warmups.extend(out.warmups)
    if any(r is None for r in records):
        raise ValueError("the processes' records do not cover every request")
    warmups = [dataclasses.replace(r, index=k) for k, r in enumerate(warmups)]
    duration = max(out.t0_s + out.duration_s for _, out in parts) - t0
    first = min((out for _, out in parts), key=lambda o: o.t0_s)
    check = next((out for _, out in parts if out.check_pcm), None)
    warnings = [{**w, "process": p} for p, (_, out) in enumerate(parts) for w in out.warnings]
    return RunOutput(records, warmups, duration, first.started_at, check.check_pcm if check else None,
                     check.check_utt_id if check else None, warnings, t0)


def _child(cfg: ClientConfig, requests: list[BenchRequest], offsets: list[float], barrier: Barrier,
           conn: Connection) -> None:
    import asyncio

    try:
        out = asyncio.run(run_benchmark(cfg, requests, offsets, lambda: barrier.wait(START_TIMEOUT_S)))
        conn.send(("ok", out))
    except BaseException as e:  # the parent reports it; the barrier is broken so no sibling waits forever
        barrier.abort()
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def run_processes(cfg: ClientConfig, requests: list[BenchRequest], procs: int) -> RunOutput:
    """The whole run in `procs` client processes (see the module doc); `procs == 1` runs in this process."""
    if procs < 1:
        raise ValueError("client processes must be >= 1")
    if procs == 1:
        from .client import run

        return run(cfg, requests)
    procs = min(procs, len(requests), cfg.max_concurrency or len(requests))  # every process gets work and a slot
    if procs == 1:
        return run_processes(cfg, requests, 1)
    offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.seed)
    groups = split(len(requests), procs)
    ctx = mp.get_context("spawn")  # a clean interpreter: no event loop or sockets inherited
    barrier = ctx.Barrier(procs)
    children, pipes = [], []
    for p, idx in enumerate(groups):
        warm = cfg.num_warmups // procs + (1 if p < cfg.num_warmups % procs else 0)
        pcfg = dataclasses.replace(cfg, max_concurrency=share(cfg.max_concurrency, procs, p), num_warmups=warm,
                                   progress=cfg.progress and p == 0)
        here, there = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child, args=(pcfg, [requests[i] for i in idx], [offsets[i] for i in idx],
                                                 barrier, there), name=f"bench-client-{p}", daemon=True)
        child.start()
        there.close()
        children.append(child)
        pipes.append(here)
    outputs, errors = [], []
    for p, (child, pipe) in enumerate(zip(children, pipes, strict=True)):
        try:
            status, value = pipe.recv()
        except EOFError:  # it died without a word (killed, out of memory)
            barrier.abort()
            child.join()
            status, value = "error", f"exit code {child.exitcode}"
        child.join()
        (outputs if status == "ok" else errors).append((p, value))
    if errors:
        raise RuntimeError("bench client processes failed: " + "; ".join(f"process {p}: {e}" for p, e in errors))
    return merge([(groups[p], out) for p, out in outputs], len(requests))
