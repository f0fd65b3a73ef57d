import pytest

from legato.engine.block_manager import BlockManager
from legato.engine.request import Request

BS = 4


def req(rid: str, prompt_len: int = 10, max_frames: int = 5, keys=None) -> Request:
    return Request(rid, prompt_len=prompt_len, max_frames=max_frames, prefix_keys=keys)


def chain(*names: str) -> list[tuple[str, ...]]:
    """Prefix keys as a chain: key i names every block up to i."""
    return [tuple(names[: i + 1]) for i in range(len(names))]


def computed(bm: BlockManager, r: Request, n_tokens: int) -> None:
    """Pretend the runner computed the first n_tokens of r's prompt."""
    bm.cache_blocks(r, r.num_computed_tokens, n_tokens)
    r.num_computed_tokens = n_tokens


def check_refs(bm: BlockManager, *reqs: Request) -> None:
    """Reference counts equal the number of tables holding each block; the free pool is the rest."""
    counts = [0] * bm.num_blocks
    for r in reqs:
        for b in r.block_table:
            counts[b] += 1
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == counts
    assert bm.num_free_blocks == counts.count(0) - (len(bm._held))
    assert bm.num_free_blocks >= bm.num_reserved_blocks >= 0


# ---- plain allocation --------------------------------------------------------------------------------

def test_allocate_and_free():
    bm = BlockManager(8, BS)
    a, b = req("a"), req("b")
    assert bm.allocate(a, 10) == 0
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.allocate(b, 4) == 0
    assert len(b.block_table) == 1 and not set(a.block_table) & set(b.block_table)
    check_refs(bm, a, b)
    assert bm.usage == pytest.approx(4 / 8)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 7
    check_refs(bm, b)
    bm.free(b)
    bm.free(b)  # a second free is a no-op
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_allocate_returns_none_when_full_and_changes_nothing():
    bm = BlockManager(4, BS)
    a, b = req("a"), req("b")
    assert bm.allocate(a, 12) == 0
    assert not bm.can_allocate(5)
    assert bm.can_allocate(4)
    assert bm.allocate(b, 5) is None
    assert b.block_table == [] and bm.num_free_blocks == 1
    assert bm.allocate(b, 4) == 0
    assert bm.num_free_blocks == 0
    c = req("c")
    assert bm.allocate(c, 1) is None
    check_refs(bm, a, b)


def test_allocate_twice_raises():
    bm = BlockManager(4, BS)
    a = req("a")
    bm.allocate(a, 1)
    with pytest.raises(RuntimeError, match="already holds"):
        bm.allocate(a, 1)


def test_append_slot_allocates_only_at_block_boundaries():
    bm = BlockManager(4, BS)
    a = req("a")
    bm.allocate(a, 3)
    a.num_computed_tokens = 3
    assert bm.append_slot(a) and len(a.block_table) == 1  # token 3 fits block 0
    a.num_computed_tokens = 4
    assert bm.append_slot(a) and len(a.block_table) == 2  # token 4 opens block 1
    a.num_computed_tokens = 5
    assert bm.append_slot(a) and len(a.block_table) == 2
    check_refs(bm, a)


def test_append_slot_fails_when_full():
    bm = BlockManager(2, BS)
    a, b = req("a"), req("b")
    bm.allocate(a, 4)
    bm.allocate(b, 4)
    a.num_computed_tokens = 4
    assert bm.append_slot(a) is False
    assert len(a.block_table) == 1
    bm.free(b)
    assert bm.append_slot(a) is True and len(a.block_table) == 2


# ---- reservations ------------------------------------------------------------------------------------

def test_reservation_is_kept_for_its_owner():
    bm = BlockManager(6, BS)
    a, b = req("a"), req("b")
    assert bm.allocate(a, 4, reserve_tokens=16) == 0  # 1 block now, 3 promised
    assert bm.num_free_blocks == 5 and bm.num_reserved_blocks == 3 and bm.num_available_blocks == 2
    assert not bm.can_allocate(12)
    assert bm.allocate(b, 12) is None  # would eat a's reservation
    assert bm.allocate(b, 8) == 0
    assert bm.num_available_blocks == 0
    # a still grows to its full life, b cannot grow at all.
    for n in range(4, 16):
        a.num_computed_tokens = n
        assert bm.append_slot(a)
    assert len(a.block_table) == 4 and bm.num_reserved_blocks == 0
    b.num_computed_tokens = 8
    assert not bm.append_slot(b)
    check_refs(bm, a, b)


def test_grow_beyond_reservation_uses_available_blocks():
    bm = BlockManager(6, BS)
    a = req("a")
    bm.allocate(a, 4, reserve_tokens=8)
    assert bm.grow(a, 16)  # 1 reserved + 2 unpromised
    assert len(a.block_table) == 4 and bm.num_reserved_blocks == 0
    assert not bm.grow(a, 40)
    assert len(a.block_table) == 4
    check_refs(bm, a)


def test_free_releases_reservation():
    bm = BlockManager(6, BS)
    a = req("a")
    bm.allocate(a, 1, reserve_tokens=24)
    assert bm.num_reserved_blocks == 5 and bm.num_available_blocks == 0
    bm.free(a)
    assert bm.num_reserved_blocks == 0 and bm.num_available_blocks == 6


def test_reserve_less_than_allocated_raises():
    bm = BlockManager(6, BS)
    with pytest.raises(ValueError):
        bm.allocate(req("a"), 8, reserve_tokens=4)


# ---- prefix caching ----------------------------------------------------------------------------------

def test_prefix_blocks_are_shared_after_they_are_computed():
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    keys = chain("x", "y", "z")
    a = req("a", prompt_len=13, keys=keys)
    assert bm.allocate(a, 13) == 0
    b = req("b", prompt_len=13, keys=keys)
    assert bm.match_prefix(b) == 0  # a has not computed anything yet
    computed(bm, a, 8)
    assert bm.num_cached_blocks == 2 and bm.match_prefix(b) == 8
    computed(bm, a, 13)
    assert bm.num_cached_blocks == 3 and bm.match_prefix(b) == 12
    free_before = bm.num_free_blocks
    assert bm.allocate(b, 13) == 12
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert [bm.ref_count(x) for x in b.block_table] == [2, 2, 2, 1]
    assert bm.num_free_blocks == free_before - 1
    check_refs(bm, a, b)
    bm.free(a)
    assert [bm.ref_count(x) for x in b.block_table] == [1, 1, 1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 10 and bm.num_cached_blocks == 3


def test_block_holding_the_last_prompt_token_is_never_matched():
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    keys = chain("x", "y")
    a = req("a", prompt_len=8, keys=keys)
    bm.allocate(a, 8)
    computed(bm, a, 8)
    assert bm.num_cached_blocks == 2
    # Same 8-token prompt: the second block holds the last token, which must be recomputed for its logits.
    assert bm.match_prefix(req("b", prompt_len=8, keys=keys)) == 4
    assert bm.match_prefix(req("c", prompt_len=9, keys=keys)) == 8


def test_match_stops_at_first_miss():
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    a = req("a", prompt_len=13, keys=chain("x", "y", "z"))
    bm.allocate(a, 13)
    computed(bm, a, 13)
    assert bm.match_prefix(req("b", prompt_len=13, keys=chain("x", "q", "z"))) == 4
    assert bm.match_prefix(req("c", prompt_len=13, keys=chain("q", "y", "z"))) == 0
    assert bm.match_prefix(req("d", prompt_len=13)) == 0


def test_prefix_caching_off_never_shares():
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    keys = chain("x", "y", "z")
    a = req("a", prompt_len=13, keys=keys)
    bm.allocate(a, 13)
    computed(bm, a, 13)
    assert bm.num_cached_blocks == 0 and bm.match_prefix(req("b", prompt_len=13, keys=keys)) == 0


def test_use_prefix_cache_false_skips_matching():
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    keys = chain("x", "y", "z")
    a = req("a", prompt_len=13, keys=keys)
    bm.allocate(a, 13)
    computed(bm, a, 13)
    b = req("b", prompt_len=13, keys=keys)
    assert bm.allocate(b, 13, use_prefix_cache=False) == 0
    assert not set(a.block_table) & set(b.block_table)


def test_freed_cached_blocks_stay_reusable():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    keys = chain("x", "y")
    a = req("a", prompt_len=9, keys=keys)
    bm.allocate(a, 9)
    computed(bm, a, 9)
    shared = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    b = req("b", prompt_len=9, keys=keys)
    assert bm.allocate(b, 9) == 8
    assert b.block_table[:2] == shared
    assert bm.num_free_blocks == 1
    check_refs(bm, b)


def test_uncached_blocks_are_handed_out_before_cached_ones():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = req("a", prompt_len=9, keys=chain("x", "y"))
    bm.allocate(a, 9)
    computed(bm, a, 9)
    bm.free(a)
    other = req("o")
    bm.allocate(other, 8)  # two blocks: the two uncached ones
    assert bm.num_cached_blocks == 2
    assert bm.match_prefix(req("b", prompt_len=9, keys=chain("x", "y"))) == 8


def test_eviction_is_lru_and_tail_first():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    old = req("old", prompt_len=9, keys=chain("o1", "o2"))
    new = req("new", prompt_len=9, keys=chain("n1", "n2"))
    for r in (old, new):
        bm.allocate(r, 9)
        computed(bm, r, 9)
    bm.free(old)
    bm.free(new)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6
    # Two uncached blocks go first, then one eviction: the tail of the oldest chain.
    bm.allocate(req("x"), 12)
    assert bm.num_cached_blocks == 3
    assert bm.match_prefix(req("o", prompt_len=9, keys=chain("o1", "o2"))) == 4
    assert bm.match_prefix(req("n", prompt_len=9, keys=chain("n1", "n2"))) == 8
    bm.allocate(req("y"), 4)  # evicts o1
    assert bm.match_prefix(req("o", prompt_len=9, keys=chain("o1", "o2"))) == 0
    assert bm.match_prefix(req("n", prompt_len=9, keys=chain("n1", "n2"))) == 8


def test_hits_are_not_evicted_by_their_own_allocation():
    bm = BlockManager(3, BS, enable_prefix_caching=True)
    keys = chain("x", "y")
    a = req("a", prompt_len=9, keys=keys)
    bm.allocate(a, 9)
    computed(bm, a, 9)
    bm.free(a)
    # All 3 blocks are free; 2 are cached. b needs its 2 hits plus 1 fresh block: exactly fits.
    b = req("b", prompt_len=9, keys=keys)
    assert bm.allocate(b, 9) == 8
    assert len(set(b.block_table)) == 3 and bm.num_cached_blocks == 2
    check_refs(bm, b)


def test_revived_hits_count_against_capacity():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    keys = chain("x", "y")
    a = req("a", prompt_len=9, keys=keys)
    bm.allocate(a, 9)
    computed(bm, a, 9)
    bm.free(a)
    hog = req("hog")
    bm.allocate(hog, 4)  # the uncached free block
    b = req("b", prompt_len=9, max_frames=4, keys=keys)
    # Whole life is 13 tokens = 4 blocks: 2 revived hits + 2 fresh, but only 3 blocks are free.
    assert bm.allocate(b, 9, reserve_tokens=13) is None
    assert b.block_table == [] and bm.num_cached_blocks == 2
    bm.free(hog)
    assert bm.allocate(b, 9, reserve_tokens=13) == 8
    check_refs(bm, b)


def test_duplicate_prefix_keeps_first_copy():
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    keys = chain("x", "y")
    a, b = req("a", prompt_len=9, keys=keys), req("b", prompt_len=9, keys=keys)
    bm.allocate(a, 9)
    bm.allocate(b, 9)  # both compute the same prefix concurrently
    computed(bm, a, 9)
    computed(bm, b, 9)
    assert bm.num_cached_blocks == 2
    c = req("c", prompt_len=9, keys=keys)
    bm.allocate(c, 9)
    assert c.block_table[:2] == a.block_table[:2]
    for r in (a, b, c):
        bm.free(r)
    assert bm.num_free_blocks == 10


# ---- quarantine --------------------------------------------------------------------------------------

def test_quarantine_holds_blocks_until_released():
    bm = BlockManager(4, BS)
    a = req("a")
    bm.allocate(a, 8)
    blocks = list(a.block_table)
    bm.quarantine(blocks)
    assert bm.num_quarantined_blocks == 2
    bm.free(a)
    assert bm.num_free_blocks == 2 and bm.usage == pytest.approx(0.5)
    b = req("b")
    assert bm.allocate(b, 12) is None
    bm.release_quarantine(blocks)
    assert bm.num_free_blocks == 4 and bm.num_quarantined_blocks == 0
    assert bm.allocate(b, 12) == 0


def test_release_before_free_returns_blocks_normally():
    bm = BlockManager(4, BS)
    a = req("a")
    bm.allocate(a, 8)
    bm.quarantine(a.block_table)
    bm.release_quarantine(list(a.block_table))
    bm.free(a)
    assert bm.num_free_blocks == 4


def test_quarantine_of_free_block_raises():
    bm = BlockManager(4, BS)
    with pytest.raises(ValueError, match="not in use"):
        bm.quarantine([0])
    assert bm.num_quarantined_blocks == 0


def test_quarantined_cached_block_is_forgotten():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    keys = chain("x", "y")
    a = req("a", prompt_len=9, keys=keys)
    bm.allocate(a, 9)
    computed(bm, a, 9)
    assert bm.num_cached_blocks == 2
    bm.quarantine(a.block_table[:1])
    assert bm.num_cached_blocks == 1
    assert bm.match_prefix(req("b", prompt_len=9, keys=keys)) == 0
