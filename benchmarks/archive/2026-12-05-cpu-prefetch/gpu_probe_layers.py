"""Where the separate decode of a tiny bf16 4-bit model goes wrong on CUDA (gpu_probe.sh's follow-up): the float32
model first (as on worker gw0), then the bf16 one, each product's output against the same product on the CPU stream."""

import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, "tests/mlxcel_core/backends/cuda/kernels")
from test_fused_projections import _decode_logits  # noqa: E402

from mlxcel_core.backends.cuda.kernels import fast_linear  # noqa: E402
from mlxcel_core.backends.cuda.kernels.fused_projections import unfuse_projections  # noqa: E402
from mlxcel_core.loading.shapes import build_random_model  # noqa: E402

bad = []
orig = fast_linear.FastQuantizedLinear.__call__


def checked(self, x):
    y = orig(self, x)
    with mx.stream(mx.cpu):
        want = mx.quantized_matmul(x, self["weight"], self["scales"], self["biases"], True, self.group_size, self.bits)
        mx.eval(want)
    mx.eval(y)
    err = float(np.abs(np.array(y.astype(mx.float32)) - np.array(want.astype(mx.float32))).max())
    scale = float(np.abs(np.array(want.astype(mx.float32))).max())
    if not err <= 0.05 * scale + 1e-3:
        bad.append((tuple(x.shape), x.dtype, y.dtype, tuple(self["weight"].shape), err, scale))
    return y


fast_linear.FastQuantizedLinear.__call__ = checked
for dtype in sys.argv[1:] or ["float32", "bfloat16"]:
    model, _ = build_random_model("tiny", bits=4, dtype=dtype, seed=3)
    unfuse_projections(model)
    out = _decode_logits(model, 1)
    a = np.array(out.astype(mx.float32))
    print(
        dtype, "logits", out.dtype, "zeros at even places:", float((a[:, ::2] == 0).mean()), "bad products:", len(bad)
    )
    for b in bad[:6]:
        print("   ", b)
    bad.clear()
