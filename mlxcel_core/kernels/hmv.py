"""The decode matvec kernel for 16-bit weights: x @ W.T for a bf16/fp16 W [N, K] and 1..MAX_ROWS rows of x, on MLX's
CUDA backend (mx.fast.cuda_kernel), in every mode of the 4-bit kernel (plain, qkv, swiglu, residual and the folded
RMSNorm): kernels/qmv_source.py's reductions and epilogues around a 16-bit main loop (`_MAIN_HALF`).

    y = launch(launch_args(x.shape, x.dtype, w.dtype, w.shape[0]), x, w)

Why: on the H200 MLX's bf16 GEMV reads a 16384 x 8192 weight at 2.1 TB/s, 49% of the copy bandwidth
(../shared/gpu/README.md), and the fused decode projections (kernels/fused_projections.py) of bf16 models are a
matmul plus a split plus the activation, and the residual adds separate launches; in these modes each is one launch.

Gate (`enabled`): MLXCEL_HMV=1 and MLX on CUDA. Off by default: the source compiles for sm_90 without spills and the
layers fall back to MLX's matmul bit for bit (tested on CPU), but it has not yet run on a GPU.
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


def enabled() -> bool:
    """Whether loaded models get the 16-bit kernel: MLXCEL_HMV=1 and MLX on CUDA."""
    return os.environ.get(ENV, "0").strip() == "1" and qmv.cuda_kernel_available()


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

