"""A sliding-window layer's paged decode runs the backend's decode kernel with its window (the CUDA kernel cuts its
splits from the row's last `window` positions), and a soft-capped one (Gemma 2) with its cap, not a dense gather of
every key. Shown on the CPU with the stand-in kernel backend (this process's backend swapped by monkeypatching
`backends._current`); the portable path's window and soft-capping against dense attention with causal_mask's window."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from stand_in_backends import with_kernel

from mlxcel_core import backends
from mlxcel_core.backends.base import Backend
from mlxcel_core.kv.paged_attention import paged_decode_attention
from mlxcel_core.models.base import causal_mask, scaled_dot_product_attention

HQ, HKV, D = 4, 2, 16


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 3, 8, 100])
def test_portable_windowed_decode_matches_dense_attention(num_splits, window):
    """Rows shorter and longer than the window, one of them a block-boundary length: each query (at len - 1) sees the
    keys with q - k < window only, however the key axis is split."""
    block_size, blocks = 4, 6
    lens = [1, 3, 4, 9, 17, 24]
    B = len(lens)
    keys = mx.random.split(mx.random.key(2), 3)
    q = mx.random.normal((B, HQ, 1, D), key=keys[0])
    k_pool = mx.random.normal((B * blocks, block_size, HKV, D), key=keys[1])
    v_pool = mx.random.normal((B * blocks, block_size, HKV, D), key=keys[2])
    tables = mx.arange(B * blocks).reshape(B, blocks)[:, ::-1]
    got = paged_decode_attention(
        q, k_pool, v_pool, tables, mx.array(lens), num_splits=num_splits, scale=D**-0.5, window=window
    )
    for row, n in enumerate(lens):
        k = k_pool[tables[row]].reshape(-1, HKV, D)[:n].transpose(1, 0, 2)[None]
        v = v_pool[tables[row]].reshape(-1, HKV, D)[:n].transpose(1, 0, 2)[None]
        want = scaled_dot_product_attention(q[row : row + 1], k, v, D**-0.5, causal_mask(1, n, None, window))
        np.testing.assert_allclose(np.array(got[row : row + 1]), np.array(want), rtol=0, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 3])
def test_portable_softcapped_decode_matches_dense_attention(num_splits, window):
    block_size, blocks, softcap = 4, 6, 2.0
    lens = [1, 4, 9, 24]
    B = len(lens)
    keys = mx.random.split(mx.random.key(3), 3)
    q = mx.random.normal((B, HQ, 1, D), key=keys[0]) * 3  # (scores well past the cap)
    k_pool = mx.random.normal((B * blocks, block_size, HKV, D), key=keys[1])
    v_pool = mx.random.normal((B * blocks, block_size, HKV, D), key=keys[2])
    tables = mx.arange(B * blocks).reshape(B, blocks)
    kwargs = dict(num_splits=num_splits, scale=D**-0.5, window=window)
    got = paged_decode_attention(q, k_pool, v_pool, tables, mx.array(lens), softcap=softcap, **kwargs)
    uncapped = paged_decode_attention(q, k_pool, v_pool, tables, mx.array(lens), **kwargs)
    assert mx.abs(got - uncapped).max().item() > 1e-2  # the cap matters
    for row, n in enumerate(lens):
        k = k_pool[tables[row]].reshape(-1, HKV, D)[:n].transpose(1, 0, 2)[None]
        v = v_pool[tables[row]].reshape(-1, HKV, D)[:n].transpose(1, 0, 2)[None]
        mask = causal_mask(1, n, None, window)
        want = scaled_dot_product_attention(q[row : row + 1], k, v, D**-0.5, mask, softcap)
        np.testing.assert_allclose(np.array(got[row : row + 1]), np.array(want), rtol=0, atol=1e-5)


def test_a_bad_window_is_a_value_error():
    q, pool = mx.zeros((1, HQ, D)), mx.zeros((2, 4, HKV, D))
    for window in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            paged_decode_attention(q, pool, pool, mx.zeros((1, 2), mx.int32), mx.array([3]), window=window)


def tiny_args(family: str, **extra):
    """A random tiny config of `family` (two layers: a window-3 one and a full one), and its Model class."""
    import importlib

    module = importlib.import_module(f"mlxcel_core.models.{family}")
    base = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HQ)
    base.update(num_key_value_heads=HKV, head_dim=D, sliding_window=3, vocab_size=64)
    return module.ModelArgs.from_dict({**base, **extra}), module.Model


def engine_tokens(family: str, storage: str, **extra) -> list[list[int]]:
    """Two rows' greedy tokens through the engine, a model of its own per run with the same weights (a compiled
    decode step, the default on a GPU, is traced once per model)."""
    from mlxcel_core.bench import RandomIdTokenizer
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.sampling import SamplingParams

    args, model_class = tiny_args(family, **extra)
    mx.random.seed(0)
    model = model_class(args)
    mx.eval(model.parameters())
    engine = Engine(model, RandomIdTokenizer(64), EngineConfig(max_batch_size=2, storage=storage, block_size=4))
    seqs = [engine.open(p, SamplingParams(max_tokens=10)) for p in ([5, 6, 7, 8, 9, 10], [11, 12])]
    while engine.has_work():
        engine.step()
    return [engine.sequence(s).output_ids for s in seqs]


def kernel_calls(monkeypatch, family: str, **extra) -> list:
    """The stand-in kernel backend's calls in a paged run of `family`, checked to give the greedy tokens of the dense
    storage (causal_mask's window) and of the portable backend's paged run."""
    monkeypatch.setattr(backends, "_current", Backend())
    want = engine_tokens(family, "dense", **extra)
    assert engine_tokens(family, "paged", **extra) == want
    calls = []
    monkeypatch.setattr(backends, "_current", with_kernel(calls))
    assert engine_tokens(family, "paged", **extra) == want
    assert calls and {name for name, _ in calls} == {"kernel"}
    return [kwargs for _, kwargs in calls]


def test_a_sliding_window_model_takes_the_kernel_on_every_layer(monkeypatch):
    """A random tiny OLMo 3 (a window-3 layer and a full one) through the paged engine under a kernel backend: both
    layers' decode calls take the kernel, the sliding one with its window."""
    calls = kernel_calls(monkeypatch, "olmo3", layer_types=["sliding_attention", "full_attention"])
    assert len([kwargs for kwargs in calls if kwargs.get("window") == 3]) == len(calls) // 2  # one layer of two


def test_a_softcapped_model_takes_the_kernel_with_its_cap(monkeypatch):
    """A random tiny Gemma 2 (soft-capped attention; a window-3 layer and a full one): every decode call takes the
    kernel with the cap, the sliding one with its window too."""
    calls = kernel_calls(monkeypatch, "gemma2", attn_logit_softcapping=2.0, final_logit_softcapping=30.0)
    assert all(kwargs.get("softcap") == 2.0 for kwargs in calls)
    assert len([kwargs for kwargs in calls if kwargs.get("window") == 3]) == len(calls) // 2
