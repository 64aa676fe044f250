import sys, re, tempfile
from pathlib import Path
sys.path.insert(0, "tests")
import mlx.core as mx
from types import SimpleNamespace
from mlxcel_core.backends.cuda.kernels import qmm
from mlxcel_core.backends.cuda.kernels.cubin_cache import kernel_text
from cuda_compile import compile_sm90
import subprocess
for min_blocks in (1, 2, 3):
    for m, g in ((64, 32), (64, 64), (64, 128), (32, 32), (32, 64)):
        args = qmm.launch_args((m, 4096), mx.bfloat16, mx.bfloat16, 14336, 4096, g)
        header, source = qmm.kernel_source()
        text = kernel_text("k", source, header, ["x", "w", "scales", "biases"], [mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16],
                           [2, 2, 2, 2], ["partial"], [mx.float32], args["template"], launch_bounds=(256, min_blocks))
        d = Path(tempfile.mkdtemp())
        (d / "kernel.cu").write_text(text)
        r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(d / "k.cubin"), str(d / "kernel.cu")], capture_output=True, text=True)
        regs = re.search(r"Used (\d+) registers", r.stderr).group(1)
        spill = re.search(r"(\d+) bytes spill stores", r.stderr).group(1)
        print(f"min_blocks {min_blocks} rows {m} g {g}: {regs} registers, {spill} bytes spilled")
