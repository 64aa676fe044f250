"""Paged KV storage: one block pool per model, per-sequence block tables, prefix cache.

Keys and values of every layer live in pools [num_blocks, block_size, Hkv, D]. A prefill chunk
writes its tokens' slots and attends over the sequence gathered back from its blocks; a decode
step writes one slot per row and runs `paged_decode_attention` over the block tables.
Prompts that start with blocks another request already computed reuse them (prefix cache).
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import InputError
from ..kv.block_pool import BlockPool, BlockTable
from ..kv.paged_attention import gather_kv, paged_decode_attention, write_kv
from ..models.base import causal_mask, scaled_dot_product_attention

DEFAULT_KV_BUDGET_TOKENS = 16384


class PagedStorage:
    def __init__(self, num_layers: int, block_size: int = 32, kv_budget_tokens: int | None = None,
                 kv_bits: int | None = None, prefix_cache: bool = True, num_splits: int = 1, max_batch_size: int = 1):
        if kv_bits is not None:
            raise InputError("quantized KV (--kv-bits) works with dense storage only for now; "
                             "use --decode-storage-backend dense")
        budget = kv_budget_tokens or DEFAULT_KV_BUDGET_TOKENS
        # One spare block per row: partial last blocks and the lookahead step's extra token.
        self.pool = BlockPool(-(-budget // block_size) + max_batch_size + 1, block_size, enable_prefix_cache=prefix_cache)
        self.num_splits = num_splits
        self.k_pools: list[mx.array | None] = [None] * num_layers
        self.v_pools: list[mx.array | None] = [None] * num_layers
        self.tables: dict[int, BlockTable] = {}
        self.lengths: dict[int, int] = {}  # tokens written per sequence
        self.prompts: dict[int, list[int]] = {}

    # -- KVStorage ----------------------------------------------------------------------------
    def add(self, seq_id: int, prompt_ids: list[int], conversation=None) -> int:
        """`conversation` is not needed here: the prefix cache finds earlier turns by their blocks."""
        table = BlockTable(self.pool)
        cached = table.match_prefix(prompt_ids)
        self.tables[seq_id], self.lengths[seq_id], self.prompts[seq_id] = table, cached, prompt_ids
        return cached

    def prefill_caches(self, seq_id: int, start: int, length: int) -> list["_PrefillView"]:
        table = self.tables[seq_id]
        table.ensure_capacity(start + length)
        self.lengths[seq_id] = start + length
        slots = mx.array([table.slot(p) for p in range(start, start + length)])
        blocks = mx.array(table.blocks)
        return [_PrefillView(self, layer, slots, blocks, start) for layer in range(len(self.k_pools))]

    def finish_prefill(self, seq_id: int) -> None:
        self.tables[seq_id].cache_full_blocks(self.prompts[seq_id])

    def decode_caches(self, seq_ids) -> list["_DecodeView"]:
        positions = []
        for seq_id in seq_ids:
            position = self.lengths[seq_id]
            self.tables[seq_id].ensure_capacity(position + 1)
            self.lengths[seq_id] = position + 1
            positions.append(position)
        tables = [self.tables[s].blocks for s in seq_ids]
        width = max(len(t) for t in tables)
        block_tables = mx.array([t + [0] * (width - len(t)) for t in tables])
        slots = mx.array([self.tables[s].slot(p) for s, p in zip(seq_ids, positions)])
        positions = mx.array(positions)
        return [_DecodeView(self, layer, slots, block_tables, positions) for layer in range(len(self.k_pools))]

    def free(self, seq_id: int, tokens: list[int]) -> None:
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        written = self.lengths.pop(seq_id)
        self.prompts.pop(seq_id, None)
        table.cache_full_blocks(tokens[:written])  # a later turn of the same conversation reuses them
        table.free()

    def stats(self) -> dict[str, int]:
        s = self.pool.stats
        return {"blocks_total": self.pool.num_blocks, "blocks_free": self.pool.num_available(),
                "prefix_hits": s.hits, "prefix_queries": s.queries, "cached_tokens": s.cached_tokens,
                "evictions": s.evictions}

    # -- pools -----------------------------------------------------------------------------------
    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys/values [N, Hkv, D] into `slots`; returns the layer's updated pools."""
        if self.k_pools[layer] is None:
            shape = (self.pool.num_blocks, self.pool.block_size, keys.shape[1], keys.shape[2])
            self.k_pools[layer] = mx.zeros(shape, keys.dtype)
            self.v_pools[layer] = mx.zeros(shape, values.dtype)
        k_pool, v_pool = write_kv(self.k_pools[layer], self.v_pools[layer], slots, keys, values)
        self.k_pools[layer], self.v_pools[layer] = k_pool, v_pool
        return k_pool, v_pool


class _PrefillView:
    """LayerCache for a chunk of one sequence's prompt (batch of one)."""

    def __init__(self, storage: PagedStorage, layer: int, slots: mx.array, blocks: mx.array, start: int):
        self.storage, self.layer, self.slots, self.blocks, self.offset = storage, layer, slots, blocks, start

    @property
    def state(self) -> list[mx.array]:
        pools = [self.storage.k_pools[self.layer], self.storage.v_pools[self.layer]]
        return [p for p in pools if p is not None]

    def attend(self, queries, keys, values, scale, window=None, softcap=None):
        length = keys.shape[2]
        k_pool, v_pool = self.storage.write(self.layer, self.slots, keys[0].transpose(1, 0, 2),
                                            values[0].transpose(1, 0, 2))
        total = self.offset + length
        all_keys, all_values = gather_kv(k_pool, v_pool, self.blocks, total)
        mask = causal_mask(length, total, None, window)
        return scaled_dot_product_attention(queries, all_keys.astype(queries.dtype),
                                            all_values.astype(queries.dtype), scale, mask, softcap)


class _DecodeView:
    """LayerCache for one decode step over several rows, each with its own position and blocks."""

    def __init__(self, storage: PagedStorage, layer: int, slots, block_tables, positions):
        self.storage, self.layer = storage, layer
        self.slots, self.block_tables, self.offset = slots, block_tables, positions

    @property
    def state(self) -> list[mx.array]:
        return [self.storage.k_pools[self.layer], self.storage.v_pools[self.layer]]

    def attend(self, queries, keys, values, scale, window=None, softcap=None):
        k_pool, v_pool = self.storage.write(self.layer, self.slots, keys[:, :, 0], values[:, :, 0])
        context_lens = self.offset + 1
        if window is None and softcap is None:
            out = paged_decode_attention(queries[:, :, 0], k_pool, v_pool, self.block_tables, context_lens,
                                         num_splits=self.storage.num_splits, scale=scale)
            return out[:, :, None, :]
        # Sliding-window or soft-capped layers: gather the rows densely and mask per row.
        batch, width = self.block_tables.shape
        size = width * self.storage.pool.block_size

        def dense(pool):
            return pool[self.block_tables].reshape(batch, size, *pool.shape[2:]).transpose(0, 2, 1, 3)

        k_pos = mx.arange(size)[None, :]
        mask = k_pos < context_lens[:, None]
        if window is not None:
            mask = mx.logical_and(mask, k_pos > self.offset[:, None] - window)
        mask = mask[:, None, None, :]
        return scaled_dot_product_attention(queries, dense(k_pool).astype(queries.dtype),
                                            dense(v_pool).astype(queries.dtype), scale, mask, softcap)
