"""Default 4-bit mma kernel at e2b4f30 vs HEAD: NVRTC cubins for sm_90 of the same variants, compared byte for byte."""
import ctypes, glob, importlib.util, sys
import mlxcel_core, mlx.core as mx
from mlxcel_core.backends.cuda.kernels import cubin_cache, qmm
for lib in glob.glob("/tmp/nvrtc/x/nvidia/cu13/lib/libnvrtc-builtins*.so*"):
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
cubin_cache._nvrtc_lib = ctypes.CDLL("/tmp/nvrtc/x/nvidia/cu13/lib/libnvrtc.so.13")
spec = importlib.util.spec_from_file_location("mlxcel_core.backends.cuda.kernels.qmm_old", sys.argv[1])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
new_h, new_s = qmm.kernel_source(False)
pairs = {"old": (old._HEADER, old._SOURCE), "new": (new_h, new_s)}
same = True
for T in (mx.bfloat16, mx.float16):
    for S in (mx.bfloat16, mx.float16, mx.float32):
        for G in (32, 64, 128):
            for NT in (1, 2, 4):
                for GPS in (1, 4):
                    cubins = {}
                    for tag, (h, s) in pairs.items():
                        text = cubin_cache.kernel_text("k", s, h, ["x", "w", "scales", "biases"], [T, mx.uint32, S, S],
                                                       [2, 2, 2, 2], ["partial"], [mx.float32],
                                                       [("T", T), ("S", S), ("G", G), ("NT", NT), ("GPS", GPS)])
                        cubins[tag] = cubin_cache.compile_cubin(text, "k", "sm_90")
                    eq = cubins["old"] == cubins["new"]
                    same &= eq
                    print(T, S, G, NT, GPS, len(cubins["old"]), len(cubins["new"]), "identical" if eq else "DIFFERENT", flush=True)
print("ALL IDENTICAL" if same else "SOME DIFFER")
