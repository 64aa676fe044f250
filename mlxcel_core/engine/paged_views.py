"""The per-layer views paged storage hands the model (models.base.LayerCache): a prompt chunk of one sequence
(_PrefillView), whole prompts prefilled together (_TogetherPrefillView) and one decode step over many rows
(DecodeView). Each writes its layer's new keys and values through PagedStorage.write and attends over the blocks
(engine/paged.py describes the pools and the in-place writes of the backend's decode kernel)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from ..models.base import causal_mask, scaled_dot_product_attention

if TYPE_CHECKING:
    from .paged import PagedStorage


def stored_values(values: mx.array | None, values_in_keys: int | None) -> mx.array | None:
    """What a view writes to the value pool: `values`, or (`values_in_keys` set: multi-head latent attention, whose
    values are its keys' prefix) None: nothing, the layer has a key pool only (pools are made per layer from their
    first write)."""
    return values if values_in_keys is None else None


def read_values(keys: mx.array, values: mx.array | None, values_in_keys: int | None) -> mx.array:
    """The values attention reads: `values`, or keys[..., :values_in_keys]."""
    return values if values_in_keys is None else keys[..., :values_in_keys]


def values_seen(values: mx.array, mask: mx.array) -> mx.array:
    """`values` [B, Hkv, T, Dv] with the positions `mask` [B, T] hides set to 0. Slots past a row's length (its last
    block's tail, the block table's padding entries) hold what an earlier sequence left there, NaN included, and
    attention's weight 0 times NaN is NaN."""
    return mx.where(mask[:, None, :, None], values, mx.zeros((), values.dtype))


class _PrefillView:
    """LayerCache for a chunk of one sequence's prompt, or for chunks of several sequences' prompts that start at
    the same position and have the same length (one row each; `blocks` [rows, width]: their block tables, padded)."""

    def __init__(
        self, storage: PagedStorage, layer: int, slots: tuple[mx.array, mx.array], blocks: mx.array, start: int
    ):
        self.storage, self.layer, self.slots, self.blocks, self.offset = storage, layer, slots, blocks, start

    @property
    def state(self) -> list[mx.array]:
        return self.storage.pools[self.layer] or []

    def attend(
        self, queries, keys, values, scale, window=None, softcap=None, sinks=None, values_in_keys=None, chunk=None
    ):
        # queries may be the chunk's last positions only (a prompt's last layer, last_only): masks align them with
        # the last keys. values_in_keys n: the values are keys[..., :n] and the layer's value pool has width 0.
        # chunk (Llama 4): causal_mask's chunked attention (columns are the sequence's positions here).
        rows, heads, length, _ = keys.shape
        queried = queries.shape[2]
        values = stored_values(values, values_in_keys)
        new = [None if x is None else x.transpose(0, 2, 1, 3).reshape(rows * length, heads, -1) for x in (keys, values)]
        pools = self.storage.write(self.layer, self.slots, *new)
        if self.offset == 0 and self.storage.kv_bits is None:
            # The sequence's first chunk: the blocks now hold exactly these keys/values, so attend over them
            # as they are instead of gathering them back (on the GPU the gather cost ~0.3 ms per layer of TTFT).
            values = read_values(keys, values, values_in_keys)
            return scaled_dot_product_attention(
                queries, keys, values, scale, causal_mask(queried, length, None, window, chunk), softcap, sinks
            )
        total = self.offset + length
        all_keys, all_values = self.storage.gather(pools, self.blocks, queries.dtype)
        all_values = read_values(all_keys, all_values, values_in_keys)
        mask = causal_mask(queried, total, None, window, chunk)
        return scaled_dot_product_attention(
            queries, all_keys[:, :, :total], all_values[:, :, :total], scale, mask, softcap, sinks
        )

    def attend_stored(self, queries, scale, window=None, softcap=None):
        """LayerCache.attend_stored: the sequences' keys/values gathered back from the layer's blocks, through this
        chunk's (`slots` has one entry per row and chunk position)."""
        total = self.offset + self.slots[0].shape[0] // self.blocks.shape[0]
        keys, values = self.storage.gather(self.storage.pools[self.layer], self.blocks, queries.dtype)
        mask = causal_mask(queries.shape[2], total, None, window)
        return scaled_dot_product_attention(queries, keys[:, :, :total], values[:, :, :total], scale, mask, softcap)


class _TogetherPrefillView:
    """LayerCache for whole prompts of several sequences in one forward, left-padded to the longest: row r's
    columns before its padding[r] are padding, hidden from attention and never stored; the others are the prompt's
    positions 0.. (offset -padding[r]: RoPE's positions)."""

    def __init__(
        self,
        storage: PagedStorage,
        layer: int,
        slots: tuple[mx.array, mx.array],
        keep: mx.array,
        offsets: mx.array,
        padding: mx.array | None,
    ):
        self.storage, self.layer, self.slots, self.keep = storage, layer, slots, keep
        self._offsets, self.padding = offsets, padding

    @property
    def offset(self) -> int | mx.array:
        return 0 if self.padding is None else self._offsets

    @property
    def state(self) -> list[mx.array]:
        return self.storage.pools[self.layer] or []

    def attend(
        self, queries, keys, values, scale, window=None, softcap=None, sinks=None, values_in_keys=None, chunk=None
    ):
        rows, heads, length, dim = keys.shape
        values = stored_values(values, values_in_keys)
        real = [
            None if part is None else part.transpose(0, 2, 1, 3).reshape(rows * length, heads, dim)[self.keep]
            for part in (keys, values)
        ]
        self.storage.write(self.layer, self.slots, *real)
        mask = causal_mask(queries.shape[2], length, self.padding, window, chunk)  # (chunks from each row's start)
        values = read_values(keys, values, values_in_keys)
        return scaled_dot_product_attention(queries, keys, values, scale, mask, softcap, sinks)

    def attend_stored(self, queries, scale, window=None, softcap=None):
        """LayerCache.attend_stored: the rows' stored keys/values read back from their slots into the left-padded
        layout `attend` saw (zeros in the padding, which the mask hides)."""
        rows = self._offsets.shape[0]
        padded = self.slots[0].shape[0] + (0 if self.padding is None else sum(self.padding.tolist()))
        longest = padded // rows  # (every row is the longest prompt's length once padded)
        stored = []
        for pool in self.storage.pools[self.layer]:  # unquantized: prompts prefill together only then
            flat = mx.zeros((rows * longest, *pool.shape[2:]), pool.dtype)
            flat[self.keep] = pool[self.slots]
            stored.append(flat.reshape(rows, longest, *pool.shape[2:]).transpose(0, 2, 1, 3).astype(queries.dtype))
        mask = causal_mask(queries.shape[2], longest, self.padding, window)
        return scaled_dot_product_attention(queries, *stored, scale, mask, softcap)


class DecodeView:
    """LayerCache for one decode step over several rows, each with its own position and blocks."""

    def __init__(
        self, storage: PagedStorage, layer: int, slots: tuple[mx.array, mx.array], block_tables, positions, context_lens
    ):
        self.storage, self.layer = storage, layer
        self.slots = slots  # (blocks [B], offsets [B]): each row's KV slot (PagedStorage.write)
        self.block_tables, self.offset = block_tables, positions
        self.context_lens = context_lens  # positions + 1, made on the host with them (engine/step_inputs.py)

    @property
    def state(self) -> list[mx.array]:
        return self.storage.pools[self.layer] or []

    def attend(
        self, queries, keys, values, scale, window=None, softcap=None, sinks=None, values_in_keys=None, chunk=None
    ):
        # [B, H, 1, D] <-> [B, H, D]: reshapes (one op each in the step's graph, where indexing makes two)
        values = stored_values(values, values_in_keys)
        B, Hkv, _, D = keys.shape
        keys, values = keys.reshape(B, Hkv, D), None if values is None else values.reshape(B, Hkv, D)
        context_lens = self.context_lens
        storage = self.storage
        if storage.kv_bits is None:
            pools = storage.layer_pools(self.layer, [keys] if values is None else [keys, values])
            attention, num_splits, on_kernel = storage.decode_attention(
                queries,
                pools,
                self.block_tables,
                values_in_keys=values_in_keys is not None,
                window=window,
                chunk=chunk,
            )
            # queries [B, Hq, 1, D] as they are: the attention returns that shape (no reshape ops around it)
            extra_args = {"counters": storage.combine_counters[self.layer]} if on_kernel else {}
            if sinks is not None:
                extra_args["sinks"] = sinks
            if values_in_keys is not None:  # (never on a kernel: decode_attention routes it to the portable path)
                extra_args["values_in_keys"] = values_in_keys
            limits = (("window", window), ("chunk", chunk), ("softcap", softcap))
            extra_args.update({name: n for name, n in limits if n is not None})
            if on_kernel and storage.kv_in_kernel:
                out = attention(
                    queries,
                    pools[0],
                    pools[1],
                    self.block_tables,
                    context_lens,
                    num_splits=num_splits,
                    scale=scale,
                    new_kv=(keys, values, *self.slots),
                    **extra_args,
                )
                storage.written_in_place.append(out)
                return out
            pools = storage.write(self.layer, self.slots, keys, values)
            return attention(
                queries,
                pools[0],
                pools[-1],  # (a key pool only, values_in_keys: not read)
                self.block_tables,
                context_lens,
                num_splits=num_splits,
                scale=scale,
                **extra_args,
            )
        pools = storage.write(self.layer, self.slots, keys, values)
        return self._attend_gathered(queries, pools, scale, window, softcap, sinks, values_in_keys, chunk)

    def _attend_gathered(self, queries, pools, scale, window, softcap, sinks, values_in_keys, chunk):
        """Quantized KV: the rows gathered densely and masked per row (window, chunk, soft-capping and sinks as
        given)."""
        all_keys, all_values = self.storage.gather(pools, self.block_tables, queries.dtype)
        all_values = read_values(all_keys, all_values, values_in_keys)
        k_pos = mx.arange(all_keys.shape[2])[None, :]
        mask = k_pos < self.context_lens[:, None]
        if window is not None:
            mask = mx.logical_and(mask, k_pos > self.offset[:, None] - window)
        if chunk is not None:  # the keys of the row's own chunk (Llama 4)
            mask = mx.logical_and(mask, k_pos >= (self.offset // chunk * chunk)[:, None])
        all_values = values_seen(all_values, mask)
        mask = mask[:, None, None, :]
        return scaled_dot_product_attention(queries, all_keys, all_values, scale, mask, softcap, sinks)

    def attend_stored(self, queries, scale, window=None, softcap=None):
        """LayerCache.attend_stored over the rows' blocks, writing nothing. Where the backend's kernel runs this
        layer's decode attention, it runs read-only (no `new_kv`): the pools already hold this step's keys, which the
        layer's own `attend` wrote (in place, on a kernel that writes them: this launch's queries come from that
        launch's output, so it runs after it; so do the combine counters' launches, which it shares)."""
        storage = self.storage
        pools = storage.pools[self.layer]
        if storage.kv_bits is None:
            attention, num_splits, on_kernel = storage.decode_attention(
                queries, pools, self.block_tables, window=window
            )
            extra_args = {"counters": storage.combine_counters[self.layer]} if on_kernel else {}
            extra_args.update({name: n for name, n in (("window", window), ("softcap", softcap)) if n is not None})
            return attention(
                queries,
                pools[0],
                pools[1],
                self.block_tables,
                self.context_lens,
                num_splits=num_splits,
                scale=scale,
                **extra_args,
            )
        all_keys, all_values = storage.gather(pools, self.block_tables, queries.dtype)
        k_pos = mx.arange(all_keys.shape[2])[None, :]
        mask = k_pos < self.context_lens[:, None]
        if window is not None:
            mask = mx.logical_and(mask, k_pos > self.offset[:, None] - window)
        all_values = values_seen(all_values, mask)
        return scaled_dot_product_attention(queries, all_keys, all_values, scale, mask[:, None, None, :], softcap)
