"""BlockPool / BlockTable bookkeeping, checked with exact block ids (allocation is deterministic)."""

from __future__ import annotations

import hashlib

import pytest

from mlxcel_core.kv.block_pool import (
    ROOT_HASH,
    BlockPool,
    BlockTable,
    NoFreeBlocks,
    PrefixCacheStats,
    hash_block_tokens,
)


def cached_table(pool: BlockPool, tokens: list[int]) -> BlockTable:
    """A sequence that matched what it could, computed the rest, and offered its full blocks."""
    table = BlockTable(pool)
    table.match_prefix(tokens)
    table.ensure_capacity(len(tokens))
    table.cache_full_blocks(tokens)
    return table


def test_allocate_lowest_ids_first_and_exhaustion_changes_nothing():
    pool = BlockPool(4, block_size=4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.allocate(0) == []
    assert pool.num_available() == 1
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.num_available() == 1
    assert [pool.refcount(b) for b in range(4)] == [1, 1, 1, 0]
    assert pool.allocate(1) == [3]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)


def test_release_returns_blocks_to_the_free_list():
    pool = BlockPool(4, block_size=4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.release([1])
    assert pool.refcount(1) == 0
    assert pool.num_available() == 2
    assert pool.allocate(1) == [1]
    pool.release([2, 0])
    assert pool.allocate(2) == [0, 2]  # lowest id first, whatever the release order
    assert pool.stats == PrefixCacheStats()  # nothing cached, nothing evicted


def test_high_water_is_one_past_the_highest_id_ever_handed_out():
    pool = BlockPool(8, block_size=4)
    assert pool.high_water == 0
    assert pool.allocate(3) == [0, 1, 2] and pool.high_water == 3
    pool.release([0, 1, 2])
    assert pool.allocate(2) == [0, 1] and pool.high_water == 3  # reuse below the mark does not move it
    assert pool.allocate(3) == [2, 3, 4] and pool.high_water == 5
    with pytest.raises(NoFreeBlocks):
        pool.allocate(4)
    assert pool.high_water == 5  # a refused allocation hands out nothing


def test_forget_cached_frees_evictable_blocks_and_keeps_held_ones():
    pool = BlockPool(8, block_size=2)
    kept, dropped = BlockTable(pool), BlockTable(pool)
    kept.ensure_capacity(4)  # blocks 0, 1
    dropped.ensure_capacity(6)  # blocks 2, 3, 4
    kept.cache_full_blocks([1, 2, 3, 4])
    dropped.cache_full_blocks([5, 6, 7, 8, 9, 10])
    dropped.free()
    assert pool.num_available() == 8 - 2 and pool.high_water == 5
    assert pool.forget_cached() == 3
    assert [pool.is_cached(b) for b in range(5)] == [True, True, False, False, False]
    assert pool.match_prefix([5, 6, 7, 8, 9, 10, 11]) == []  # forgotten
    assert pool.match_prefix([1, 2, 3, 4, 0]) == [0, 1]  # still held, still cached
    assert pool.allocate(2) == [2, 3]  # free again, lowest id first
    assert pool.high_water == 5 and pool.stats.evictions == 0
    assert pool.forget_cached() == 0


def test_release_more_than_held_is_rejected_whole():
    pool = BlockPool(4, block_size=4)
    pool.allocate(2)
    with pytest.raises(ValueError):
        pool.release([0, 1, 1])
    assert [pool.refcount(0), pool.refcount(1)] == [1, 1]
    assert pool.num_available() == 2


def test_two_tables_share_a_matched_prefix():
    pool = BlockPool(16, block_size=4)
    prompt = list(range(10))  # two full blocks + 2 tokens
    t1 = cached_table(pool, prompt)
    assert t1.blocks == [0, 1, 2]
    assert pool.is_cached(0) and pool.is_cached(1) and not pool.is_cached(2)

    t2 = BlockTable(pool)
    assert t2.match_prefix(prompt) == 8
    assert t2.blocks == [0, 1] and t2.num_tokens == 8
    assert [pool.refcount(b) for b in (0, 1, 2)] == [2, 2, 1]
    t2.ensure_capacity(10)
    assert t2.blocks == [0, 1, 3]
    assert t2.slot(9) == 3 * 4 + 1
    assert t1.slot(9) == 2 * 4 + 1

    t1.free()
    assert [pool.refcount(b) for b in (0, 1, 2, 3)] == [1, 1, 0, 1]
    t2.free()
    assert [pool.refcount(b) for b in (0, 1, 2, 3)] == [0, 0, 0, 0]
    assert pool.num_available() == 16
    assert pool.stats == PrefixCacheStats(hits=1, queries=2, cached_tokens=8, evictions=0)


def test_match_prefix_on_a_long_prompt_with_block_size_32():
    pool = BlockPool(16, block_size=32)
    prompt = list(range(1000, 1110))  # 110 tokens: 3 full blocks + 14
    first = cached_table(pool, prompt)
    assert first.blocks == [0, 1, 2, 3]
    assert pool.stats == PrefixCacheStats(hits=0, queries=1, cached_tokens=0)

    follow_up = prompt + [7, 8, 9]  # same prompt, different continuation
    assert pool.match_prefix(follow_up) == [0, 1, 2]
    assert pool.stats == PrefixCacheStats(hits=1, queries=2, cached_tokens=96)
    assert pool.match_prefix(list(range(50))) == []  # a miss counts as a query only
    assert pool.stats == PrefixCacheStats(hits=1, queries=3, cached_tokens=96)


def test_prompt_of_exactly_two_full_blocks_matches_only_one():
    pool = BlockPool(8, block_size=4)
    prompt = list(range(8))
    cached_table(pool, prompt)  # blocks [0, 1], both full and cached
    assert pool.is_cached(0) and pool.is_cached(1)
    assert pool.match_prefix(prompt) == [0]  # the last token must stay uncached
    assert pool.match_prefix(prompt + [99]) == [0, 1]
    assert pool.match_prefix(prompt[:4]) == []
    assert pool.match_prefix([]) == []
    assert pool.stats.cached_tokens == 4 + 8


def test_divergent_suffix_matches_only_the_common_full_blocks():
    pool = BlockPool(16, block_size=4)
    a, b, c, x = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [0, 0, 0, 0]
    cached_table(pool, a + b + c + [13])  # blocks [0, 1, 2, 3]; 0..2 cached

    assert pool.match_prefix(a + x + c + [13]) == [0]
    # Same block tokens under a different parent must not match (hash chaining).
    assert pool.match_prefix(x + b + c + [13]) == []
    assert pool.match_prefix(a + b + x + [13]) == [0, 1]

    # Registering the divergent sequence gives its blocks their own hashes.
    pool = BlockPool(16, block_size=4)
    first = cached_table(pool, a + b + c + [13])
    other = cached_table(pool, a + x + c + [13])
    assert first.blocks == [0, 1, 2, 3]
    assert other.blocks == [0, 4, 5, 6]
    assert all(pool.is_cached(blk) for blk in (0, 1, 2, 4, 5))
    assert pool.match_prefix(a + x + c + [1]) == [0, 4, 5]
    assert pool.match_prefix(a + b + c + [1]) == [0, 1, 2]


def test_duplicate_hash_keeps_the_existing_block():
    pool = BlockPool(8, block_size=4)
    prompt = list(range(9))
    t1, t2 = BlockTable(pool), BlockTable(pool)
    t1.ensure_capacity(9)  # both computed the prompt before either cached it
    t2.ensure_capacity(9)
    assert (t1.blocks, t2.blocks) == ([0, 1, 2], [3, 4, 5])
    t1.cache_full_blocks(prompt)
    t2.cache_full_blocks(prompt)
    assert [pool.is_cached(b) for b in range(6)] == [True, True, False, False, False, False]
    t2.free()  # uncached duplicates go straight back to the free list
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.match_prefix(prompt) == [0, 1]


def test_cache_full_blocks_is_idempotent_and_grows_with_the_sequence():
    pool = BlockPool(8, block_size=4)
    tokens = list(range(6))
    table = cached_table(pool, tokens)  # blocks [0, 1]; only block 0 full
    assert not pool.is_cached(1)
    tokens += [6, 7, 8]  # decoding fills block 1 and spills into block 2
    table.ensure_capacity(len(tokens))
    table.cache_full_blocks(tokens)
    table.cache_full_blocks(tokens)
    assert table.blocks == [0, 1, 2]
    assert [pool.is_cached(b) for b in (0, 1, 2)] == [True, True, False]
    assert pool.match_prefix(tokens) == [0, 1]


def test_copy_on_write_exclusive_shared_and_cached():
    pool = BlockPool(6, block_size=4)
    assert pool.allocate(1) == [0]
    assert pool.copy_on_write(0) == (0, False)  # exclusive, uncached: write in place
    assert pool.refcount(0) == 1

    # Shared by a fork: the writer gets a fresh block, the other sequence keeps the old one.
    parent = BlockTable(pool)
    parent.ensure_capacity(3)
    assert parent.blocks == [1]
    child = parent.fork()
    assert child.blocks == [1] and child.num_tokens == 3 and pool.refcount(1) == 2
    assert pool.copy_on_write(1) == (2, True)
    assert (pool.refcount(1), pool.refcount(2)) == (1, 1)

    # Shared through the prefix cache.
    table = cached_table(pool, [1, 2, 3, 4, 5])
    assert table.blocks == [3, 4] and pool.is_cached(3)
    assert pool.match_prefix([1, 2, 3, 4, 5]) == [3]
    assert pool.copy_on_write(3) == (5, True)
    assert pool.refcount(3) == 1

    # Exclusive but registered as a prefix block: writing in place would corrupt the cache.
    pool.release([5, 2, 4])
    assert pool.copy_on_write(3) == (2, True)
    assert pool.refcount(3) == 0 and pool.is_cached(3)  # kept, now evictable
    assert pool.num_available() == 3  # 4, 5 free; 3 evictable

    # No room for the copy: nothing changes.
    assert pool.allocate(2) == [4, 5]
    assert pool.match_prefix([1, 2, 3, 4, 5]) == [3]  # revived; nothing left available
    with pytest.raises(NoFreeBlocks):
        pool.copy_on_write(3)
    assert pool.refcount(3) == 1 and pool.num_available() == 0
    with pytest.raises(ValueError):
        BlockPool(2).copy_on_write(0)  # not held
    with pytest.raises(ValueError):
        BlockPool(2).share([0])


def test_eviction_is_lru_by_release_order():
    pool = BlockPool(4, block_size=4)
    prompt_a = [1, 2, 3, 4, 5]
    prompt_b = [6, 7, 8, 9, 10]
    a = cached_table(pool, prompt_a)
    b = cached_table(pool, prompt_b)
    assert (a.blocks, b.blocks) == ([0, 1], [2, 3])
    a.free()  # 1 -> free list, 0 -> evictable
    b.free()  # 3 -> free list, 2 -> evictable (released after A's)
    assert pool.num_available() == 4

    assert pool.allocate(2) == [1, 3]  # free blocks go before any cached one
    assert pool.stats.evictions == 0
    assert pool.allocate(1) == [0]  # A's block was released first: evicted first
    assert pool.stats.evictions == 1
    assert not pool.is_cached(0)
    assert pool.match_prefix(prompt_a) == []  # its hash is gone
    assert pool.match_prefix(prompt_b) == [2]  # B's survived, and is revived
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    assert pool.stats.evictions == 1


def test_evicted_block_is_reused_under_a_new_hash():
    pool = BlockPool(2, block_size=4)
    cached_table(pool, [1, 2, 3, 4, 5]).free()  # block 0 evictable, block 1 free
    t = cached_table(pool, [9, 9, 9, 9, 9])  # takes 1 (free), then evicts 0
    assert t.blocks == [1, 0]
    assert pool.stats.evictions == 1
    assert pool.match_prefix([9, 9, 9, 9, 9]) == [1]
    assert pool.match_prefix([1, 2, 3, 4, 5]) == []


def test_reviving_an_evictable_block_removes_it_from_eviction():
    pool = BlockPool(3, block_size=4)
    prompt = list(range(9))  # blocks [0, 1, 2]; 0 and 1 full and cached
    cached_table(pool, prompt).free()  # tail first: 2 -> free, then 1, then 0 evictable
    assert pool.num_available() == 3
    assert pool.match_prefix(prompt[:5]) == [0]  # revives block 0
    assert pool.refcount(0) == 1
    assert pool.num_available() == 2
    assert pool.allocate(2) == [2, 1]  # free 2, then evict 1; block 0 is untouchable
    assert pool.stats.evictions == 1
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    assert pool.match_prefix(prompt) == [0]  # block 1's hash went with its eviction


def test_table_free_evicts_the_tail_before_the_root():
    pool = BlockPool(3, block_size=4)
    cached_table(pool, list(range(9))).free()
    pool.allocate(1)  # the free block 2
    assert pool.allocate(1) == [1]  # the tail block goes first ...
    assert pool.match_prefix(list(range(9))) == [0]  # ... so the root still matches


def test_block_table_capacity_is_all_or_nothing_and_slots_are_flat():
    pool = BlockPool(3, block_size=4)
    t = BlockTable(pool)
    t.ensure_capacity(5)
    assert t.blocks == [0, 1] and t.num_tokens == 5
    t.ensure_capacity(8)  # still fits
    assert t.blocks == [0, 1] and t.num_tokens == 8
    assert [t.slot(p) for p in (0, 3, 4, 7)] == [0, 3, 4, 7]
    with pytest.raises(IndexError):
        t.slot(8)

    other = BlockTable(pool)
    with pytest.raises(NoFreeBlocks):
        other.ensure_capacity(9)  # needs 3, only 1 available
    assert other.blocks == [] and pool.num_available() == 1
    other.ensure_capacity(2)
    assert other.blocks == [2]
    assert other.slot(1) == 2 * 4 + 1

    t.free()
    assert t.blocks == [] and t.num_tokens == 0
    assert pool.num_available() == 2
    with pytest.raises(ValueError):
        other.match_prefix([1, 2, 3])  # only an empty table starts from a cached prefix


def test_prefix_cache_disabled():
    pool = BlockPool(4, block_size=4, enable_prefix_cache=False)
    prompt = list(range(9))
    t = cached_table(pool, prompt)
    assert t.blocks == [0, 1, 2]
    assert not any(pool.is_cached(b) for b in range(4))
    assert pool.match_prefix(prompt) == []
    assert pool.copy_on_write(0) == (0, False)
    t.free()
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert pool.stats == PrefixCacheStats()


def test_block_hash_is_chained_sha256():
    h0 = hash_block_tokens(ROOT_HASH, [1, 2, 3])
    assert (
        h0 == hashlib.sha256((1).to_bytes(8, "little") + (2).to_bytes(8, "little") + (3).to_bytes(8, "little")).digest()
    )
    assert hash_block_tokens(ROOT_HASH, (1, 2, 3)) == h0
    assert hash_block_tokens(h0, [4]) != hash_block_tokens(hash_block_tokens(ROOT_HASH, [9]), [4])


def test_a_caller_uses_part_of_a_match_and_hears_of_dropped_prefixes():
    """`usable` keeps the leading blocks the caller can use (a recurrent model: those up to a kept state), and the
    statistics count those; `on_forget` hears each prefix hash the cache drops (evicted or forgotten)."""
    pool = BlockPool(6, block_size=4)
    forgotten = []
    pool.on_forget = forgotten.append
    prompt = list(range(13))
    cached_table(pool, prompt).free()
    hashes = [pool.prefix_hash(prompt, n) for n in (1, 2, 3)]
    assert all(pool.holds(h) for h in hashes) and not pool.holds(pool.prefix_hash(prompt, 4))
    seen = []
    table = BlockTable(pool)
    assert table.match_prefix(prompt, lambda run: seen.append(run) or 2) == 8
    assert seen == [hashes] and table.blocks == [0, 1]
    assert (pool.stats.hits, pool.stats.cached_tokens) == (1, 8)
    assert BlockTable(pool).match_prefix(prompt, lambda run: 0) == 0
    assert pool.stats.hits == 1
    table.free()
    pool.allocate(4)  # 3 free blocks, then the least recently released cached one: block 2 (hashes[2])
    assert forgotten == [hashes[2]] and not pool.holds(hashes[2])
    pool.forget_cached()
    assert sorted(forgotten) == sorted(hashes)
