"""backends/cpu_norm.py: on the CPU, nn.RMSNorm runs as one compiled function with mx.fast.rms_norm's bits (checked
once a process; nothing is swapped where the check fails), fewer graph nodes, the same greedy tokens."""

from __future__ import annotations

import io

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxcel_core.backends import cpu_norm
from mlxcel_core.loading.shapes import build_random_model

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="on the CPU only")


def test_the_check_passes_here_and_the_norm_is_mx_fast_rms_norms():
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        assert cpu_norm.exact(dtype, dtype) and cpu_norm.exact(mx.float32, dtype)
        plain, swapped = nn.RMSNorm(96, eps=1e-5), nn.RMSNorm(96, eps=1e-5)
        plain.weight = swapped.weight = mx.random.normal((96,), key=mx.random.key(3)).astype(dtype)
        swapped.__class__ = cpu_norm.CompiledRMSNorm
        x = (mx.random.normal((5, 7, 96), key=mx.random.key(4)) * 30).astype(dtype)
        assert mx.array_equal(swapped(x), plain(x)).item()
        graph = io.StringIO()
        mx.export_to_dot(graph, swapped(x))
        assert graph.getvalue().count("label") < 8  # (the fallback's ten ops as three nodes, with the inputs)


def test_a_failed_check_swaps_nothing(monkeypatch):
    asked = []
    monkeypatch.setattr(cpu_norm, "exact", lambda x, w: asked.append((x, w)) or w != mx.bfloat16)
    model, _ = build_random_model("tiny", dtype="float32", seed=3)  # (prepare_model runs prepare)
    assert type(model.model.norm) is cpu_norm.CompiledRMSNorm and asked == [(mx.float32, mx.float32)]
    model, _ = build_random_model("tiny", dtype="bfloat16", seed=3)
    assert not any(type(m) is cpu_norm.CompiledRMSNorm for _, m in model.named_modules())


def test_greedy_tokens_are_the_fallbacks():
    from test_cpu_float32_layers import PROMPTS, _greedy

    model, config = build_random_model("tiny", dtype="float32", seed=5)
    norms = [m for _, m in model.named_modules() if isinstance(m, nn.RMSNorm)]
    assert norms and all(type(m) is cpu_norm.CompiledRMSNorm for m in norms)
    swapped = _greedy(model, config, PROMPTS)
    assert cpu_norm.unprepare(model) == len(norms)
    assert _greedy(model, config, PROMPTS) == swapped
