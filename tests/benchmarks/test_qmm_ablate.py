"""benchmarks/qmm_ablate.py without a GPU: each variant's edits still find their text in the 4-bit batch kernel
(kernels/qmm_source.py), and every variant compiles for sm_90 within the kernel's registers."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qmm_ablate  # noqa: E402
from cuda_compile import compile_sm90, needs_nvcc  # noqa: E402

from mlxcel_core.backends.cuda.kernels import qmm  # noqa: E402
from mlxcel_core.backends.cuda.kernels.cubin_cache import kernel_text  # noqa: E402


def test_every_variant_changes_the_kernel():
    sources = {name: qmm_ablate.variant_source(name) for name in qmm_ablate.VARIANTS}
    assert sources["full"] == qmm.kernel_source()[1]
    assert len(set(sources.values())) == len(sources)  # (each edit took)


@needs_nvcc
@pytest.mark.parametrize("name", [n for n in qmm_ablate.VARIANTS if n != "full"])
def test_variants_compile_for_sm90(tmp_path, name):
    args = qmm.launch_args((32, 4096), mx.bfloat16, mx.bfloat16, 28672, 4096, 64)
    text = kernel_text(
        "k", qmm_ablate.variant_source(name), qmm_ablate.HEADER, ["x", "w", "scales", "biases"],
        [mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16], [2, 2, 2, 2], ["partial"], [mx.float32],
        args["template"], launch_bounds=(qmm.WARPS * 32, qmm.MIN_BLOCKS),
    )  # fmt: skip
    report = compile_sm90(tmp_path, text)
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 128, report


def test_a_variant_runs_through_qmms_own_launch(monkeypatch):
    """product(name) calls kernels/qmm.py's quantized_matmul (its launch arguments, blocks an SM and partial sums) with
    the variant's kernel in place of the kernel's, and leaves qmm's kernel as it was."""
    built = []

    def stand_in(**kwargs):
        built.append(kwargs)
        return lambda inputs, output_shapes, **_: [mx.ones(output_shapes[0], mx.float32)]

    monkeypatch.setattr(qmm_ablate, "cuda_kernel", stand_in)
    own = qmm._kernel
    x, w = mx.ones((40, 256), mx.bfloat16), mx.zeros((64, 32), mx.uint32)
    scales = biases = mx.zeros((64, 4), mx.bfloat16)  # (groups of 64: qmv.py's GROUP_SIZE)
    y = qmm_ablate.product("no_mma")(x, w, scales, biases)
    assert qmm._kernel is own and y.shape == (40, 64) and y.dtype == mx.bfloat16
    splits = qmm.launch_args((40, 256), x.dtype, scales.dtype, 64, 256, 64)["output_shapes"][0][0]
    assert mx.array_equal(y, mx.full((40, 64), splits, mx.bfloat16)).item()  # (the splits' partials summed)
    assert built[0]["source"] == qmm_ablate.variant_source("no_mma")
    assert built[0]["launch_bounds"] == (qmm.WARPS * 32, qmm.MIN_BLOCKS)


def test_every_candidate_changes_the_kernel():
    for name in qmm_ablate.CANDIDATES:
        header, source = qmm_ablate.candidate_source(name)
        assert source != qmm.kernel_source()[1] and header.startswith(qmm_ablate.HEADER)


@needs_nvcc
@pytest.mark.parametrize("name", list(qmm_ablate.CANDIDATES))
@pytest.mark.parametrize("rows", [32, 64])
def test_candidates_compile_for_sm90(tmp_path, name, rows):
    args = qmm.launch_args((rows, 4096), mx.bfloat16, mx.bfloat16, 28672, 4096, 64)
    header, source = qmm_ablate.candidate_source(name)
    extra = qmm_ablate.CANDIDATES[name][2]
    text = kernel_text(
        "k", source, header, ["x", "w", "scales", "biases", *extra],
        [mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16, *[mx.float32] * len(extra)], [2] * (4 + len(extra)),
        ["partial"], [mx.float32], args["template"], launch_bounds=(qmm.WARPS * 32, qmm.MIN_BLOCKS),
    )  # fmt: skip
    report = compile_sm90(tmp_path, text)
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 128, report


def test_prepared_x_is_the_blocks_reorder_and_group_sums():
    x = mx.random.normal((3, 2, 128), key=mx.random.key(1)).astype(mx.bfloat16)
    reordered, sums = qmm_ablate.prepared_x(x, 64)
    rows = np.array(x.astype(mx.float32)).reshape(6, 128)
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    want = rows.reshape(6, 16, 8)[:, :, order].reshape(6, 128)
    assert np.array_equal(np.array(reordered.astype(mx.float32)), want)
    assert np.allclose(np.array(sums), rows.reshape(6, 2, 64).sum(-1), rtol=1e-6)


def test_a_candidate_launches_as_qmm_with_its_prepared_inputs(monkeypatch):
    """candidate(name) launches with qmm.launch_args' arguments and qmm's blocks-an-SM rule, passes x reordered and
    its group sums, and sums the splits' partials into qmm's output dtype and shape."""
    seen = []

    def stand_in(**kwargs):
        def launch(inputs, output_shapes, **args):
            seen.append((kwargs, inputs, args))
            return [mx.ones(output_shapes[0], mx.float32)]

        return launch

    monkeypatch.setattr(qmm_ablate, "cuda_kernel", stand_in)
    x, w = mx.ones((40, 256), mx.bfloat16), mx.zeros((64, 32), mx.uint32)
    scales = biases = mx.zeros((64, 4), mx.bfloat16)
    y = qmm_ablate.candidate("xprep")(x, w, scales, biases)
    args = qmm.launch_args((40, 256), x.dtype, scales.dtype, 64, 256, 64)
    kwargs, inputs, launch = seen[0]
    assert kwargs["input_names"] == ["x", "w", "scales", "biases", "xs"]
    assert kwargs["launch_bounds"] == (qmm.WARPS * 32, qmm.MIN_BLOCKS)  # (40 rows in groups of 64: four an SM)
    assert launch == {k: v for k, v in args.items() if k != "output_shapes"}
    assert inputs[0].shape == x.shape and inputs[4].shape == (40, 4)
    assert mx.array_equal(inputs[4], mx.full((40, 4), 64.0)).item()
    assert y.shape == (40, 64) and y.dtype == mx.bfloat16
    assert mx.array_equal(y, mx.full((40, 64), args["output_shapes"][0][0], mx.bfloat16)).item()
