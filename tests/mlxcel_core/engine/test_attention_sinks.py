"""Attention sinks (gpt-oss: a learned logit per query head in each softmax's denominator) through every attention
path: the no-cache path, the dense KV cache (plain and quantized), compiled decode steps, and the paged storage's
prefill views (first chunk, later chunks, prompts prefilled together) and decode views (the portable paged decode
attention for full and sliding layers, the gathered path for quantized pools). Each against transformers' eager
definition: the scores with the sink logit appended, softmax, the sink's column dropped."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_core.cache import KVCache
from mlxcel_core.engine.compiled_decode import StepKV
from mlxcel_core.engine.paged import PagedStorage
from mlxcel_core.kv.paged_attention import paged_decode_attention
from mlxcel_core.models.base import attention, scaled_dot_product_attention

HQ, HKV, D, SCALE = 4, 2, 32, 32**-0.5
SINKS = mx.array([2.5, -1.0, 4.0, 0.5])  # large enough to move every output


def qkv(length, seed, rows=1):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    return (
        mx.random.normal((rows, HQ, length, D), key=k1),
        mx.random.normal((rows, HKV, length, D), key=k2),
        mx.random.normal((rows, HKV, length, D), key=k3),
    )


def eager(q, k, v, mask, sinks=SINKS, softcap=None):
    """transformers' eager_attention_forward with s_aux (modeling_gpt_oss.py), in numpy float64. mask: bool,
    broadcastable to [B, Hq, L, S], or None."""
    q, k, v = (np.array(a, dtype=np.float64) for a in (q, k, v))
    k, v = np.repeat(k, HQ // HKV, axis=1), np.repeat(v, HQ // HKV, axis=1)
    scores = q @ k.swapaxes(-1, -2) * SCALE
    if softcap is not None:
        scores = np.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = np.where(np.array(mask), scores, -np.inf)
    sink = np.broadcast_to(np.array(sinks, dtype=np.float64).reshape(1, -1, 1, 1), (*scores.shape[:-1], 1))
    combined = np.concatenate([scores, sink], axis=-1)
    combined = combined - combined.max(axis=-1, keepdims=True)
    probs = np.exp(combined) / np.exp(combined).sum(axis=-1, keepdims=True)
    return probs[..., :-1] @ v


def causal(length, total, window=None):
    """The last `length` of `total` positions query: keys at or before each, within `window` (bool [1, 1, L, S])."""
    queries, keys = np.arange(total - length, total)[:, None], np.arange(total)[None, :]
    mask = keys <= queries
    if window is not None:
        mask &= keys > queries - window
    return mask[None, None]


def close(got, want, atol=2e-5):
    np.testing.assert_allclose(np.array(got, dtype=np.float64), want, atol=atol, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_no_cache_path(window, softcap):
    q, k, v = qkv(12, 0)
    mask = causal(12, 12, window)
    close(
        attention(q, k, v, None, SCALE, window=window, softcap=softcap, sinks=SINKS),
        eager(q, k, v, mask, SINKS, softcap),
    )


def test_sinks_change_the_output():
    q, k, v = qkv(6, 1)
    with_sinks = scaled_dot_product_attention(q, k, v, SCALE, "causal", sinks=SINKS)
    assert float(mx.abs(with_sinks - scaled_dot_product_attention(q, k, v, SCALE, "causal")).max()) > 1e-2


def test_a_query_with_no_visible_key_gives_zeros():
    q, k, v = qkv(3, 2)
    out = scaled_dot_product_attention(q, k, v, SCALE, mx.zeros((1, 1, 3, 3), mx.bool_), sinks=SINKS)
    assert not mx.any(mx.isnan(out)).item() and float(mx.abs(out).max()) == 0.0


@pytest.mark.parametrize("kv_bits", [None, 8])
@pytest.mark.parametrize("window", [None, 5])
def test_dense_cache(kv_bits, window):
    """A prompt of 9 then three decode steps; quantized KV attends over its dequantized keys and values."""
    cache = KVCache(kv_bits=kv_bits)
    q, k, v = qkv(12, 3)
    for start, end in ((0, 9), (9, 10), (10, 11), (11, 12)):
        out = cache.attend(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], SCALE, window, sinks=SINKS)
        keys, values = cache._dequantized(mx.float32) if kv_bits else (k[:, :, :end], v[:, :, :end])
        mask = causal(end - start, end, window)
        close(out, eager(q[:, :, start:end], keys, values, mask), atol=2e-5 if kv_bits is None else 1e-4)


@pytest.mark.parametrize("window", [None, 4])
def test_compiled_decode_step(window):
    """StepKV (compiled decode): a left-padded row and a full one, one token each."""
    q, k, v = qkv(8, 4, rows=2)
    padding = mx.array([3, 0], mx.int32)
    keys = mx.zeros((2, HKV, 16, D)).at[:, :, :7].add(k[:, :, :7])
    values = mx.zeros((2, HKV, 16, D)).at[:, :, :7].add(v[:, :, :7])
    step = StepKV(keys, values, mx.array([7], mx.int32), padding)
    out = step.attend(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], SCALE, window, sinks=SINKS)
    columns = np.arange(8)
    visible = (columns[None] >= np.array(padding)[:, None]) & (columns[None] <= 7)
    if window:
        visible &= columns[None] > 7 - window
    close(out, eager(q[:, :, 7:], k, v, visible[:, None, None, :]))


@pytest.mark.parametrize("window", [None, 5])
def test_paged_prefill_chunks_and_decode(window):
    """A first chunk of 10 (attends over its own keys), a later one of 6 (gathers the blocks), then decode steps:
    full and sliding layers take paged_decode_attention with the sinks (and the window)."""
    storage = PagedStorage(num_layers=1, block_size=4, kv_budget_tokens=64)
    storage.add(0, list(range(16)))
    q, k, v = qkv(19, 5)
    for start, length in ((0, 10), (10, 6)):
        (view,) = storage.prefill_caches(0, start, length)
        sl = slice(start, start + length)
        out = view.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], SCALE, window, sinks=SINKS)
        close(
            out,
            eager(
                q[:, :, sl],
                k[:, :, : start + length],
                v[:, :, : start + length],
                causal(length, start + length, window),
            ),
        )
    for position in (16, 17, 18):
        (view,) = storage.decode_caches([0])
        sl = slice(position, position + 1)
        out = view.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], SCALE, window, sinks=SINKS)
        close(
            out, eager(q[:, :, sl], k[:, :, : position + 1], v[:, :, : position + 1], causal(1, position + 1, window))
        )


def test_paged_quantized_decode():
    storage = PagedStorage(num_layers=1, block_size=4, kv_budget_tokens=64, kv_bits=8)
    storage.add(0, list(range(9)))
    q, k, v = qkv(10, 6)
    (view,) = storage.prefill_caches(0, 0, 9)
    view.attend(q[:, :, :9], k[:, :, :9], v[:, :, :9], SCALE, sinks=SINKS)
    (view,) = storage.decode_caches([0])
    out = view.attend(q[:, :, 9:], k[:, :, 9:], v[:, :, 9:], SCALE, sinks=SINKS)
    keys, values = storage.gather(storage.pools[0], view.block_tables, mx.float32)
    close(out, eager(q[:, :, 9:], keys[:, :, :10], values[:, :, :10], None), atol=1e-4)


def test_paged_prompts_prefilled_together():
    storage = PagedStorage(num_layers=1, block_size=4, kv_budget_tokens=64)
    lengths = [7, 4]
    for seq, n in enumerate(lengths):
        storage.add(seq, list(range(n)))
    (view,) = storage.prefill_together_caches([0, 1], lengths)
    q, k, v = qkv(7, 7, rows=2)
    out = view.attend(q, k, v, SCALE, sinks=SINKS)
    real = np.arange(7)[None, :] >= np.array([0, 3])[:, None]  # row 1 is left-padded by 3
    mask = causal(7, 7) & real[:, None, None, :]
    want = eager(q, k, v, mask)
    close(out[0], want[0])
    close(out[1, :, 3:], want[1, :, 3:])  # (the pad rows' outputs are never read)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_attention(num_splits):
    """Rows of 9, 1 and 0 tokens over a shuffled block table: the sinks join each row's merged softmax; an empty
    row still gives zeros."""
    block_size, blocks = 4, 8
    k1, k2, k3 = mx.random.split(mx.random.key(8), 3)
    k_pool = mx.random.normal((blocks, block_size, HKV, D), key=k1)
    v_pool = mx.random.normal((blocks, block_size, HKV, D), key=k2)
    q = mx.random.normal((3, HQ, D), key=k3)
    tables = mx.array([[5, 2, 7], [1, 0, 0], [3, 0, 0]])
    lens = mx.array([9, 1, 0])
    out = paged_decode_attention(q, k_pool, v_pool, tables, lens, num_splits=num_splits, scale=SCALE, sinks=SINKS)
    for row in range(2):
        n = int(lens[row].item())
        dense_k = k_pool[tables[row]].reshape(-1, HKV, D)[:n].transpose(1, 0, 2)[None]
        dense_v = v_pool[tables[row]].reshape(-1, HKV, D)[:n].transpose(1, 0, 2)[None]
        close(out[row], eager(q[row][None, :, None], dense_k, dense_v, None)[0, :, 0])
    assert float(mx.abs(out[2]).max()) == 0.0
    with pytest.raises(ValueError, match="sinks must be"):
        paged_decode_attention(q, k_pool, v_pool, tables, lens, scale=SCALE, sinks=SINKS[:2])
