"""Dense per-layer KV cache for a batch of rows that share one timeline.

Rows of different prompt lengths are left-padded so they line up; `left_padding` hides the pad
keys from attention. RoPE only sees relative positions, so the shift the padding introduces does
not change any row's result.
"""

from __future__ import annotations

import mlx.core as mx

from .models.base import causal_mask, scaled_dot_product_attention


class KVCache:
    step = 256  # grow the buffers in chunks so decode does not reallocate every token

    def __init__(self, left_padding: list[int] | None = None):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.left_padding = mx.array(left_padding) if left_padding and any(left_padding) else None

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
               window: int | None = None, softcap: float | None = None) -> mx.array:
        mask = causal_mask(queries.shape[2], self.offset + keys.shape[2], self.left_padding, window)
        keys, values = self.update_and_fetch(keys, values)
        return scaled_dot_product_attention(queries, keys, values, scale, mask, softcap)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        batch, heads, length, _ = keys.shape
        start = self.offset
        if self.keys is None or start + length > self.keys.shape[2]:
            grow = (length + self.step - 1) // self.step * self.step
            new_k = mx.zeros((batch, heads, grow, keys.shape[3]), keys.dtype)
            new_v = mx.zeros((batch, heads, grow, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :start, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :start, :], new_v], axis=2)
        self.offset += length
        self.keys[..., start:self.offset, :] = keys
        self.values[..., start:self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def keep_rows(self, rows: list[int]) -> None:
        """Drop the batch rows not listed (a sequence finished)."""
        idx = mx.array(rows)
        if self.keys is not None:
            self.keys = self.keys[idx]
            self.values = self.values[idx]
        if self.left_padding is not None:
            self.left_padding = self.left_padding[idx]

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]


def make_cache(num_layers: int, left_padding: list[int] | None = None) -> list[KVCache]:
    return [KVCache(left_padding) for _ in range(num_layers)]
