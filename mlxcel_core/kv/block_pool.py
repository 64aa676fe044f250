"""Paged KV cache bookkeeping: a pool of fixed-size blocks with refcounts and prefix caching.

Pure Python, no MLX: this module only decides *which* block ids hold which tokens. The KV
storage that these ids index lives elsewhere (slot = block_id * block_size + offset).

Ideas follow vLLM v1's KV cache manager:

* Every block has a refcount. A block at refcount 0 is either *free* (holds nothing worth
  keeping) or *evictable* (holds a full, hashed block of some earlier prompt that a later
  request may still reuse).
* A full block is identified by a chained hash of (parent block's hash, its own tokens), so a
  block only matches when the whole prefix before it matches too.
* Free blocks are handed out lowest id first; only when none are free is an evictable block
  reclaimed, least-recently released first (LRU), and its hash forgotten.

Block hash: SHA-256 over the parent digest and the tokens packed as int64. Python's hash() of
a tuple of ints would be stable within a process, but it is 64 bits and not collision
resistant, and a collision here silently serves another prompt's KV. SHA-256 is cheap at this
scale (one 256-byte update per block), stable across processes, and safe to share.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable

BlockHash = bytes
ROOT_HASH: BlockHash = b""  # the parent of a sequence's first block


def hash_block_tokens(parent_hash: BlockHash, tokens: list[int] | tuple[int, ...]) -> BlockHash:
    """The chained hash of one full block: it depends on every token before it, via parent_hash."""
    h = hashlib.sha256(parent_hash)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class NoFreeBlocks(Exception):
    """More blocks were asked for than are free or evictable; nothing was allocated."""


@dataclass
class PrefixCacheStats:
    hits: int = 0  # match_prefix calls that reused at least one block
    queries: int = 0  # match_prefix calls
    cached_tokens: int = 0  # tokens served from the cache, summed over queries
    evictions: int = 0  # cached blocks reclaimed to satisfy an allocation


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 32, enable_prefix_cache: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.stats = PrefixCacheStats()
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks))  # min-heap of refcount-0 blocks holding nothing
        # Refcount-0 blocks that still hold a cached prefix, oldest release first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, BlockHash] = {}  # registered block -> its hash
        self._block_of: dict[BlockHash, int] = {}  # hash -> the one block registered under it
        # 1 + the highest id ever handed out: with lowest-first allocation, what the KV arrays must cover so far.
        self.high_water = 0
        # Told each prefix hash the cache drops (its block evicted or forgotten): what is kept beside a cached block
        # (engine/state_snapshots.py) goes with it.
        self.on_forget: Callable[[BlockHash], None] | None = None

    # -- allocation -------------------------------------------------------------------------

    def num_available(self) -> int:
        return len(self._free) + len(self._evictable)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_available():
            raise NoFreeBlocks(f"need {n} blocks, {self.num_available()} available")
        out = []
        for _ in range(n):
            if self._free:
                block = heapq.heappop(self._free)
            else:
                block, _ = self._evictable.popitem(last=False)
                self._drop_hash(block)
                self.stats.evictions += 1
            self._refs[block] = 1
            self.high_water = max(self.high_water, block + 1)
            out.append(block)
        return out

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference per listed id (an id may repeat). Validated first: all or nothing."""
        for block, count in Counter(block_ids).items():
            if self.refcount(block) < count:
                raise ValueError(f"block {block} released more often than it is held")
        for block in block_ids:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None  # newest at the end: evicted last
                else:
                    heapq.heappush(self._free, block)

    def share(self, block_ids: list[int]) -> None:
        """Add one reference to each listed block the caller already holds (e.g. forking a sequence)."""
        for block in block_ids:
            if self.refcount(block) == 0:
                raise ValueError(f"block {block} is not held")
        for block in block_ids:
            self._refs[block] += 1

    def refcount(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} out of range [0, {self.num_blocks})")
        return self._refs[block_id]

    # -- prefix cache -----------------------------------------------------------------------

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is registered under a prefix hash (held or evictable)."""
        return block_id in self._hash_of

    def match_prefix(self, token_ids: list[int], usable: Callable[[list[BlockHash]], int] | None = None) -> list[int]:
        """Take a reference on the longest run of cached full blocks that prefixes token_ids.

        At most (len(token_ids) - 1) // block_size blocks match, so at least the last token is
        left for the model to compute (its logits are needed to sample the next token).
        `usable(hashes)`: of the matching run (its blocks' hashes), how many leading blocks the caller can use (a
        model with recurrent layers needs the state at the run's end: engine/state_snapshots.py); the statistics
        count what is used.
        """
        if not self.enable_prefix_cache:
            return []
        bs = self.block_size
        matched: list[int] = []
        hashes: list[BlockHash] = []
        parent = ROOT_HASH
        for i in range(max(len(token_ids) - 1, 0) // bs):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._block_of.get(parent)
            if block is None:
                break
            matched.append(block)
            hashes.append(parent)
        if usable is not None:
            matched = matched[: usable(hashes)]
        for block in matched:
            if self._refs[block] == 0:
                del self._evictable[block]  # revived: no longer a candidate for eviction
            self._refs[block] += 1
        self.stats.queries += 1
        if matched:
            self.stats.hits += 1
            self.stats.cached_tokens += len(matched) * bs
        return matched

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether a block is cached under this prefix hash (held or evictable)."""
        return block_hash in self._block_of

    def prefix_hash(self, token_ids: list[int], num_blocks: int) -> BlockHash:
        """The chained hash the first `num_blocks` full blocks of token_ids are cached under."""
        parent = ROOT_HASH
        for i in range(num_blocks):
            parent = hash_block_tokens(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
        return parent

    def cache_full_blocks(self, block_ids: list[int], token_ids: list[int]) -> None:
        """Register every full block of a sequence (block i holds token_ids[i*bs:(i+1)*bs]).

        Blocks already registered are skipped. If another block already owns the same hash,
        that mapping is kept and this block stays uncached (it is freed, not kept, on release).
        Call while the sequence still holds its blocks.
        """
        if not self.enable_prefix_cache:
            return
        bs = self.block_size
        parent = ROOT_HASH
        for i in range(min(len(token_ids) // bs, len(block_ids))):
            block = block_ids[i]
            if block in self._hash_of:
                parent = self._hash_of[block]  # registered earlier: reuse, don't rehash
                continue
            if self.refcount(block) == 0:
                raise ValueError(f"block {block} is not held; cache blocks before releasing them")
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            if parent not in self._block_of:
                self._block_of[parent] = block
                self._hash_of[block] = parent

    def forget_cached(self) -> int:
        """Drop the prefix of every evictable block (they become free, handed out lowest id first again); held
        blocks keep theirs. Returns how many were forgotten. Unlike allocating every block and releasing them, this
        hands nothing out, so `high_water` (how far the KV arrays must reach) does not move."""
        forgotten = len(self._evictable)
        for block in self._evictable:
            self._drop_hash(block)
            heapq.heappush(self._free, block)
        self._evictable.clear()
        return forgotten

    def _drop_hash(self, block: int) -> None:
        block_hash = self._hash_of.pop(block)
        del self._block_of[block_hash]
        if self.on_forget is not None:
            self.on_forget(block_hash)

    def copy_on_write(self, block_id: int) -> tuple[int, bool]:
        """Make block_id safe for one sequence to write into.

        Returns (block_id, False) when the caller holds it exclusively and it is no cached
        prefix. Otherwise allocates a fresh block (NoFreeBlocks leaves everything unchanged),
        drops the caller's reference on the old one, and returns (new_id, True): the caller must
        copy the old block's contents into the new one.
        """
        refs = self.refcount(block_id)
        if refs == 0:
            raise ValueError(f"block {block_id} is not held")
        if refs == 1 and block_id not in self._hash_of:
            return block_id, False
        (new,) = self.allocate(1)
        self.release([block_id])
        return new, True


class BlockTable:
    """The blocks of one sequence, in token order: position p lives in blocks[p // block_size]."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.num_tokens = 0  # tokens this sequence has slots for (the largest size ensured)

    def match_prefix(self, token_ids: list[int], usable: Callable[[list[BlockHash]], int] | None = None) -> int:
        """Start an empty table from the prompt's cached prefix; returns the cached token count (`usable`: as
        BlockPool.match_prefix)."""
        if self.blocks:
            raise ValueError("match_prefix needs an empty block table")
        self.blocks = self.pool.match_prefix(token_ids, usable)
        self.num_tokens = len(self.blocks) * self.pool.block_size
        return self.num_tokens

    def cache_full_blocks(self, token_ids: list[int]) -> None:
        """Offer this sequence's full blocks to the prefix cache (token_ids: its tokens so far)."""
        self.pool.cache_full_blocks(self.blocks, token_ids)

    def fork(self) -> BlockTable:
        """A second sequence sharing every block; writers go through pool.copy_on_write."""
        child = BlockTable(self.pool)
        self.pool.share(self.blocks)
        child.blocks, child.num_tokens = list(self.blocks), self.num_tokens
        return child

    def ensure_capacity(self, total_tokens: int) -> None:
        bs = self.pool.block_size
        missing = -(-total_tokens // bs) - len(self.blocks)
        if missing > 0:
            self.blocks += self.pool.allocate(missing)  # all or nothing
        self.num_tokens = max(self.num_tokens, total_tokens)

    def slot(self, position: int) -> int:
        bs = self.pool.block_size
        if not 0 <= position < len(self.blocks) * bs:
            raise IndexError(f"position {position} outside the table's {len(self.blocks) * bs} slots")
        return self.blocks[position // bs] * bs + position % bs

    def free(self) -> None:
        """Release every block, tail first, so a prefix's root block is the last one evicted."""
        self.pool.release(self.blocks[::-1])
        self.blocks = []
        self.num_tokens = 0
