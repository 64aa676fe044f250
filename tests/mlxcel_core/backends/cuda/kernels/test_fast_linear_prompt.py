"""A prompt's rows on a 4-bit layer (mlxcel_core/backends/cuda/kernels/fast_linear.py's prompt_product): the
dequantized weight's 16-bit GEMM from PROMPT_MIN_ROWS rows, through a swapped layer and a fused projection; on CUDA,
greedy tokens kept. The layer swap and decode batches: test_fast_linear.py.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from test_fast_linear import _swap_every_layer  # noqa: F401 (autouse: every layer swapped, as there)
from test_qmv import needs_cuda

from mlxcel_core.backends.cuda.kernels import fast_linear, qmv
from mlxcel_core.backends.cuda.kernels.fast_linear import use_fast_quantized_linear


def test_a_prompt_multiplies_the_dequantized_weight(monkeypatch):
    """From PROMPT_MIN_ROWS rows of 16-bit x (a prompt; kernel_ready stands in for the GPU here) a swapped layer
    computes x @ dequantize(W).T, MLX's dequantized weight in x's dtype; fewer rows, float32 x or no GPU: MLX's
    quantized_matmul, as before."""
    layer = nn.QuantizedLinear(256, 96, bias=True, group_size=64, bits=4)
    layer.update({"scales": layer.scales.astype(mx.bfloat16), "biases": layer.biases.astype(mx.bfloat16)})
    holder = nn.Module()
    holder.layers = [layer]
    assert use_fast_quantized_linear(holder) == 1
    rows = fast_linear.PROMPT_MIN_ROWS
    x = mx.random.normal((1, rows, 256), key=mx.random.key(3)).astype(mx.bfloat16)
    full = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=64, bits=4, dtype=mx.bfloat16)
    want = x @ full.T + layer.bias
    mlx_own = nn.QuantizedLinear.__call__(layer, x)
    monkeypatch.setattr(qmv, "kernel_ready", lambda: False)
    assert mx.array_equal(layer(x), mlx_own).item()  # no GPU: MLX's own call
    monkeypatch.setattr(qmv, "kernel_ready", lambda: True)
    monkeypatch.setattr(qmv, "launch_args", lambda *args: None)  # (the matvec kernel takes no call here)
    assert mx.array_equal(layer(x), want).item()
    short = x[:, : rows - 1]
    assert mx.array_equal(layer(short), nn.QuantizedLinear.__call__(layer, short)).item()
    wide = x.astype(mx.float32)
    assert mx.array_equal(layer(wide), nn.QuantizedLinear.__call__(layer, wide)).item()


@needs_cuda
def test_prompt_products_keep_greedy_tokens_on_the_gpu(monkeypatch):
    """A random 4-bit llama-3.2-1b-shaped model (bf16) reading a 160-token prompt: its prefill products run as 16-bit
    GEMMs of the dequantized weights, and the greedy tokens after it are those of MLX's quantized_matmul prefill,
    except at a near-tie (the bounds of test_mma_decode_batch_keeps_greedy_tokens_on_the_gpu)."""
    import numpy as np

    from mlxcel_core.cache import make_cache
    from mlxcel_core.loading.shapes import build_random_model

    monkeypatch.undo()
    model, _ = build_random_model("llama-3.2-1b", bits=4, dtype="bfloat16", seed=2)
    prompt = mx.array([[(7 * i + 3) % 5000 for i in range(160)]])
    calls = []
    real = fast_linear.prompt_product

    def counted(x, *args):
        y = real(x, *args)
        calls.append(y is not None)
        return y

    def run(forced=None):
        cache = make_cache(len(model.layers))
        logits = model(prompt, cache)[:, -1]
        tokens, seen = [], []
        for i in range(40):
            seen.append(np.array(logits.astype(mx.float32))[0])
            tokens.append(int(mx.argmax(logits, axis=-1).item()) if forced is None else forced[i])
            logits = model(mx.array([[tokens[-1]]]), cache)[:, -1]
        return tokens, np.stack(seen)

    monkeypatch.setattr(fast_linear, "prompt_product", lambda *args: None)
    want, want_logits = run()
    monkeypatch.setattr(fast_linear, "prompt_product", counted)
    got, _ = run()
    assert calls.count(True) >= 3 * 16  # gate, up and down of every layer at prefill (q/k/v/o: below MIN_WEIGHT)
    _, forced = run(want)
    spread = float(want_logits.std())
    for step, (r, f) in enumerate(zip(want_logits, forced)):
        diff = float(abs(r - f).max())
        assert diff <= 0.25 * spread, f"step {step}: logits differ by {diff:.4g} (std {spread:.4g})"
        a, b = int(r.argmax()), int(f.argmax())
        assert a == b or r[a] - r[b] <= 2 * diff, f"step {step}: argmax {a} vs {b}, not a near-tie"
    print(f"prompt GEMM vs quantized_matmul: {sum(g == w for g, w in zip(got, want))} of 40 tokens identical")


def test_a_fused_projection_takes_a_prompt_as_one_gemm(monkeypatch):
    """Where the 4-bit kernels run a fused projection (q/k/v, gate/up), a prompt's rows take it too: one 16-bit GEMM
    of the fused weight dequantized, each layer's output a slice of it; short or float32 prompts do not."""
    from mlxcel_core.backends.cuda.kernels.fused_projections import FusedProjection

    def layer(n):
        made = nn.QuantizedLinear(256, n, bias=False, group_size=64, bits=4)
        made.update({"scales": made.scales.astype(mx.float16), "biases": made.biases.astype(mx.float16)})
        return made

    fused = FusedProjection([layer(128), layer(64), layer(64)])
    fused.kernel = True  # (as where the 4-bit kernels run it)
    x = mx.random.normal((2, fast_linear.PROMPT_MIN_ROWS // 2, 256), key=mx.random.key(4)).astype(mx.float16)
    monkeypatch.setattr(qmv, "kernel_ready", lambda: False)
    assert not fused.takes(x)  # no GPU
    monkeypatch.setattr(qmv, "kernel_ready", lambda: True)
    assert fused.takes(x) and not fused.takes(x[:, :-1]) and not fused.takes(x.astype(mx.float32))
    p = fused.params
    full = mx.dequantize(p["weight"], p["scales"], p["biases"], group_size=64, bits=4, dtype=mx.float16)
    q, k, v = fused.split(x)
    assert [t.shape for t in (q, k, v)] == [(2, 64, 128), (2, 64, 64), (2, 64, 64)]
    assert mx.array_equal(mx.concatenate([q, k, v], axis=-1), x @ full.T).item()
