"""The 4-bit matvec kernel's source (kernels/qmv.py), every mode, compiled for sm_90 by nvcc as MLX's CUDA
custom_kernel would assemble it: it compiles and spills no registers. Needs nvcc (skipped without); nothing runs.
"""

from __future__ import annotations

import re

import mlx.core as mx
import pytest
from cuda_compile import CUDA_TYPES, compile_sm90, kernel_file, needs_nvcc

from mlxcel_core.backends.cuda.kernels import hmv, qmv, qmv_source
from mlxcel_core.backends.cuda.kernels.cubin_cache import kernel_text

# -- compile check (where nvcc is installed): the source as MLX's cuda_kernel assembles it -------------------


def mlx_style_source(
    x_dtype, s_dtype, out_dtype, m, group_size, rows, warps, unroll, mode="plain", weights="q4", groups=1, early=0
):
    """What MLX 0.32's CUDA custom_kernel.cpp (build_kernel) compiles for our kernel, with a stand-in for its
    default header (mlx/backend/cuda/device/utils.cuh is not installed with a CPU build of MLX). For weights "half"
    (kernels/hmv.py) s_dtype is the weight's dtype and group_size is unused."""
    n, split = (512 + 2 * 128, (512, 128)) if qmv.base_mode(mode) == "qkv" else (64, None)
    if mode.endswith("_rope"):
        split = (512, 128, 64)
    config = (rows, warps, unroll, groups)
    if weights == "q4":
        args = qmv.launch_args((m, 4096), x_dtype, s_dtype, n, group_size, config, mode=mode, split=split, eps=1e-5)
        operands = [
            "    const uint32_t* w",
            "    const __grid_constant__ Shape w_shape",
            f"    const {CUDA_TYPES[s_dtype]}* scales",
            f"    const {CUDA_TYPES[s_dtype]}* biases",
        ]
    else:
        args = hmv.launch_args((m, 4096), x_dtype, s_dtype, n, config, mode=mode, split=split, eps=1e-5)
        operands = [f"    const {CUDA_TYPES[s_dtype]}* w", "    const __grid_constant__ Shape w_shape"]
    template = dict(args["template"])
    source = qmv.kernel_source(mode, weights, early)
    inputs, outputs = qmv.MODES[mode][:2]
    assert args["output_dtypes"] == [out_dtype] * len(outputs) and "x_shape" not in source  # x comes without shape
    params = [f"    const {CUDA_TYPES[x_dtype]}* x", *operands]
    extra_types = {"residual": out_dtype, "norm_w": x_dtype, "positions": mx.float32, "inv_freq": mx.float32}
    params += [f"    const {CUDA_TYPES[extra_types[name]]}* {name}" for name in inputs]
    params += [f"    {CUDA_TYPES[out_dtype]}* {name}" for name in outputs]
    name = qmv.kernel_name(mode, weights, early)
    return kernel_file(name, params, template, source, qmv_source.header(weights, early))


# 16-bit weights (kernels/hmv.py): s_dtype is the weight's dtype, no group size.
_HALF = [
    (mx.bfloat16, mx.bfloat16, 1, 0, 4, 2, 1, "plain", "half"),
    (mx.float16, mx.float16, 8, 0, 8, 4, 2, "plain", "half"),
    (mx.float32, mx.bfloat16, 3, 0, 4, 1, 1, "plain", "half"),
    (mx.bfloat16, mx.bfloat16, 2, 0, 4, 2, 1, "qkv", "half"),
    (mx.bfloat16, mx.bfloat16, 1, 0, 8, 1, 1, "swiglu", "half"),
    (mx.bfloat16, mx.bfloat16, 2, 0, 4, 2, 1, "residual", "half"),
    (mx.bfloat16, mx.bfloat16, 1, 0, 4, 2, 1, "qkv_norm", "half"),
    (mx.float16, mx.float16, 4, 0, 8, 2, 1, "swiglu_norm", "half"),
    (mx.bfloat16, mx.bfloat16, 1, 0, 4, 2, 1, "qkv_rope", "half"),
    (mx.bfloat16, mx.bfloat16, 2, 0, 8, 1, 1, "qkv_norm_rope", "half"),
]


@needs_nvcc
@pytest.mark.parametrize(
    "x_dtype,s_dtype,m,group_size,rows,warps,unroll,mode,weights",
    [
        *(
            c + ("q4",)
            for c in [
                (mx.bfloat16, mx.bfloat16, 1, 64, 4, 2, 1, "plain"),
                (mx.float16, mx.float16, 2, 64, 8, 4, 1, "plain"),
                (mx.float32, mx.bfloat16, 3, 32, 1, 8, 2, "plain"),
                (mx.bfloat16, mx.float32, 5, 128, 4, 1, 2, "plain"),
                (mx.bfloat16, mx.float16, 4, 64, 2, 2, 1, "plain"),
                (mx.float32, mx.float32, 8, 64, 4, 1, 1, "plain"),
                (mx.bfloat16, mx.bfloat16, 1, 64, 4, 2, 1, "qkv"),
                (mx.float16, mx.float16, 2, 32, 8, 4, 1, "qkv"),
                (mx.bfloat16, mx.bfloat16, 1, 64, 4, 2, 1, "swiglu"),
                (mx.float32, mx.bfloat16, 2, 128, 8, 1, 1, "swiglu"),
                (mx.bfloat16, mx.bfloat16, 1, 64, 4, 2, 1, "residual"),
                (mx.float16, mx.float32, 3, 64, 8, 1, 1, "residual"),
                (mx.bfloat16, mx.bfloat16, 1, 64, 4, 2, 1, "qkv_norm"),
                (mx.float16, mx.float16, 4, 32, 8, 4, 1, "qkv_norm"),
                (mx.bfloat16, mx.bfloat16, 1, 64, 4, 2, 1, "swiglu_norm"),
                (mx.float32, mx.float32, 8, 64, 8, 1, 1, "swiglu_norm"),
                (mx.bfloat16, mx.bfloat16, 1, 64, 4, 2, 1, "qkv_rope"),
                (mx.float16, mx.float16, 3, 32, 8, 4, 1, "qkv_rope"),
                (mx.bfloat16, mx.bfloat16, 1, 64, 4, 2, 1, "qkv_norm_rope"),
            ]
        ),
        *_HALF,
    ],
)
def test_kernel_compiles_for_sm90_without_spills(
    tmp_path, x_dtype, s_dtype, m, group_size, rows, warps, unroll, mode, weights
):
    out_dtype = mx.result_type(x_dtype, s_dtype)
    compile_sm90(
        tmp_path, mlx_style_source(x_dtype, s_dtype, out_dtype, m, group_size, rows, warps, unroll, mode, weights)
    )


@needs_nvcc
@pytest.mark.parametrize("mode", ["plain", "residual", "swiglu_norm", "qkv_norm_rope"])
@pytest.mark.parametrize(
    "weights,group_size,rows,warps,unroll,groups",
    [("half", 0, 2, 1, 2, 8), ("half", 0, 2, 2, 2, 4), ("q4", 64, 4, 1, 1, 8), ("q4", 64, 2, 2, 1, 4)],
)
def test_grouped_launches_compile_without_spills(tmp_path, mode, weights, group_size, rows, warps, unroll, groups):
    """Several independent groups of warps to a CUDA block (qmv_source._GROUP_IDS), every kind of epilogue."""
    compile_sm90(
        tmp_path,
        mlx_style_source(
            mx.bfloat16, mx.bfloat16, mx.bfloat16, 1, group_size, rows, warps, unroll, mode, weights, groups
        ),
    )


@needs_nvcc
@pytest.mark.parametrize("weights,group_size", [("q4", 64), ("half", 0)])
@pytest.mark.parametrize("mode", list(qmv.MODES))
def test_the_prefetch_experiment_compiles_chained_and_in_mlxs_build(tmp_path, mode, weights, group_size):
    """MLXCEL_PDL_PREFETCH's kernels: as the kernel cache builds them with PDL (the bulk L2 prefetch ahead of the
    wait), no spill and no more registers than the kernel without it; and as MLX's own build (its fallback) does,
    where the prefetch is left out."""
    report = {}
    for early in (0, 4 << 20):
        source, header = qmv.kernel_source(mode, weights, early), qmv_source.header(weights, early)
        args = _launch_args(mode, weights, group_size)
        inputs = ["x", "w", *(["scales", "biases"] if weights == "q4" else []), *qmv.MODES[mode][0]]
        dtypes = [mx.bfloat16, mx.uint32 if weights == "q4" else mx.bfloat16]
        dtypes += [mx.bfloat16] * (2 if weights == "q4" else 0)
        extra = {"residual": mx.bfloat16, "norm_w": mx.bfloat16, "positions": mx.float32, "inv_freq": mx.float32}
        dtypes += [extra[name] for name in qmv.MODES[mode][0]]
        outputs = list(qmv.MODES[mode][1])
        text = kernel_text("k", source, header, inputs, dtypes, [2] * len(inputs), outputs,
                           [mx.bfloat16] * len(outputs), args["template"], pdl=True)  # fmt: skip
        (tmp_path / str(early)).mkdir()
        report[early] = compile_sm90(tmp_path / str(early), text)
    registers = {e: int(re.search(r"Used (\d+) registers", r).group(1)) for e, r in report.items()}
    assert registers[4 << 20] <= registers[0], registers
    compile_sm90(tmp_path, mlx_style_source(mx.bfloat16, mx.bfloat16, mx.bfloat16, 1, group_size, 4, 2, 1, mode,
                                            weights, early=4 << 20))  # fmt: skip


def _launch_args(mode, weights, group_size):
    n, split = (512 + 2 * 128, (512, 128)) if qmv.base_mode(mode) == "qkv" else (64, None)
    if mode.endswith("_rope"):
        split = (512, 128, 64)
    if weights == "q4":
        return qmv.launch_args((1, 4096), mx.bfloat16, mx.bfloat16, n, group_size, (4, 2, 1, 1), mode=mode, split=split,
                               eps=1e-5)  # fmt: skip
    return hmv.launch_args((1, 4096), mx.bfloat16, mx.bfloat16, n, (4, 2, 1, 1), mode=mode, split=split, eps=1e-5)
