"""NVRTC compiles of MLX's own JIT modules (the sources MLX 0.32.4 writes beside each module in its kernel cache),
for sm_90, one at a time and then on N threads: what one module costs where MLX compiles it on a fresh machine.

    python nvrtc_mlx_modules.py LIBMLX_SO CACHE_FOLDER NVRTC_LIB_DIR [MODULES] [THREADS]

LIBMLX_SO: the mlx-cuda wheel's mlx/lib/libmlx.so, which holds the headers MLX hands NVRTC as in-memory strings
(found here by what each defines); CACHE_FOLDER: kernels/mlx-0.32.4/<device>/ with NAME.cu and NAME.txt (the
kernel-name expressions, tab, their lowered names); NVRTC_LIB_DIR: libnvrtc.so.13 and its builtins. The compile
options are MLX's (jit_module.cpp): --gpu-architecture=sm_90 and include paths for the wheel's CCCL headers and the
CUDA toolkit's. No GPU is needed.
"""

import ctypes
import glob
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

SIGNS = {  # MLX's JIT header -> a string only its text holds
    "atomic_ops.cuh": "atomic_add(",
    "binary_ops.cuh": "struct FloorDivide",
    "cast_op.cuh": "struct CastOp",
    "config.h": "MAX_NDIM",
    "complex.cuh": "LIBCUDACXX_ENABLE_SIMPLIFIED_COMPLEX",
    "fp16_math.cuh": "HALF operator",
    "indexing.cuh": "absolute_index(",
    "scatter_ops.cuh": "struct ScatterAssign",
    "unary_ops.cuh": "struct ArcCos",
    "ternary_ops.cuh": "struct Select",
    "utils.cuh": "struct Limits",
}


def headers(libmlx: str) -> dict[str, bytes]:
    blobs = re.findall(rb"\x00(// Copyright[^\x00]{100,}?)\x00", open(libmlx, "rb").read())
    found = {}
    for name, sign in SIGNS.items():
        having = sorted((b for b in blobs if sign.encode() in b), key=len)
        found[name] = having[0]  # (the shortest: a header, not a kernel source that includes its text)
    return found


def main() -> None:
    libmlx, folder, nvrtc_dir = sys.argv[1:4]
    limit = int(sys.argv[4]) if len(sys.argv) > 4 else None
    threads = int(sys.argv[5]) if len(sys.argv) > 5 else os.cpu_count()
    builtins = glob.glob(f"{nvrtc_dir}/libnvrtc-builtins.so*")[0]
    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
    nv = ctypes.CDLL(f"{nvrtc_dir}/libnvrtc.so.13")
    found = headers(libmlx)
    names = [f"mlx/backend/cuda/device/{k}".encode() for k in found]
    count = len(names)
    texts, includes = (ctypes.c_char_p * count)(*found.values()), (ctypes.c_char_p * count)(*names)
    cccl = os.path.join(os.path.dirname(os.path.dirname(libmlx)), "include", "cccl")
    args = [b"--gpu-architecture=sm_90", f"--include-path={cccl}".encode(), b"--include-path=/usr/local/cuda/include"]
    argv = (ctypes.c_char_p * len(args))(*args)

    def compile_one(source: str):
        expressions = [line.split("\t")[0] for line in open(source[:-3] + ".txt") if "\t" in line]
        prog = ctypes.c_void_p()
        began = time.perf_counter()
        text = open(source, "rb").read()
        assert nv.nvrtcCreateProgram(ctypes.byref(prog), text, b"m.cu", count, texts, includes) == 0
        for e in expressions:
            nv.nvrtcAddNameExpression(prog, e.encode())
        result = nv.nvrtcCompileProgram(prog, len(args), argv)
        size = ctypes.c_size_t()
        nv.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        nv.nvrtcDestroyProgram(ctypes.byref(prog))
        if result != 0:
            raise RuntimeError(f"{source}: NVRTC error {result}")
        return time.perf_counter() - began, len(expressions), size.value

    modules = sorted(glob.glob(f"{folder}/*.cu"), key=lambda p: not os.path.basename(p)[:1].isupper())[:limit]
    began = time.perf_counter()
    results = [compile_one(m) for m in modules]
    serial = time.perf_counter() - began
    for module, (seconds, kernels, size) in zip(modules, results):
        print(f"{seconds:6.2f} s {kernels:3d} kernels {size / 1e3:6.0f} kB  {os.path.basename(module)[:-3][:80]}")
    print(f"one at a time: {len(modules)} modules in {serial:.1f} s ({serial / len(modules):.2f} s a module)")
    began = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(compile_one, modules))
    side = time.perf_counter() - began
    print(f"on {threads} threads: {side:.1f} s ({serial / side:.2f}x)")


if __name__ == "__main__":
    main()
