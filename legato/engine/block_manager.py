"""Paged KV-cache bookkeeping: which blocks each request holds, shared prompt blocks, reservations.

Only block ids move here; the KV tensor itself is sized once at start-up and owned by the model runner.

Reservations. ``allocate(req, n, reserve_tokens=...)`` hands out blocks for ``n`` tokens now and reserves,
without handing out, the blocks the request needs to reach ``reserve_tokens``. Reserved blocks stay in
the free pool (they are counted by ``num_reserved_blocks``) and only that request can draw on them, so a
request admitted with its whole life reserved never fails to grow. Invariant: ``num_free_blocks >=
num_reserved_blocks``.

Prefix caching. A full prompt block that has been computed is registered under the request's key for that
block. A later request whose keys match shares it (reference count + 1) and counts its tokens as computed.
A cached block whose count drops to zero stays in the free pool, still findable, until it is handed out
again: blocks without a key are handed out first, then cached ones, least recently freed first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable

from legato.engine.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._uncached_free: deque[int] = deque(range(num_blocks))
        # Free blocks that still hold a registered prefix, oldest freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cache: dict[Hashable, int] = {}
        self._block_key: list[Hashable | None] = [None] * num_blocks
        self._reserved: dict[str, int] = {}
        self._num_reserved = 0
        self._quarantined: set[int] = set()
        # Quarantined blocks whose count reached zero: out of the free pool until released.
        self._held: set[int] = set()

    # ---- queries -------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached-but-unused ones included); reserved ones included too."""
        return len(self._uncached_free) + len(self._evictable)

    @property
    def num_reserved_blocks(self) -> int:
        return self._num_reserved

    @property
    def num_available_blocks(self) -> int:
        """Free blocks not promised to any request."""
        return self.num_free_blocks - self._num_reserved

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or not."""
        return len(self._cache)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by requests or held in quarantine."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, n_tokens: int) -> int:
        return _cdiv(n_tokens, self.block_size)

    def can_allocate(self, n_tokens: int) -> bool:
        """Whether ``n_tokens`` fit in unpromised free blocks, ignoring prefix hits (so an upper bound on cost)."""
        return self.num_blocks_for(n_tokens) <= self.num_available_blocks

    def match_prefix(self, req: Request) -> int:
        """Prompt tokens of ``req`` whose KV is already cached. Changes nothing."""
        return len(self._match(req)) * self.block_size

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    # ---- allocation ----------------------------------------------------------------------------------

    def allocate(self, req: Request, n_tokens: int, reserve_tokens: int | None = None,
                 use_prefix_cache: bool = True) -> int | None:
        """Give ``req`` (which must hold no blocks) blocks covering ``n_tokens`` and reserve up to ``reserve_tokens``.

        Cached prompt blocks matching ``req.prefix_keys`` are shared first (unless ``use_prefix_cache`` is
        False). Returns the number of tokens found cached, or None, changing nothing, if the free pool
        cannot cover the blocks plus the reservation.
        """
        if req.block_table or req.request_id in self._reserved:
            raise RuntimeError(f"request {req.request_id!r} already holds blocks")
        reserve_tokens = n_tokens if reserve_tokens is None else reserve_tokens
        if reserve_tokens < n_tokens:
            raise ValueError(f"reserve_tokens ({reserve_tokens}) < n_tokens ({n_tokens})")
        hits = self._match(req) if use_prefix_cache else []
        revived = sum(1 for b in hits if self._ref[b] == 0)
        total = self.num_blocks_for(reserve_tokens)
        if (total - len(hits)) + revived > self.num_available_blocks:
            return None
        # Take the hits out of the free pool before handing out fresh blocks, which could evict them.
        for b in hits:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        req.block_table.extend(hits)
        fresh = max(0, self.num_blocks_for(n_tokens) - len(hits))
        req.block_table.extend(self._pop_free() for _ in range(fresh))
        reserve = total - len(req.block_table)
        if reserve:
            self._reserved[req.request_id] = reserve
            self._num_reserved += reserve
        return len(hits) * self.block_size

    def grow(self, req: Request, n_tokens: int) -> bool:
        """Extend ``req``'s table to cover ``n_tokens``, drawing on its reservation first.

        Returns False, changing nothing, if the blocks beyond its reservation are not available.
        """
        need = self.num_blocks_for(n_tokens) - len(req.block_table)
        if need <= 0:
            return True
        own = self._reserved.get(req.request_id, 0)
        from_own = min(need, own)
        if need - from_own > self.num_available_blocks:
            return False
        if from_own:
            self._num_reserved -= from_own
            if own == from_own:
                del self._reserved[req.request_id]
            else:
                self._reserved[req.request_id] = own - from_own
        req.block_table.extend(self._pop_free() for _ in range(need))
        return True

    def append_slot(self, req: Request) -> bool:
        """Make room for one more token after ``req.num_computed_tokens`` (a new block at a block boundary)."""
        return self.grow(req, req.num_computed_tokens + 1)

    def free(self, req: Request) -> None:
        """Drop ``req``'s blocks and reservation. Blocks reach the free pool when no one else shares them."""
        self._num_reserved -= self._reserved.pop(req.request_id, 0)
        # Tail first, so that among a chain's blocks the later ones are evicted first.
        for b in reversed(req.block_table):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._release(b)
        req.block_table.clear()

    def cache_blocks(self, req: Request, start: int, end: int) -> None:
        """Register the prompt blocks of ``req`` completed by computing tokens [start, end)."""
        if not self.enable_prefix_caching or not req.prefix_keys:
            return
        end = min(end, req.prompt_len)
        last = min(end // self.block_size, len(req.prefix_keys))
        for i in range(start // self.block_size, last):
            key, b = req.prefix_keys[i], req.block_table[i]
            # Another request may have computed the same prefix concurrently; keep the first copy.
            if key not in self._cache and self._block_key[b] is None and b not in self._quarantined:
                self._cache[key] = b
                self._block_key[b] = key

    # ---- quarantine (KV-transfer cancel) -------------------------------------------------------------

    def quarantine(self, blocks: Iterable[int]) -> None:
        """Keep in-use ``blocks`` out of the free pool after their owners free them, until released.

        For destination blocks of a cancelled transfer: a late write may still land in them. Their cached
        prefix, if any, is forgotten since their content can no longer be trusted.
        """
        blocks = list(blocks)
        for b in blocks:
            # Quarantining a free block could break promised reservations; only owned blocks qualify.
            if self._ref[b] == 0:
                raise ValueError(f"block {b} is not in use; only owned blocks can be quarantined")
        for b in blocks:
            self._quarantined.add(b)
            self._forget(b)

    def release_quarantine(self, blocks: Iterable[int]) -> None:
        """End quarantine; blocks no longer owned return to the free pool."""
        for b in blocks:
            self._quarantined.discard(b)
            if b in self._held:
                self._held.discard(b)
                self._uncached_free.append(b)

    @property
    def num_quarantined_blocks(self) -> int:
        return len(self._quarantined)

    # ---- internals -----------------------------------------------------------------------------------

    def _match(self, req: Request) -> list[int]:
        if not self.enable_prefix_caching or not req.prefix_keys:
            return []
        # The last prompt token is always computed, so its logits exist: never match the block holding it.
        usable = min(len(req.prefix_keys), (req.prompt_len - 1) // self.block_size)
        hits = []
        for key in req.prefix_keys[:usable]:
            b = self._cache.get(key)
            if b is None:
                break
            hits.append(b)
        return hits

    def _pop_free(self) -> int:
        if self._uncached_free:
            b = self._uncached_free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)
            self._forget(b)
        self._ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        if b in self._quarantined:
            self._held.add(b)
        elif self._block_key[b] is not None:
            self._evictable[b] = None
        else:
            self._uncached_free.append(b)

    def _forget(self, b: int) -> None:
        key = self._block_key[b]
        if key is not None:
            del self._cache[key]
            self._block_key[b] = None
