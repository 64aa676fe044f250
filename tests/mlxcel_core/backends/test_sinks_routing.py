"""Attention sinks on a backend's paged decode kernel: a decode call with sinks takes the kernel with them (the CUDA
kernel joins each head's sink where it normalizes the output), as calls without sinks take it without. Shown on the
CPU with stand-in backends (this process's backend swapped by monkeypatching `backends._current`); the portable path
(kv/paged_attention.py, `sinks=`) is the reference."""

from __future__ import annotations

import mlx.core as mx
import pytest
from stand_in_backends import with_kernel

from mlxcel_core import backends
from mlxcel_core.backends.base import Backend
from mlxcel_core.backends.cuda.backend import CudaBackend
from mlxcel_core.engine.paged import PagedStorage
from mlxcel_core.kv.paged_attention import RUNNER_OPS, paged_decode_attention

HQ, HKV, D = 4, 2, 16
SINKS = mx.array([3.0, -2.0, 1.0, 0.0])


def decode_step(sinks):
    """A 6-token prefill then one decode step on a fresh storage; the step's attention output."""
    storage = PagedStorage(num_layers=1, block_size=4, kv_budget_tokens=64)
    storage.add(0, list(range(6)))
    k1, k2, k3 = mx.random.split(mx.random.key(0), 3)
    q, k, v = (mx.random.normal((1, h, 7, D), key=key) for h, key in ((HQ, k1), (HKV, k2), (HKV, k3)))
    (view,) = storage.prefill_caches(0, 0, 6)
    view.attend(q[:, :, :6], k[:, :, :6], v[:, :, :6], D**-0.5, sinks=sinks)
    (view,) = storage.decode_caches([0])
    return view.attend(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], D**-0.5, sinks=sinks)


@pytest.mark.parametrize("sinks", [None, SINKS], ids=["without-sinks", "with-sinks"])
def test_a_decode_call_takes_the_kernel_with_its_sinks(monkeypatch, sinks):
    monkeypatch.setattr(backends, "_current", Backend())
    want = decode_step(sinks)
    calls = []
    monkeypatch.setattr(backends, "_current", with_kernel(calls))
    got = decode_step(sinks)
    assert mx.allclose(got, want, atol=1e-6).item()
    assert calls == [("kernel", {} if sinks is None else {"sinks": SINKS})]


def test_only_latent_attention_leaves_the_cuda_kernel(monkeypatch):
    from mlxcel_core.backends.cuda import backend as cuda_backend

    monkeypatch.setattr(cuda_backend, "runner_for", lambda head_dim: "cuda-kernel-v1")  # as on a CUDA device
    cuda = CudaBackend()
    assert cuda.paged_runner_for(64) == "cuda-kernel-v1"
    assert cuda.paged_runner_for(64, values_in_keys=True) == RUNNER_OPS
    assert cuda.paged_attention(RUNNER_OPS) is paged_decode_attention
    assert Backend().paged_runner_for(64) == RUNNER_OPS


def test_a_gpt_oss_model_decodes_on_the_kernel_with_its_sinks(monkeypatch):
    """A random tiny gpt-oss through the paged engine under a kernel backend: every decode attention call takes the
    kernel with the layer's sinks (the sliding layer's with its window too), and the greedy tokens are the portable
    backend's."""
    from mlxcel_core.bench import RandomIdTokenizer
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.models import gpt_oss
    from mlxcel_core.sampling import SamplingParams

    args = gpt_oss.ModelArgs.from_dict(
        dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=HQ,
            num_key_value_heads=HKV,
            head_dim=D,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention"],
            vocab_size=64,
        )
    )

    def run():
        # A model of its own per run: where decode steps compile (a GPU), a trace made by the reference run would
        # replay the portable path without calling the stand-in.
        mx.random.seed(0)
        model = gpt_oss.Model(args)
        for layer in model.layers:
            layer.self_attn.sinks = mx.random.normal((HQ,)) * 3
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
    assert calls and all(name == "kernel" and "sinks" in kwargs for name, kwargs in calls)
    assert len([kwargs for _, kwargs in calls if kwargs.get("window") == 4]) == len(calls) // 2  # the sliding layer
