"""benchmarks/qmm_ablate.py without a GPU: each variant's edits still find their text in the 4-bit batch kernel
(kernels/qmm_source.py), and every variant compiles for sm_90 within the kernel's registers."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import mlx.core as mx
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
    launched = {**qmm_ablate.WARPS_OF, **qmm_ablate.BLOCKS_OF}  # (the kernel's source, launched otherwise)
    edited = {name: text for name, text in sources.items() if name not in launched}
    assert len(set(edited.values())) == len(edited)  # (each edit took)
    assert all(sources[name] == sources["full"] for name in launched)


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


def test_the_table_prints_every_variant_and_the_kernels_difference(monkeypatch, capsys):
    """main() end to end with stand-ins for the GPU (kernels that return MLX's product, and fixed timings): a row a
    shape and row count, a cell a variant, then the kernel's difference from MLX."""
    monkeypatch.setattr(qmm_ablate, "_cuda", lambda: True)
    monkeypatch.setattr(qmm_ablate, "SHAPES", [("tiny", 64, 256)])
    monkeypatch.setattr(qmm_ablate, "L2_BYTES", 1)  # (two copies of the weights, not enough to overflow an L2)
    monkeypatch.setattr(qmm_ablate, "time_calls", lambda fn, x, weights, calls, reps: (1e-5, 0.0))

    def stand_in(**kwargs):
        def launch(inputs, output_shapes, output_dtypes, **args):
            y = qmm_ablate.mlx_qmm(*inputs[:4]).astype(mx.float32)
            return [mx.concatenate([y[None]] + [mx.zeros_like(y)[None]] * (output_shapes[0][0] - 1))]

        return launch

    monkeypatch.setattr(qmm_ablate, "cuda_kernel", stand_in)
    for group_size in (64, 32):
        assert qmm_ablate.main(["--rows", "16", "--calls", "1", "--reps", "1", "--group-size", str(group_size)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == f"group size {group_size}"
        assert lines[1].split()[2:] == list(qmm_ablate.VARIANTS)
        assert lines[2].startswith("tiny") and lines[2].count("|") == len(qmm_ablate.VARIANTS) - 1
        want = "vs MLX, max rel diff: full 0.00e+00, warps16 0.00e+00, warps4 0.00e+00, two_blocks 0.00e+00"
        assert lines[3].strip() == want, lines[3]


def test_candidates_of_16_and_4_warps_launch_256_and_64_weight_rows_a_block(monkeypatch):
    """warps16's launch: 512 threads a block, half the blocks of the kernel's 8 warps, registers capped for one block
    an SM; warps4's: 128 threads, twice the blocks, four an SM; qmm's own launch shape is back after each call."""
    launches = []

    def stand_in(**kwargs):
        def launch(inputs, output_shapes, **args):
            launches.append((kwargs["launch_bounds"], args["grid"], args["threadgroup"]))
            return [mx.zeros(output_shapes[0], mx.float32)]

        return launch

    monkeypatch.setattr(qmm_ablate, "cuda_kernel", stand_in)
    x, w = mx.ones((32, 256), mx.bfloat16), mx.zeros((1024, 32), mx.uint32)
    scales = biases = mx.zeros((1024, 4), mx.bfloat16)
    qmm_ablate.product("warps16")(x, w, scales, biases)
    qmm_ablate.product("warps4")(x, w, scales, biases)
    (bounds, grid, block), (bounds4, grid4, block4) = launches
    assert bounds == (512, 1) and grid[0] == 4 * 512 and block == (512, 1, 1)
    assert bounds4 == (128, 4) and grid4[0] == 16 * 128 and block4 == (128, 1, 1)  # (4 warps: 64 weight rows a block)
    assert qmm.WARPS == 8 and qmm.ROWS_PER_BLOCK == 128


def test_the_two_blocks_candidate_caps_registers_for_two_blocks_where_the_kernel_takes_one(monkeypatch):
    """Groups of 32 past 32 rows: the kernel's launch is capped for one block an SM (qmm.MIN_BLOCKS_WIDE_G32),
    two_blocks' for two, with the kernel's own launch shape."""
    launches = []

    def stand_in(**kwargs):
        def launch(inputs, output_shapes, **args):
            launches.append((kwargs["launch_bounds"], args["grid"]))
            return [mx.zeros(output_shapes[0], mx.float32)]

        return launch

    monkeypatch.setattr(qmm_ablate, "cuda_kernel", stand_in)
    x, w = mx.ones((48, 256), mx.bfloat16), mx.zeros((1024, 32), mx.uint32)
    scales = biases = mx.zeros((1024, 8), mx.bfloat16)
    qmm_ablate.product("full", 32)(x, w, scales, biases)
    qmm_ablate.product("two_blocks", 32)(x, w, scales, biases)
    (bounds, grid), (bounds2, grid2) = launches
    assert bounds == (256, qmm.MIN_BLOCKS_WIDE_G32) == (256, 1) and bounds2 == (256, 2) and grid2 == grid
