"""Paged KV storage: one block pool per model, per-sequence block tables, prefix cache.

Keys and values of every layer live in pools [num_blocks, block_size, Hkv, D]. A prefill chunk
writes its tokens' slots and attends over the sequence gathered back from its blocks; a decode
step writes one slot per row and runs `paged_decode_attention` over the block tables.
Prompts that start with blocks another request already computed reuse them (prefix cache).

Where the backend's decode attention kernel writes the step's keys and values into the pools itself, in place
(Backend.kv_written_in_kernel; backends/cuda/paged_attention.py, `new_kv`): MLX sees the pools only as the launch's
inputs, so nothing in the graph orders a later pool update after that write. The storage does: before it hands out
the views of the next prefill, extension or decode step (the only code that updates pools), it submits the steps that
wrote in place (`mx.async_eval`), and graphs submitted to one stream run in order. A later decode step's own reads
follow from its tokens, which come from the earlier step's logits.

With `kv_bits`, each pool is stored quantized (packed values + scales + biases per slot, grouped
along the head dimension) and dequantized after gathering a step's blocks.

A model's recurrent layers (`state_layers`) get no pools: their views are a StatePool's (engine/state_pool.py), one
state slot per sequence, taken at its first forward and given back in `free`. Its prefix cache reuses a prefix only
where a snapshot of the state at the prefix's end is kept (engine/state_snapshots.py: the storage tells it where
forwards end and where sequences end).
"""

from __future__ import annotations

import weakref

import mlx.core as mx

from autotune.runtime import SplitsChooser

from .. import backends
from ..cache import kv_group_size
from ..kv.block_pool import BlockPool, BlockTable
from ..kv.paged_attention import RUNNER_OPS
from .paged_views import DecodeView, _PrefillView, _TogetherPrefillView
from .state_pool import StatePool
from .state_snapshots import StateSnapshots
from .step_inputs import int_views

DEFAULT_KV_BUDGET_TOKENS = 16384
MIN_POOL_BLOCKS = 64  # the pools' first allocation (blocks); they grow by doubling up to the budget


class PagedStorage:
    def __init__(
        self,
        num_layers: int,
        block_size: int = 32,
        kv_budget_tokens: int | None = None,
        kv_bits: int | None = None,
        prefix_cache: bool = True,
        num_splits: int | None = None,
        max_batch_size: int = 1,
        pad_block_tables: bool = False,
        state_layers: list[bool] | None = None,
        state_snapshots: int = 0,
        snapshot_tokens: int = 0,
        cache_generated: bool = True,
    ):
        """`state_layers`: per layer, whether it keeps a recurrent state (base.state_layout) instead of keys and
        values; such a model's prefix cache keeps up to `state_snapshots` copies of a state (none: no prefix cache),
        each counted as `snapshot_tokens` tokens of the KV budget, in what the sequences leave of it.
        `cache_generated` False: the prefix cache keeps prompts only (a model whose decode steps compute other maths
        than its prompts: what a sequence generated is not what a prompt of the same tokens would hold)."""
        self.kv_bits = kv_bits
        noted = weakref.WeakMethod(self._wrote_in_place)  # (no cycle: a dropped storage frees its pools at once)
        self.states = (
            StatePool(state_layers, max_batch_size, lambda array: noted()(array))
            if state_layers and any(state_layers)
            else None
        )
        if self.states is None or not prefix_cache:
            state_snapshots = 0
        prefix_cache = prefix_cache and (self.states is None or state_snapshots > 0)
        self.cache_generated = cache_generated
        # Decode block tables padded to a power-of-two width: compiled decode steps trace once per shape.
        self.pad_block_tables = pad_block_tables
        budget = kv_budget_tokens or DEFAULT_KV_BUDGET_TOKENS
        # One spare block per row: partial last blocks and the lookahead step's extra token.
        self.pool = BlockPool(
            -(-budget // block_size) + max_batch_size + 1, block_size, enable_prefix_cache=prefix_cache
        )
        self.num_splits = num_splits  # None: per shape, MLXCEL_PAGED_DECODE_SPLITS > autotune cache > heuristic
        self.choose_splits = SplitsChooser(fixed=num_splits)
        # Per layer: [keys, values] or, quantized, [k packed, k scales, k biases, v packed, v scales, v biases].
        self.pools: list[list[mx.array] | None] = [None] * num_layers
        # Blocks the pools hold: grown (doubling) as higher block ids come into use -- the block pool hands out the
        # lowest free id first -- so a short sequence never pays for the whole budget's allocation (on the H200,
        # allocating 2 GB of pools at the first prefill cost 13-17 ms of its TTFT on the 8B shape).
        self.pool_rows = 0
        self._rows_grown = 0  # the pool_rows every made layer's pools were last grown to (grow_pools)
        # Counts replacements of any pool array (a write by MLX ops makes a new array; where MLX donates the old
        # one's memory, its address stays): engine/graph_decode.py re-checks the addresses it replays against.
        self.pools_version = 0
        self.tables: dict[int, BlockTable] = {}
        self.lengths: dict[int, int] = {}  # tokens written per sequence
        self.prompts: dict[int, list[int]] = {}
        self.written_in_place: list[mx.array] = []  # arrays of the steps whose kernels wrote the pools in place
        # Per layer, where the backend's kernel combines its splits in one launch: its counters (unquantized pools).
        backend = backends.current()
        self.kv_in_kernel = backend.kv_written_in_kernel
        self.combine_counters = backend.combine_counters(num_layers) if kv_bits is None else [None] * num_layers
        self.snapshots = None  # a recurrent model's prefix cache: the states kept at cached prefixes' ends
        if state_snapshots:
            self.snapshots = StateSnapshots(self.states, self.pool, state_snapshots, snapshot_tokens, budget)

    # -- KVStorage ----------------------------------------------------------------------------
    def add(self, seq_id: int, prompt_ids: list[int], conversation=None) -> int:
        """`conversation` is not needed here: the prefix cache finds earlier turns by their blocks."""
        table = BlockTable(self.pool)
        snapshots = self.snapshots
        cached = table.match_prefix(prompt_ids) if snapshots is None else snapshots.match(seq_id, table, prompt_ids)
        self.tables[seq_id], self.lengths[seq_id], self.prompts[seq_id] = table, cached, prompt_ids
        return cached

    def prefill_stops(self, seq_id: int) -> tuple[int, ...]:
        """Prompt positions the sequence's prefill chunks must end at: where its recurrent state is kept."""
        return () if self.snapshots is None else self.snapshots.stops(seq_id)

    def prefill_caches(self, seq_id: int, start: int, length: int) -> list["_PrefillView"]:
        return self.prefill_rows_caches((seq_id,), start, length)

    def prefill_rows_caches(self, seq_ids, start: int, length: int) -> list["_PrefillView"]:
        """Per-layer caches for prompt positions [start, start + length) of each of `seq_ids` in one forward, a row
        each (no padding: every row's chunk starts and ends at the same positions)."""
        self.submit_in_place_writes()
        end = start + length
        if self.snapshots is not None:
            self.snapshots.capture()
            for seq_id in seq_ids:
                self.snapshots.start(seq_id)
                if end in self.snapshots.stops(seq_id):
                    self.snapshots.expect(seq_id, end)
        tables = [self.tables[seq_id] for seq_id in seq_ids]
        for seq_id, table in zip(seq_ids, tables):
            table.ensure_capacity(end)
            self.lengths[seq_id] = end
        self._reserve()
        width = max(len(table.blocks) for table in tables)
        slot_blocks, slot_offsets, blocks = int_views(
            *self._block_offsets([table.slot(p) for table in tables for p in range(start, end)]),
            [table.blocks + [0] * (width - len(table.blocks)) for table in tables],
        )
        views = [
            _PrefillView(self, layer, (slot_blocks, slot_offsets), blocks, start) for layer in range(len(self.pools))
        ]
        return self._with_states(views, seq_ids, fresh=start == 0)

    def prefill_together_caches(self, seq_ids, lengths: list[int]) -> list["_TogetherPrefillView"]:
        """Per-layer caches for the first chunks (positions 0 to `lengths`) of several sequences' prompts in one
        forward, left-padded to the longest (unquantized pools: the views attend over the keys as computed, as a
        sequence's first chunk does). A chunk that ends at one of its sequence's stops leaves the state kept there, as
        the chunk prefilled alone would (`prefill_caches`)."""
        if self.kv_bits is not None:
            raise ValueError("prompts prefilled together need unquantized KV pools")
        self.submit_in_place_writes()
        if self.snapshots is not None:
            self.snapshots.capture()
            for seq_id, length in zip(seq_ids, lengths):
                if length in self.snapshots.stops(seq_id):
                    self.snapshots.expect(seq_id, length)
        longest = max(lengths)
        slots, keep = [], []
        for row, (seq_id, length) in enumerate(zip(seq_ids, lengths)):
            table = self.tables[seq_id]
            table.ensure_capacity(length)
            self.lengths[seq_id] = length
            slots += [table.slot(p) for p in range(length)]
            keep += range(row * longest + longest - length, (row + 1) * longest)  # the row's real columns
        self._reserve()
        padding = [longest - length for length in lengths]
        slot_blocks, slot_offsets, keep, offsets = int_views(*self._block_offsets(slots), keep, [-p for p in padding])
        pad = None if not any(padding) else mx.array(padding)
        views = [
            _TogetherPrefillView(self, layer, (slot_blocks, slot_offsets), keep, offsets, pad)
            for layer in range(len(self.pools))
        ]
        return self._with_states(views, seq_ids, fresh=True, padding=pad)

    def finish_prefill(self, seq_id: int) -> None:
        self.tables[seq_id].cache_full_blocks(self.prompts[seq_id])
        if self.snapshots is not None:
            self.snapshots.keep(seq_id, self.prompts[seq_id])

    def decode_caches(self, seq_ids) -> list["DecodeView"]:
        return self._with_states(self.decode_views(self.decode_inputs(seq_ids)), seq_ids, fresh=False)

    def _with_states(self, views: list, seq_ids, fresh: bool, padding: mx.array | None = None) -> list:
        """The recurrent layers' views replaced by state views over the rows' slots (state_pool.py)."""
        return views if self.states is None else self.states.views(views, seq_ids, fresh, padding)

    def decode_views(self, parts: tuple) -> list["DecodeView"]:
        """Per-layer caches of a decode step whose rows `decode_inputs` advanced (`parts`: what it returned)."""
        self.submit_in_place_writes()
        self.grow_pools()
        slot_blocks, slot_offsets, block_tables, positions, context_lens = int_views(*parts)
        return [
            DecodeView(self, layer, (slot_blocks, slot_offsets), block_tables, positions, context_lens)
            for layer in range(len(self.pools))
        ]

    def decode_inputs(self, seq_ids) -> tuple:
        """Advance each row one position: the step's ints (slot blocks, slot offsets, block tables, positions,
        context lengths) as `int_views` takes them."""
        if self.snapshots is not None:
            self.submit_in_place_writes()  # (the copies read what the steps before wrote in place)
            self.snapshots.capture()
        positions = []
        for seq_id in seq_ids:
            position = self.lengths[seq_id]
            self.tables[seq_id].ensure_capacity(position + 1)
            self.lengths[seq_id] = position + 1
            positions.append(position)
            if self.snapshots is not None and self.cache_generated and (position + 1) % self.pool.block_size == 0:
                self.snapshots.expect(seq_id, position + 1)
        self._reserve()
        tables = [self.tables[s].blocks for s in seq_ids]
        width = max(len(t) for t in tables)
        if self.pad_block_tables:
            width = 1 << (width - 1).bit_length()
        return (
            *self._block_offsets([self.tables[s].slot(p) for s, p in zip(seq_ids, positions)]),
            [t + [0] * (width - len(t)) for t in tables],
            positions,
            [p + 1 for p in positions],
        )

    def extend_caches(self, seq_id: int, length: int) -> list["_PrefillView"]:
        """Several new tokens of one decoding sequence (speculative verification): a prompt chunk's view."""
        return self.prefill_caches(seq_id, self.lengths[seq_id], length)

    def rollback(self, seq_id: int, count: int) -> None:
        """The last `count` slots are stale (rejected draft tokens): the next writes go over them."""
        self.lengths[seq_id] -= count

    def checkpoint(self, seq_id: int) -> tuple[int, list | None]:
        """The sequence's length and the recurrent layers' state arrays (a write replaces them: keeping them is a
        copy), for `restore`."""
        return self.lengths[seq_id], None if self.states is None else list(self.states.arrays)

    def restore(self, seq_id: int, saved: tuple[int, list | None]) -> None:
        """The sequence's length and its state slot back to `saved` (later slots are stale, as after `rollback`)."""
        self.lengths[seq_id], arrays = saved
        if arrays is not None:
            slots = mx.array([self.states.slot(seq_id)], mx.int32)
            for layer, parts in enumerate(arrays):
                if parts is not None:
                    self.states.write(layer, slots, [part[slots] for part in parts])

    def free(self, seq_id: int, tokens: list[int]) -> None:
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        written = self.lengths.pop(seq_id)
        prompt = self.prompts.pop(seq_id, None)
        if not self.cache_generated:
            written = min(written, len(prompt))
        if self.snapshots is not None:
            self.submit_in_place_writes()
            self.snapshots.capture()
        table.cache_full_blocks(tokens[:written])  # a later turn of the same conversation reuses them
        if self.snapshots is not None:
            self.snapshots.keep(seq_id, tokens[:written])
            self.snapshots.release(seq_id)
        if self.states is not None:
            self.states.release(seq_id)
        table.free()

    def forget_cached(self) -> None:
        # Not by allocating every block and releasing them: that would raise the pool's high water to its whole
        # budget, so every layer's KV arrays would grow to the whole KV budget.
        self.pool.forget_cached()

    def stats(self) -> dict[str, int]:
        s = self.pool.stats
        return {
            "blocks_total": self.pool.num_blocks,
            "blocks_free": self.pool.num_available(),
            "prefix_hits": s.hits,
            "prefix_queries": s.queries,
            "cached_tokens": s.cached_tokens,
            "evictions": s.evictions,
            **({} if self.states is None else {"state_slots_used": self.states.in_use}),
            **({} if self.snapshots is None else self._snapshot_stats()),
        }

    def _snapshot_stats(self) -> dict[str, int]:
        return {"state_snapshots": self.snapshots.count, "state_snapshot_bytes": self.snapshots.nbytes}

    # -- pools -----------------------------------------------------------------------------------
    def take_in_place_writes(self) -> list[mx.array]:
        """The steps whose kernels wrote keys and values into the pools in place, not submitted yet (the caller
        submits them before any later pool update: see the module docstring)."""
        taken, self.written_in_place = self.written_in_place, []
        return taken

    def _wrote_in_place(self, array: mx.array) -> None:
        """A launch that updated the state pool's arrays in place (state_pool.py): submitted as the KV writes are."""
        self.written_in_place.append(array)

    def submit_in_place_writes(self) -> None:
        """Submit those steps: a pool update built from here on runs after them."""
        taken = self.take_in_place_writes()
        if taken:
            mx.async_eval(taken)

    def _reserve(self) -> None:
        """Make the pools' next writes cover every block handed out so far (a power of two of blocks, at least
        MIN_POOL_BLOCKS, at most the budget's); `write` grows each layer's arrays to match. Called after every
        allocation: the state snapshots fit in what the blocks leave of the budget."""
        if self.snapshots is not None:
            self.snapshots.fit()  # the sequences' new blocks first: kept states give way
        top = self.pool.high_water
        if top > self.pool_rows:
            want = max(MIN_POOL_BLOCKS, 1 << (top - 1).bit_length())
            self.pool_rows = max(top, min(self.pool.num_blocks, want))

    def _block_offsets(self, slots: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Flat slot ids as (blocks, offsets in the block): how `write` indexes the pools."""
        blocks, offsets = zip(*(divmod(slot, self.pool.block_size) for slot in slots))
        return blocks, offsets

    def write(
        self, layer: int, slots: tuple[mx.array, mx.array], keys: mx.array, values: mx.array | None
    ) -> list[mx.array]:
        """keys/values [N, Hkv, D] into `slots` = (blocks [N], offsets in the block [N]); returns the layer's updated
        pools. Indexing the pools as they are, not reshaped to flat slots and back, saves 2 ops per pool in a decode
        step's graph (a batch-1 step on a GPU is bound by the host's cost per op, benchmarks/host_profile.py).
        `values` None: the layer's values are its keys' prefix (values_in_keys), and it has a key pool only."""
        parts = [keys] if values is None else [keys, values]
        if self.kv_bits is not None:
            group = kv_group_size(keys.shape[-1])
            parts = [p for x in parts for p in mx.quantize(x, group_size=group, bits=self.kv_bits)]
        updated = []
        for pool, part in zip(self.layer_pools(layer, parts), parts):
            # (A slice update at (block, offset) would be fewer ops still, but MLX's CUDA dynamic-offset copy took
            # 23.5 us a call on the H200, the scatter 4 us: 0.75 ms a token at 1B.)
            pool = pool[...]  # a new array: the assignment leaves the caller's pool untouched
            pool[slots] = part.astype(pool.dtype)
            updated.append(pool)
        self.pools[layer] = updated
        self.pools_version += 1
        return updated

    def grow_pools(self) -> None:
        """Every made layer's pools grown to `pool_rows` blocks now, before the step's views exist. A compiled decode
        step (engine/compiled_decode.py) is traced once per input shapes, and `pool_rows` is a Python int inside it:
        growth traced into it is replayed only where the trace was first made growing, and a step whose blocks passed
        the pools' end with shapes an earlier trace saw would index past it (CPU: a corrupted heap; CUDA: reads of
        other memory, the KV write dropped). Grown here, the pools a compiled step gets always cover its blocks."""
        if self._rows_grown == self.pool_rows:  # (a decode step's host time: no loop over the layers)
            return
        for layer, pools in enumerate(self.pools):
            if pools is not None and pools[0].shape[0] < self.pool_rows:
                self.layer_pools(layer, pools)
        self._rows_grown = self.pool_rows

    def layer_pools(self, layer: int, parts: list[mx.array]) -> list[mx.array]:
        """The layer's pools, made (zeros) or grown to `pool_rows` blocks first; `parts` [N, ...] are what a write
        stores per slot (their trailing shape and dtype make the pools)."""
        if self.pools[layer] is None:
            size = (self.pool_rows, self.pool.block_size)
            self.pools[layer] = [mx.zeros(size + p.shape[1:], p.dtype) for p in parts]
            self.pools_version += 1
        elif self.pools[layer][0].shape[0] < self.pool_rows:  # higher blocks came into use: grow (zeros, as new)
            self.pools[layer] = [
                mx.concatenate([pool, mx.zeros((self.pool_rows - pool.shape[0], *pool.shape[1:]), pool.dtype)])
                for pool in self.pools[layer]
            ]
            self.pools_version += 1
        return self.pools[layer]

    def decode_attention(
        self,
        queries: mx.array,
        pools: list[mx.array],
        block_tables: mx.array,
        values_in_keys: bool = False,
        window: int | None = None,
        chunk: int | None = None,
    ):
        """(attention function, num_splits, whether it is a kernel of the backend's) for a decode step;
        `values_in_keys`: its values are its keys' prefix (no backend kernel takes that: the portable path runs);
        `window` / `chunk`: a sliding-window layer's or a chunked one's (Llama 4), whose splits cut at most that many
        keys."""
        batch, q_heads, _, head_dim = queries.shape
        backend = backends.current()
        latent = {"values_in_keys": True} if values_in_keys else {}  # (only when set: stand-in backends in tests)
        runner = backend.paged_runner_for(head_dim, **latent)
        bs = self.pool.block_size
        width = block_tables.shape[1] * bs
        splits = self.choose_splits(
            batch,
            min(width, window or width, chunk or width),
            q_heads,
            pools[0].shape[2],
            head_dim,
            bs,
            str(pools[0].dtype).rsplit(".", 1)[-1],
            runner,
        )
        return backend.paged_attention(runner), splits, runner != RUNNER_OPS

    def gather(self, pools: list[mx.array], block_tables: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Rows' blocks as dense [B, Hkv, T, D] keys and values (T = blocks per row x block size); values None for a
        layer with a key pool only (values_in_keys)."""
        batch, width = block_tables.shape
        dense = [p[block_tables].reshape(batch, width * self.pool.block_size, *p.shape[2:]) for p in pools]
        if self.kv_bits is not None:
            group = dense[0].shape[-1] * 32 // self.kv_bits // dense[1].shape[-1]
            dense = [
                mx.dequantize(*dense[i : i + 3], group_size=group, bits=self.kv_bits) for i in range(0, len(dense), 3)
            ]
        keys, *values = (d.transpose(0, 2, 1, 3).astype(dtype) for d in dense)
        return keys, (values[0] if values else None)
