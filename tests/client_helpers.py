"""Requests and drivers shared by the topology tests (in-process MpNd, process MpNd, split)."""

from __future__ import annotations

import asyncio

import torch

from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline.client import SynthesisRequest

EMB = torch.randn(64, generator=torch.Generator().manual_seed(0))
REF = torch.randint(0, 2048, (9, 16), generator=torch.Generator().manual_seed(1))


def mixed_requests(n: int, prefix: str = "p") -> list[SynthesisRequest]:
    """Seeded sampling and greedy (every third), x-vector and in-context clones, of several lengths."""
    out = []
    for i in range(n):
        if i % 2:
            inp = SpeechInput(f"In context clone number {i}.", speaker_embedding=EMB, ref_code=REF,
                              ref_text="The reference transcript.")
        else:
            inp = SpeechInput(f"Plain sentence {i}, said twice.", language="english", speaker_embedding=EMB,
                              x_vector_only=True)
        greedy = i % 3 == 2
        params = SamplingParams(seed=40 + i, max_new_tokens=7 + i % 4, do_sample=not greedy,
                                subtalker_do_sample=not greedy)
        out.append(SynthesisRequest(f"{prefix}{i}", inp, params))
    return out


async def gather_streams(client, reqs, concurrency: int) -> list[list]:
    """Every request's chunks, at most `concurrency` streams at a time (the client already started)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(r):
        async with sem:
            return [c async for c in client.generate(r)]
    return await asyncio.gather(*(one(r) for r in reqs))


async def run_client(client, reqs, concurrency: int) -> list[list]:
    """Starts `client`, streams `reqs` through it (`gather_streams`) and stops it."""
    await client.start()
    try:
        return await gather_streams(client, reqs, concurrency)
    finally:
        await client.stop()
