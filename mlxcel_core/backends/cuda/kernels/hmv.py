"""The decode matvec kernel for 16-bit weights: x @ W.T for a bf16/fp16 W [N, K] and 1..MAX_ROWS rows of x, on MLX's
CUDA backend (mx.fast.cuda_kernel), in every mode of the 4-bit kernel (plain, qkv, swiglu, residual and the folded
RMSNorm): kernels/qmv_source.py's reductions and epilogues around a 16-bit main loop (`_MAIN_HALF`).

    y = launch(launch_args(x.shape, x.dtype, w.dtype, w.shape[0]), x, w)

Why: on the H200 MLX's bf16 GEMV reads a 16384 x 8192 weight at 2.1 TB/s, 49% of the copy bandwidth
(../shared/gpu/README.md), and the fused decode projections (kernels/fused_projections.py) of bf16 models are a
matmul plus a split plus the activation, and the residual adds separate launches; in these modes each is one launch.

Gate (`enabled`): MLX on CUDA and the model at most DEFAULT_MAX_HIDDEN wide. On the H200 its tests pass (against
float64, every mode, and a llama-3.2-1b decode against MLX's matmuls). Timed one launch after another
(benchmarks/hmv.py), a single row reads 0.99-1.21x as fast as MLX's GEMV on the Llama-3-8B shapes and 0.84-1.1x on
the 1B ones. Inside an 8B decode, with 4 warps a block in the SwiGLU modes, its launches take as much GPU time a token
as MLX's GEMV (4.82 vs 4.81 ms), in 292 launches against MLX's 485, and the decode runs faster with it
(benchmarks/RESULTS.md), so it serves the measured widths, up to 4096.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from . import pdl_prefetch, qmv
from .cubin_cache import cuda_kernel
from .matvec_config import HMV_CHUNK as CHUNK
from .matvec_config import hmv_launch_config as launch_config  # the untuned rule
from .qmv_source import MODES, base_mode, header, kernel_name, kernel_source

MAX_ROWS = qmv.MAX_ROWS
WEIGHT_TYPES = (mx.bfloat16, mx.float16)

# The kernel serves 16-bit models up to this hidden size (see enabled()).
DEFAULT_MAX_HIDDEN = 4096  # the widest shape measured (Llama-3-8B); wider ones keep MLX's GEMV


def enabled(hidden_size: int | None = None) -> bool:
    """Whether a 16-bit model `hidden_size` wide gets the kernel (MLX on CUDA only): models up to DEFAULT_MAX_HIDDEN
    wide. Its fused launches (q/k/v with norm and RoPE, gate/up with SwiGLU, residual adds) save launches and host
    time; the launch shapes decide whether it also keeps MLX's bandwidth (H200, benchmarks/RESULTS.md: llama-3.2-1b
    bf16 1.35x mlx-lm with it, 1.05x without; llama-3-8b bf16 GPU time a token 4.82 ms with it (4-warp SwiGLU
    launches) against 4.81 ms without, and its decode 198-204 tok/s against 166-202 without). Wider models are not
    measured."""
    if not qmv.cuda_kernel_available():
        return False
    return hidden_size is not None and hidden_size <= DEFAULT_MAX_HIDDEN


def shape_supported(x_shape, x_dtype, w_shape, w_dtype) -> bool:
    """Whether the kernel handles these operands (shapes and dtypes only)."""
    if len(w_shape) != 2 or w_dtype not in WEIGHT_TYPES or x_dtype not in qmv.FLOAT_TYPES or len(x_shape) < 1:
        return False
    n, k = w_shape
    return n >= 1 and k >= CHUNK and k % CHUNK == 0 and x_shape[-1] == k and 1 <= qmv.rows_of(x_shape) <= MAX_ROWS


def chosen_config(n: int, k: int, m: int, mode: str, x_dtype) -> tuple[int, int, int]:
    """The launch configuration of a call without one: the autotune cache's winner for this cell (the SwiGLU modes
    have cells of their own) where MLXCEL_AUTOTUNE reads the cache and one is stored (`mlxcel tune --op
    hmv-multirow`, autotune/matvec_ops.py), else `launch_config`'s rule."""
    from autotune.matvec_ops import HMV, tuned_config

    cell_mode = "swiglu" if base_mode(mode) == "swiglu" else "plain"
    return tuned_config(HMV, n, k, m, 0, cell_mode, x_dtype) or launch_config(n, k, m, mode)


@functools.lru_cache(maxsize=4096)
def launch_args(
    x_shape: tuple,
    x_dtype,
    w_dtype,
    n: int,
    config: tuple | None = None,
    max_rows: int = MAX_ROWS,
    mode: str = "plain",
    split: tuple[int, ...] | None = None,
    eps: float | None = None,
) -> dict | None:
    """Everything but the inputs of one launch, or None when x does not suit the kernel (qmv.launch_args' rules)."""
    m = qmv.rows_of(x_shape)
    if not 1 <= m <= max_rows or x_dtype not in qmv.FLOAT_TYPES or w_dtype not in WEIGHT_TYPES:
        return None
    rows, warps, unroll, groups = qmv.unpack_launch(config or chosen_config(n, x_shape[-1], m, mode, x_dtype))
    template = [("T", x_dtype), ("CFG", qmv.pack_config(m, 0, rows, warps, unroll, groups))]
    return qmv.mode_layout(
        mode, n, m, rows, warps, split, x_shape, mx.result_type(x_dtype, w_dtype), template, eps, groups
    )


@functools.cache
def _kernel(mode: str = "plain"):
    early = pdl_prefetch.budget()
    return cuda_kernel(
        name=kernel_name(mode, "half", early),
        input_names=["x", "w", *MODES[mode][0]],
        output_names=list(MODES[mode][1]),
        source=kernel_source(mode, "half", early),
        header=header("half", early),
    )


def launch(args: dict, x: mx.array, w: mx.array, mode: str = "plain", extra: tuple = ()):
    """Run the kernel with `launch_args`' result (qmv.launch's outputs and extra inputs per mode)."""
    outputs = _kernel(mode)(inputs=[x, w, *extra], **args)
    return outputs if base_mode(mode) == "qkv" else outputs[0]
