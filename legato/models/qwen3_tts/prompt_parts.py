"""Prompt pieces that many requests share, computed once per set of weights instead of once per request.

Every request's prompt starts with the same role prefix (`<|im_start|>assistant\\n`), projects its first text token
alone, and looks up the same codec control ids for its language. On the server these small launches run on the
admission thread, each a GIL release and re-acquisition beside the engine thread: at 256 streams a burst of new
requests queued behind them. A piece is cached only where recomputing it would give the same bits: the same ids
through the same layers at the same shape (a text projection of one token is always a one-row product; a lookup is
a gather). Keyed by the parameters' storage and version, so weights loaded in place start a new cache. Callers never
write into a cached tensor: every use makes a new one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from legato.layers.host import upload

from .talker import Talker

# Single tokens and prefixes held per set of weights (hidden 1024-2048: a few KB each).
MAX_ENTRIES = 8192


class PromptParts:
    """The cache of one talker (`parts_of`)."""

    def __init__(self, key: tuple) -> None:
        self.key = key
        self._lock = threading.Lock()  # admission, warm-up and the offline API may build prompts on other threads
        self._text: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self._codec: dict[tuple[int, ...], torch.Tensor] = {}
        self._zero: torch.Tensor | None = None

    def text(self, talker: Talker, ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """T(ids) [len(ids), H], as `talker.embed_text` gives it for these ids uploaded as one tensor."""
        with self._lock:
            hit = self._text.get(ids)
            if hit is not None:
                self._text.move_to_end(ids)
                return hit
        value = talker.embed_text(upload(torch.tensor(ids, dtype=torch.long), device))
        with self._lock:
            self._text[ids] = value
            while len(self._text) > MAX_ENTRIES:
                self._text.popitem(last=False)
        return value

    def zero_row(self, talker: Talker) -> torch.Tensor:
        """A [1, H] row of zeros in the talker's dtype, on its device (what a prompt row's missing track adds)."""
        if self._zero is None:
            weight = talker.codec_head.weight
            self._zero = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        return self._zero

    def codec(self, talker: Talker, ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The codec embedding rows of `ids` (control ids: a handful of distinct tuples per model)."""
        with self._lock:
            hit = self._codec.get(ids)
        if hit is None:
            hit = talker.embed_codec(upload(torch.tensor(ids, dtype=torch.long), device))
            with self._lock:
                self._codec[ids] = hit
        return hit


def parts_of(talker: Talker) -> PromptParts:
    """`talker`'s cache for its current weights (a new one once its text or codec weights changed)."""
    proj = talker.text_projection
    params = (talker.model.text_embedding.weight, proj.linear_fc1.weight, proj.linear_fc1.bias,
              proj.linear_fc2.weight, proj.linear_fc2.bias, talker.model.codec_embedding.weight)  # named, not walked:
    key = tuple((p.data_ptr(), p._version) for p in params)  # this runs once per batch of prompts
    cached = getattr(talker, "_prompt_parts", None)
    if cached is None or cached.key != key:
        cached = PromptParts(key)
        talker._prompt_parts = cached
    return cached
