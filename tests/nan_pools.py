"""Paged KV pools whose fresh slots hold NaN: a slot no row owns (a block's tail past its row's length, a padded block
table's entry, a freed block) must never reach an output, and NaN there makes any read of one show."""

from __future__ import annotations

import math

import mlx.core as mx

from mlxcel_core.engine.paged import PagedStorage


def nan_filled(layer_pools):
    """PagedStorage.layer_pools whose new rows (a layer's first pools, or the rows a growth adds) are NaN where the
    pool holds floats (a quantized pool's scales and biases; its packed values are integers)."""

    def fill(self, layer, parts):
        before = self.pools[layer]
        pools = layer_pools(self, layer, parts)
        if pools is before:
            return pools
        old = 0 if before is None else before[0].shape[0]
        self.pools[layer] = [
            mx.concatenate([p[:old], mx.full(p[old:].shape, math.nan, p.dtype)])
            if mx.issubdtype(p.dtype, mx.floating)
            else p
            for p in pools
        ]
        return self.pools[layer]

    return fill


def use_nan_pools(monkeypatch) -> None:
    monkeypatch.setattr(PagedStorage, "layer_pools", nan_filled(PagedStorage.layer_pools))
