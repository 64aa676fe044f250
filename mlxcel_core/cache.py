"""Dense KV caches: one per layer, holding a batch of rows that share one column axis.

Rows of different lengths are left-padded so their newest tokens line up in the last column;
`left_padding` hides the pad columns from attention and RoPE gets each row's true position, so a
row's numbers are the same whether it decodes alone or in a batch.

With `kv_bits` (8 or 4) keys and values are stored quantized (group size 64 along the head
dimension) and dequantized when read: the memory shrinks, the attention maths stays in full precision.

A recurrent layer's cache (models.base.RecurrentCache: gated delta-net, short convolution) holds no keys: its
`recurrent` parts are one state per row, [B, ...], replaced by each forward; `columns` still counts the tokens it has
seen, so batch membership (rows kept, joined, copied out) works alike. Such a state cannot be cut back to fewer
tokens (`trimmable`).
"""

from __future__ import annotations

import mlx.core as mx

from .models.base import causal_mask, scaled_dot_product_attention

KV_GROUP_SIZE = 64


def kv_group_size(head_dim: int) -> int:
    """64 as asked for; 32 for heads too small for it (tiny test models). MLX supports no smaller."""
    for group in (KV_GROUP_SIZE, 32):
        if head_dim % group == 0:
            return group
    raise ValueError(f"quantized KV needs a head dimension divisible by 32, got {head_dim}")


class KVCache:
    step = 256  # grow the buffers in chunks so decode does not reallocate every token

    def __init__(self, left_padding: list[int] | None = None, kv_bits: int | None = None):
        self.keys: mx.array | None = None  # [B, H, capacity, D] (or packed, when quantized)
        self.values: mx.array | None = None
        self.columns = 0  # columns in use, padding included
        self.left_padding = mx.array(left_padding) if left_padding and any(left_padding) else None
        self.kv_bits = kv_bits
        self._scales: list[mx.array] | None = None  # k scales, k biases, v scales, v biases
        self.recurrent: list[mx.array] | None = None  # a recurrent layer's state parts, [B, ...] each

    # -- LayerCache protocol -----------------------------------------------------------------------
    @property
    def offset(self) -> int | mx.array:
        """Each row's position for the next token."""
        return self.columns if self.left_padding is None else self.columns - self.left_padding

    def attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: mx.array | None = None,
        values_in_keys: int | None = None,
        chunk: int | None = None,
    ) -> mx.array:
        """`values_in_keys` n (multi-head latent attention): the values are keys[..., :n], `values` is not read, and
        the cache stores the keys only (its value buffers have width 0). `chunk` (Llama 4's chunked attention): a
        query sees only its own chunk's keys (causal_mask; every key stays stored)."""
        mask = causal_mask(queries.shape[2], self.columns + keys.shape[2], self.left_padding, window, chunk)
        if values_in_keys is not None:
            keys, _ = self.update_and_fetch(keys, keys[..., :0])
            values = keys[..., :values_in_keys]
        else:
            keys, values = self.update_and_fetch(keys, values)
        return scaled_dot_product_attention(queries, keys, values, scale, mask, softcap, sinks)

    # -- RecurrentCache protocol ---------------------------------------------------------------------
    def recurrent_state(self) -> list[mx.array] | None:
        return self.recurrent

    def update_state(self, state: list[mx.array], length: int) -> None:
        self.recurrent = list(state)
        self.columns += length

    @property
    def state_padding(self) -> mx.array | None:
        """A dense cache's inputs are one sequence's tokens or one token per row: the rows of its first forward are
        left-padded by `left_padding` (make_cache), later ones not at all."""
        return self.left_padding if self.columns == 0 else None

    def trimmable(self, columns: int) -> bool:
        """Whether `trim(columns)` can keep exactly the first `columns` tokens: not for a recurrent state that has
        seen more (it cannot be cut back)."""
        return self.recurrent is None or columns >= self.columns

    def attend_stored(
        self, queries: mx.array, scale: float, window: int | None = None, softcap: float | None = None
    ) -> mx.array:
        """Attention over the keys/values stored so far (this step's included), storing nothing: a KV-shared layer
        (Gemma 4) reading the cache of the layer whose keys it reuses."""
        mask = causal_mask(queries.shape[2], self.columns, self.left_padding, window)
        if self.kv_bits is None:
            keys, values = self.keys[..., : self.columns, :], self.values[..., : self.columns, :]
        else:
            keys, values = self._dequantized(queries.dtype)
        return scaled_dot_product_attention(queries, keys, values, scale, mask, softcap)

    # -- storage -------------------------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        batch, heads, length, dim = keys.shape
        start = self.columns
        if self.keys is None or start + length > self.capacity:
            self._grow(batch, heads, dim, start + length, keys.dtype, values.shape[-1])
        self.columns += length
        if self.kv_bits is None:
            self.keys[..., start : self.columns, :] = keys
            self.values[..., start : self.columns, :] = values
            return self.keys[..., : self.columns, :], self.values[..., : self.columns, :]
        for packed, scales, biases, new in (
            (self.keys, *self._scales[:2], keys),
            (self.values, *self._scales[2:], values),
        ):
            q, s, b = mx.quantize(new, group_size=kv_group_size(dim), bits=self.kv_bits)
            packed[..., start : self.columns, :] = q
            scales[..., start : self.columns, :] = s
            biases[..., start : self.columns, :] = b
        return self._dequantized(keys.dtype)

    def reserve(self, length: int) -> None:
        """Make room for `length` more columns of a non-empty, unquantized cache (compiled decode steps write into
        the buffer themselves)."""
        if self.columns + length > self.capacity:
            batch, heads, _, dim = self.keys.shape
            self._grow(batch, heads, dim, self.columns + length, self.keys.dtype, self.values.shape[-1])

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _grow(
        self, batch: int, heads: int, dim: int, columns: int, dtype: mx.Dtype, value_dim: int | None = None
    ) -> None:
        """Room for `columns` columns, rounded up to a multiple of `step` (so compiled decode steps, which trace
        once per capacity, see few distinct capacities). `value_dim`: the values' head size, when not `dim` (0: a
        layer whose values are its keys' prefix stores none)."""
        grow = (columns + self.step - 1) // self.step * self.step - self.columns
        vdim = dim if value_dim is None else value_dim
        if self.kv_bits is None:
            shapes = [(dim, dtype), (vdim, dtype)]
        else:
            group = kv_group_size(dim)
            packed, v_packed = dim * self.kv_bits // 32, vdim * self.kv_bits // 32
            shapes = [(packed, mx.uint32), (v_packed, mx.uint32)] + [(dim // group, dtype)] * 2
            shapes += [(vdim // group, dtype)] * 2
        fresh = [mx.zeros((batch, heads, grow, d), t) for d, t in shapes]
        old = self._arrays()
        if old:
            fresh = [mx.concatenate([o[..., : self.columns, :], f], axis=2) for o, f in zip(old, fresh)]
        self.keys, self.values = fresh[0], fresh[1]
        self._scales = fresh[2:] if self.kv_bits is not None else None

    def _arrays(self) -> list[mx.array]:
        if self.keys is None:
            return []
        return [self.keys, self.values] + (self._scales or [])

    def _set_arrays(self, arrays: list[mx.array]) -> None:
        if not arrays:  # an empty cache's rows (a KV-shared layer's, which stores nothing): still empty
            self.keys = self.values = self._scales = None
            return
        self.keys, self.values = arrays[0], arrays[1]
        if self.kv_bits is not None:
            self._scales = arrays[2:]

    def _dequantized(self, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        n = self.columns
        ks, kb, vs, vb = (a[..., :n, :] for a in self._scales)
        group = self.keys.shape[-1] * 32 // self.kv_bits // ks.shape[-1]
        k = mx.dequantize(self.keys[..., :n, :], ks, kb, group_size=group, bits=self.kv_bits)
        v = mx.dequantize(self.values[..., :n, :], vs, vb, group_size=group, bits=self.kv_bits)
        return k.astype(dtype), v.astype(dtype)

    @property
    def state(self) -> list[mx.array]:
        """What the cache holds: its keys/values (so far), or a recurrent layer's state parts."""
        return self._kv_state() + (self.recurrent or [])

    def _kv_state(self) -> list[mx.array]:
        return [a[..., : self.columns, :] for a in self._arrays()]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays() + (self.recurrent or []))

    def _rows(self) -> int:
        return (self.keys if self.keys is not None else self.recurrent[0]).shape[0]

    # -- batch membership --------------------------------------------------------------------------
    def keep_rows(self, rows: list[int]) -> None:
        """Drop the batch rows not listed, then the pad columns no remaining row needs."""
        idx = mx.array(rows)
        self._set_arrays([a[idx] for a in self._arrays()])
        if self.recurrent is not None:
            self.recurrent = [s[idx] for s in self.recurrent]
        if self.left_padding is None:
            return
        self.left_padding = self.left_padding[idx]
        trim = int(mx.min(self.left_padding).item())
        if trim > 0:
            self._set_arrays([a[..., trim:, :] for a in self._arrays()])
            self.columns -= trim
            self.left_padding = self.left_padding - trim
        if not mx.any(self.left_padding).item():
            self.left_padding = None

    def trim(self, columns: int) -> None:
        """Forget everything after the first `columns` columns (a single-row cache with no padding; an empty one, a
        KV-shared layer's, stays empty). A recurrent state cannot be cut back (`trimmable`)."""
        if not self.trimmable(columns):
            raise ValueError("a recurrent layer's state cannot be cut back to fewer tokens")
        self.columns = max(0, min(self.columns, columns))

    def row(self, row: int) -> "KVCache":
        """A single-row copy of one batch row, without its left padding."""
        pad = 0 if self.left_padding is None else int(self.left_padding[row].item())
        single = KVCache(kv_bits=self.kv_bits)
        single._set_arrays([a[row : row + 1, :, pad : self.columns, :] for a in self._arrays()])
        single.columns = self.columns - pad
        if self.recurrent is not None:
            single.recurrent = [s[row : row + 1] for s in self.recurrent]
        return single

    def append_rows(self, other: "KVCache") -> None:
        """Add `other`'s rows to this batch, left-padding whichever side is shorter."""
        if self.keys is None and self.recurrent is None:
            self._set_arrays(other._kv_state())
            self.columns, self.left_padding, self.recurrent = other.columns, other.left_padding, other.recurrent
            return
        mine, theirs = self.columns, other.columns
        width = max(mine, theirs)
        pad_mine = _padding(self.left_padding, self._rows()) + (width - mine)
        pad_theirs = _padding(other.left_padding, other._rows()) + (width - theirs)
        merged = [
            mx.concatenate([_left_pad(a, width - mine), _left_pad(b, width - theirs)], axis=0)
            for a, b in zip(self._kv_state(), other._kv_state())
        ]
        self._set_arrays(merged)
        if self.recurrent is not None:  # a state per row: no columns to align
            self.recurrent = [mx.concatenate([a, b], axis=0) for a, b in zip(self.recurrent, other.recurrent)]
        self.columns = width
        padding = mx.concatenate([pad_mine, pad_theirs])
        self.left_padding = padding if mx.any(padding).item() else None


def _padding(left_padding: mx.array | None, rows: int) -> mx.array:
    return mx.zeros((rows,), mx.int32) if left_padding is None else left_padding.astype(mx.int32)


def _left_pad(a: mx.array, columns: int) -> mx.array:
    if columns == 0:
        return a
    return mx.concatenate([mx.zeros((*a.shape[:2], columns, a.shape[3]), a.dtype), a], axis=2)


def make_cache(num_layers: int, left_padding: list[int] | None = None, kv_bits: int | None = None) -> list[KVCache]:
    if kv_bits not in (None, 4, 8):
        raise ValueError(f"kv_bits must be 4 or 8, got {kv_bits}")
    return [KVCache(left_padding, kv_bits) for _ in range(num_layers)]
