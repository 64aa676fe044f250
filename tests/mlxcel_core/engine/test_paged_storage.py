"""PagedStorage's prefill views: a sequence's first chunk attends over its own keys, later chunks gather."""

import mlx.core as mx
import pytest

from mlxcel_core.engine.paged import PagedStorage
from mlxcel_core.models.base import causal_mask, scaled_dot_product_attention


def _qkv(length, seed, heads=4, kv_heads=2, dim=8):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((1, heads, length, dim), key=k1), mx.random.normal((1, kv_heads, length, dim), key=k2),
            mx.random.normal((1, kv_heads, length, dim), key=k3))


def _gathered_reference(storage, view, queries, start, length, scale, window, softcap):
    """What a prefill chunk computed before the first-chunk shortcut: attend over the blocks read back."""
    keys, values = storage.gather(storage.pools[view.layer], view.blocks[None], queries.dtype)
    total = start + length
    mask = causal_mask(length, total, None, window)
    return scaled_dot_product_attention(queries, keys[:, :, :total], values[:, :, :total], scale, mask, softcap)


@pytest.mark.parametrize("window, softcap", [(None, None), (4, None), (None, 5.0)])
def test_first_and_later_chunks_equal_attention_over_the_blocks(window, softcap):
    storage = PagedStorage(num_layers=1, block_size=4, kv_budget_tokens=64)
    storage.add(0, list(range(16)))
    for start, length, seed in ((0, 10, 1), (10, 6, 2)):  # a first chunk of 10, then one of 6 (gathers)
        (view,) = storage.prefill_caches(0, start, length)
        q, k, v = _qkv(length, seed)
        out = view.attend(q, k, v, 0.5, window=window, softcap=softcap)
        expected = _gathered_reference(storage, view, q, start, length, 0.5, window, softcap)
        assert mx.array_equal(out, expected), (start, mx.abs(out - expected).max())
        keys, _ = storage.gather(storage.pools[0], view.blocks[None], q.dtype)
        assert mx.array_equal(keys[:, :, start:start + length], k)  # the blocks hold the chunk either way
