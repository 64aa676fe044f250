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
        def launch(inputs, output_shapes, output_dtypes, **args):
            seen.append((kwargs, inputs, args))
            return [mx.ones(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]

        return launch

    monkeypatch.setattr(qmm_ablate, "cuda_kernel", stand_in)
    qmm_ablate._prep_kernel.cache_clear()
    x, w = mx.ones((40, 256), mx.bfloat16), mx.zeros((64, 32), mx.uint32)
    scales = biases = mx.zeros((64, 4), mx.bfloat16)
    args = qmm.launch_args((40, 256), x.dtype, scales.dtype, 64, 256, 64)
    for name in ("xprep", "xprep_kernel"):
        seen.clear()
        y = qmm_ablate.candidate(name)(x, w, scales, biases)
        kwargs, inputs, launch = seen[-1]
        assert kwargs["input_names"] == ["x", "w", "scales", "biases", "xs"]
        assert kwargs["launch_bounds"] == (qmm.WARPS * 32, qmm.MIN_BLOCKS)  # (40 rows in groups of 64: four an SM)
        assert launch == {k: v for k, v in args.items() if k not in ("output_shapes", "output_dtypes")}
        assert inputs[0].shape == x.shape and inputs[4].shape == (40, 4)
        assert y.shape == (40, 64) and y.dtype == mx.bfloat16
        assert mx.array_equal(y, mx.full((40, 64), args["output_shapes"][0][0], mx.bfloat16)).item()
    assert mx.array_equal(qmm_ablate.prepared_x(x, 64)[1], mx.full((40, 4), 64.0)).item()
    prep_kwargs, prep_inputs, prep_launch = seen[0]  # (xprep_kernel's: its prep kernel first)
    assert prep_kwargs["output_names"] == ["xp", "xs"] and prep_inputs[0].shape == (40, 256)
    assert prep_launch["template"] == [("T", mx.bfloat16), ("G", 64)] and prep_launch["grid"] == (256, 1, 1)


@needs_nvcc
def test_the_prep_kernel_compiles_for_sm90(tmp_path):
    text = kernel_text(
        "k", qmm_ablate._PREP, qmm_ablate.HEADER, ["x"], [mx.bfloat16], [2], ["xp", "xs"],
        [mx.bfloat16, mx.float32], [("T", mx.bfloat16), ("G", 64)],
    )  # fmt: skip
    compile_sm90(tmp_path, text)


def test_the_table_prints_every_variant_and_the_candidates_differences(monkeypatch, capsys):
    """main() end to end with stand-ins for the GPU (kernels that return MLX's product of the x they are given, put back
    in order, and fixed timings): a row a shape and row count, a cell a variant, and each candidate's difference from
    MLX and whether it equals full."""
    monkeypatch.setattr(qmm_ablate, "_cuda", lambda: True)
    monkeypatch.setattr(qmm_ablate, "SHAPES", [("tiny", 64, 256)])
    monkeypatch.setattr(qmm_ablate, "L2_BYTES", 1)  # (two copies of the weights, not enough to overflow an L2)
    monkeypatch.setattr(qmm_ablate, "time_calls", lambda fn, x, weights, calls, reps: (1e-5, 0.0))

    def stand_in(**kwargs):
        def launch(inputs, output_shapes, output_dtypes, **args):
            if kwargs["output_names"] == ["xp", "xs"]:
                return list(qmm_ablate.prepared_x(inputs[0], qmm_ablate.GROUP_SIZE))
            x = inputs[0]
            if len(inputs) == 5:  # a candidate's x comes reordered x0 x4 x1 x5 ...: put back in order
                x = x.reshape(*x.shape[:-1], -1, 4, 2).swapaxes(-1, -2).reshape(x.shape)
            y = qmm_ablate.mlx_qmm(x, *inputs[1:4]).astype(mx.float32)
            return [mx.concatenate([y[None]] + [mx.zeros_like(y)[None]] * (output_shapes[0][0] - 1))]

        return launch

    monkeypatch.setattr(qmm_ablate, "cuda_kernel", stand_in)
    qmm_ablate._prep_kernel.cache_clear()
    assert qmm_ablate.main(["--rows", "16", "--calls", "1", "--reps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[2:] == [*qmm_ablate.VARIANTS, *qmm_ablate.CANDIDATES]
    assert lines[1].startswith("tiny") and lines[1].count("|") == len(qmm_ablate.VARIANTS) + 1
    assert "xprep 0.00e+00 (= full), xprep_kernel 0.00e+00 (= full)" in lines[2], lines[2]
