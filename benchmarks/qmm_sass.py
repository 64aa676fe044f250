"""The 4-bit batch kernel (kernels/qmm.py) compiled here for sm_90 with nvcc, no GPU needed: its registers, shared
memory and spills (ptxas), and its machine instructions counted by opcode (cuobjdump -sass).

    python benchmarks/qmm_sass.py --rows 32 --n 14336 --k 4096 --cuobjdump DIR/cuobjdump

cuobjdump comes with a CUDA toolkit or the package index's nvidia-cuda-cuobjdump wheel (its nvidia/cu13/bin), and
calls nvdisasm, which must be on PATH (the nvidia-cuda-nvdisasm wheel puts it in the same folder). The counts are
static (the whole kernel, its loop unrolled over the groups a warp loads ahead), not a profile: they show what a
change does to the instructions each tensor-core product (HMMA) takes.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import mlx.core as mx  # noqa: E402
from cuda_compile import compile_sm90  # noqa: E402

from mlxcel_core.backends.cuda.kernels import qmm  # noqa: E402
from mlxcel_core.backends.cuda.kernels.cubin_cache import kernel_text  # noqa: E402


def counts(rows: int, n: int, k: int, group_size: int, cuobjdump: str, work: Path) -> str:
    args = qmm.launch_args((rows, k), mx.bfloat16, mx.bfloat16, n, k, group_size)
    bounds = (qmm.WARPS * 32, qmm.MIN_BLOCKS)
    header, source = qmm.kernel_source()
    dtypes = [mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16]
    text = kernel_text(
        "k", source, header, ["x", "w", "scales", "biases"], dtypes, [2, 2, 2, 2], ["partial"], [mx.float32],
        args["template"], launch_bounds=bounds,
    )  # fmt: skip
    ptxas = compile_sm90(work, text)  # (work/kernel.cubin; it stops where anything spills)
    sass = subprocess.run([cuobjdump, "-sass", str(work / "kernel.cubin")], capture_output=True, text=True, check=True)
    ops = collections.Counter(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass.stdout))
    usage = "; ".join(re.findall(r"Used [^\n]*|\d+ bytes spill stores", ptxas))
    top = ", ".join(f"{op} {c}" for op, c in ops.most_common(12))
    return f"{usage}\n  {sum(ops.values())} instructions, {ops['HMMA']} HMMA: {top}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--n", type=int, default=14336)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--cuobjdump", default="cuobjdump")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(counts(a.rows, a.n, a.k, a.group_size, a.cuobjdump, Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
