"""Llama 4's chunked attention on a backend's paged decode kernel: a chunked decode call takes the kernel with its chunk
(the CUDA kernel cuts its splits from the row's own chunk), as the same model's full-attention layers take it without.
Shown on the CPU with stand-in backends (this process's backend swapped by monkeypatching `backends._current`); the
portable path's chunked attention (kv/paged_attention.py, `chunk=`) against a dense reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from stand_in_backends import with_kernel

from mlxcel_core import backends
from mlxcel_core.backends.base import Backend
from mlxcel_core.engine.paged import PagedStorage
from mlxcel_core.kv.paged_attention import paged_decode_attention
from mlxcel_core.models.base import causal_mask, scaled_dot_product_attention

HQ, HKV, D = 4, 2, 16
CHUNK = 4


def decode_step(chunk, prompt_len: int = 6):
    """A prompt_len-token prefill then one decode step on a fresh storage; the step's attention output."""
    storage = PagedStorage(num_layers=1, block_size=4, kv_budget_tokens=64)
    storage.add(0, list(range(prompt_len)))
    k1, k2, k3 = mx.random.split(mx.random.key(0), 3)
    n = prompt_len + 1
    q, k, v = (mx.random.normal((1, h, n, D), key=key) for h, key in ((HQ, k1), (HKV, k2), (HKV, k3)))
    (view,) = storage.prefill_caches(0, 0, prompt_len)
    view.attend(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], D**-0.5, chunk=chunk)
    (view,) = storage.decode_caches([0])
    got = view.attend(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], D**-0.5, chunk=chunk)
    want = scaled_dot_product_attention(q, k, v, D**-0.5, causal_mask(n, n, None, None, chunk))[:, :, -1:]
    return got, want


@pytest.mark.parametrize("chunk", [None, CHUNK], ids=["full", "chunked"])
def test_a_chunked_decode_call_takes_the_kernel_with_its_chunk(monkeypatch, chunk):
    monkeypatch.setattr(backends, "_current", Backend())
    portable, dense = decode_step(chunk)
    np.testing.assert_allclose(np.array(portable), np.array(dense), rtol=0, atol=1e-5)
    calls = []
    monkeypatch.setattr(backends, "_current", with_kernel(calls))
    got, _ = decode_step(chunk)
    assert mx.allclose(got, portable, atol=1e-6).item()
    assert calls == [("kernel", {} if chunk is None else {"chunk": CHUNK})]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_portable_chunked_decode_matches_dense_attention(num_splits):
    """Rows at positions in different chunks (the first of a chunk, its last, one past several chunks): each row's
    query sees its own chunk's keys only, however the key axis is split."""
    block_size, blocks = 4, 6
    lens = [1, 4, 5, 8, 19, 24]  # context lengths: the query is at len - 1
    B = len(lens)
    keys = mx.random.split(mx.random.key(1), 3)
    q = mx.random.normal((B, HQ, 1, D), key=keys[0])
    k_pool = mx.random.normal((B * blocks, block_size, HKV, D), key=keys[1])
    v_pool = mx.random.normal((B * blocks, block_size, HKV, D), key=keys[2])
    tables = mx.arange(B * blocks).reshape(B, blocks)[:, ::-1]  # blocks in no particular order
    got = paged_decode_attention(
        q, k_pool, v_pool, tables, mx.array(lens), num_splits=num_splits, scale=D**-0.5, chunk=CHUNK
    )
    for row, n in enumerate(lens):
        k = k_pool[tables[row]].reshape(-1, HKV, D)[:n].transpose(1, 0, 2)[None]
        v = v_pool[tables[row]].reshape(-1, HKV, D)[:n].transpose(1, 0, 2)[None]
        mask = causal_mask(1, n, None, None, CHUNK)
        want = scaled_dot_product_attention(q[row : row + 1], k, v, D**-0.5, mask)
        np.testing.assert_allclose(np.array(got[row : row + 1]), np.array(want), rtol=0, atol=1e-5)


def test_a_llama4_model_takes_the_kernel_on_every_layer(monkeypatch):
    """A random tiny Llama 4 through the paged engine under a kernel backend: the chunked (RoPE) layers' decode calls
    take the kernel with their chunk, the NoPE (full-attention) layers' without, and the greedy tokens are the
    portable backend's."""
    from mlxcel_core.bench import RandomIdTokenizer
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.models import llama4
    from mlxcel_core.sampling import SamplingParams

    args = llama4.ModelArgs.from_dict(
        dict(
            hidden_size=64,
            intermediate_size=64,
            intermediate_size_mlp=64,
            num_hidden_layers=2,
            num_attention_heads=HQ,
            num_key_value_heads=HKV,
            head_dim=D,
            num_local_experts=4,
            attention_chunk_size=CHUNK,
            no_rope_layer_interval=2,
            floor_scale=4,
            vocab_size=64,
        )
    )

    def run():
        # A model per run, the same weights: a compiled decode step (the default on a GPU) is traced once per model,
        # and a trace made under one backend would replay without calling the other's attention.
        mx.random.seed(0)
        model = llama4.Model(args)
        mx.eval(model.parameters())
        engine = Engine(model, RandomIdTokenizer(64), EngineConfig(max_batch_size=2, storage="paged", block_size=4))
        seqs = [engine.open(p, SamplingParams(max_tokens=8)) for p in ([5, 6, 7, 8, 9, 10], [11, 12])]
        while engine.has_work():
            engine.step()
        return [engine.sequence(s).output_ids for s in seqs]

    monkeypatch.setattr(backends, "_current", Backend())
    want = run()
    calls = []
    monkeypatch.setattr(backends, "_current", with_kernel(calls))
    assert run() == want
    assert calls and {name for name, _ in calls} == {"kernel"}
    chunked = [kwargs for _, kwargs in calls if kwargs.get("chunk") == CHUNK]
    assert len(chunked) == len(calls) // 2  # one chunked and one full layer
