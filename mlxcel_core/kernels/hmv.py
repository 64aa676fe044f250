"""The decode matvec kernel for 16-bit weights: x @ W.T for a bf16/fp16 W [N, K] and 1..MAX_ROWS rows of x, on MLX's
CUDA backend (mx.fast.cuda_kernel), in every mode of the 4-bit kernel (plain, qkv, swiglu, residual and the folded
RMSNorm): kernels/qmv_source.py's reductions and epilogues around a 16-bit main loop (`_MAIN_HALF`).

    y = launch(launch_args(x.shape, x.dtype, w.dtype, w.shape[0]), x, w)

Why: on the H200 MLX's bf16 GEMV reads a 16384 x 8192 weight at 2.1 TB/s, 49% of the copy bandwidth
(../shared/gpu/README.md), and the fused decode projections (kernels/fused_projections.py) of bf16 models are a
matmul plus a split plus the activation, and the residual adds separate launches; in these modes each is one launch.

Gate (`enabled`): MLX on CUDA, and MLXCEL_HMV=1, or unset and the model at most DEFAULT_MAX_HIDDEN wide. On the H200 its
tests pass (against float64, every mode, and a llama-3.2-1b decode against MLX's matmuls); alone it reads a single
row slower than MLX's GEMV at the default launch shapes (benchmarks/hmv.py), so its wins come from the fused launches,
which is why wide (bandwidth-bound) models keep MLX's.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from . import qmv
from .qmv_source import MODES, base_mode, header, kernel_name, kernel_source

ENV = "MLXCEL_HMV"
MAX_ROWS = qmv.MAX_ROWS
CHUNK = 8  # elements of K per lane per step (one 16-byte load of a weight row)
WEIGHT_TYPES = (mx.bfloat16, mx.float16)


# MLXCEL_HMV unset: the kernel serves 16-bit models up to this hidden size (see enabled()).
DEFAULT_MAX_HIDDEN = 2048


def enabled(hidden_size: int | None = None) -> bool:
    """Whether a 16-bit model `hidden_size` wide gets the kernel (MLX on CUDA only): MLXCEL_HMV=1 or 0 decides;
    unset, models up to DEFAULT_MAX_HIDDEN wide. Their decode is launch-bound, and the kernel's fused launches
    (q/k/v, gate/up with SwiGLU, residual adds) save more than its lower single-row bandwidth costs; on wider
    models it loses (H200, benchmarks/RESULTS.md: llama-3.2-1b bf16 1.35x mlx-lm with it, 1.05x without;
    llama-3-8b bf16 0.68x with it, 1.22x without)."""
    if not qmv.cuda_kernel_available():
        return False
    env = os.environ.get(ENV, "").strip()
    if env in ("0", "1"):
        return env == "1"
    return hidden_size is not None and hidden_size <= DEFAULT_MAX_HIDDEN


def shape_supported(x_shape, x_dtype, w_shape, w_dtype) -> bool:
    """Whether the kernel handles these operands (shapes and dtypes only)."""
    if len(w_shape) != 2 or w_dtype not in WEIGHT_TYPES or x_dtype not in qmv.FLOAT_TYPES or len(x_shape) < 1:
        return False
    n, k = w_shape
    return n >= 1 and k >= CHUNK and k % CHUNK == 0 and x_shape[-1] == k and 1 <= qmv.rows_of(x_shape) <= MAX_ROWS


def launch_config(n: int, k: int, m: int) -> tuple[int, int, int]:
    """(ROWS, WARPS, UNROLL): qmv.launch_config's rule with this kernel's chunk (each warp keeps at least two rounds
    of K, 512 elements). Not yet tuned on a GPU (benchmarks/qmv.py's sweep is for the 4-bit kernel)."""
    rows = 8 if n > 16384 else 4
    blocks = -(-n // rows)
    warps = 1
    while warps < 8 and blocks * warps < 2048 and k >= warps * 2 * 32 * CHUNK:
        warps *= 2
    return rows, warps, 1


@functools.lru_cache(maxsize=4096)
def launch_args(x_shape: tuple, x_dtype, w_dtype, n: int, config: tuple | None = None, max_rows: int = MAX_ROWS,
                mode: str = "plain", split: tuple[int, ...] | None = None) -> dict | None:
    """Everything but the inputs of one launch, or None when x does not suit the kernel (qmv.launch_args' rules)."""
    m = qmv.rows_of(x_shape)
    if not 1 <= m <= max_rows or x_dtype not in qmv.FLOAT_TYPES or w_dtype not in WEIGHT_TYPES:
        return None
    rows, warps, unroll = config or launch_config(n, x_shape[-1], m)
    template = [("T", x_dtype), ("CFG", qmv.pack_config(m, 0, rows, warps, unroll))]
    return qmv.mode_layout(mode, n, m, rows, warps, split, x_shape, mx.result_type(x_dtype, w_dtype), template)


@functools.cache
def _kernel(mode: str = "plain"):
    return mx.fast.cuda_kernel(
        name=kernel_name(mode, "half"),
        input_names=["x", "w", *MODES[mode][0]],
        output_names=list(MODES[mode][1]),
        source=kernel_source(mode, "half"),
        header=header("half"),
    )


def launch(args: dict, x: mx.array, w: mx.array, mode: str = "plain", extra: tuple = ()):
    """Run the kernel with `launch_args`' result (qmv.launch's outputs and extra inputs per mode)."""
    outputs = _kernel(mode)(inputs=[x, w, *extra], **args)
    return outputs if base_mode(mode) == "qkv" else outputs[0]

