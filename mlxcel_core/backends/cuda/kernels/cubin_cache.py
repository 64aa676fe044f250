"""Our CUDA kernels compiled once per machine, not once per process: ``cuda_kernel``, a drop-in for
``mx.fast.cuda_kernel`` whose compiled binaries (cubins) persist in the kernel cache.

    kernel = cuda_kernel(name="mlxcel_x", input_names=["x"], output_names=["y"], source=BODY, header=HEADER)
    y, = kernel(inputs=[x], template=[("T", x.dtype)], grid=..., threadgroup=..., output_shapes=..., output_dtypes=...)

Why: MLX 0.32 compiles an ``mx.fast.cuda_kernel`` with NVRTC in every process and keeps nothing on disk (its
CustomKernel asks its JIT cache for no disk copy), unlike MLX's own kernels, which it keeps in MLX_PTX_CACHE_DIR. On
the H200 that is 11-13 s of compiles before a restarted process's first token (1B 4-bit, with MLX's own kernels
already cached by paths.use_kernel_cache). Here each variant is compiled by NVRTC (through ctypes, the library MLX
itself loaded) into a cubin kept beside MLX's files, and run with ``mx.fast.precompiled_cuda_kernel``.

The translation unit is what MLX's build_kernel (mlx/backend/cuda/custom_kernel.cpp) writes, with three changes:
the function is ``extern "C"`` (a precompiled kernel is looked up by its symbol); an input's ``NAME_shape`` /
``NAME_ndim``, which MLX passes as extra parameters, come as int scalars after the outputs (MLX appends scalars there)
and are gathered back into a local ``NAME_shape`` array; and the prelude includes only the CUDA headers our kernels
use (fp16/bf16, cstdint; ``inf`` from its bits), not MLX's device headers, which are not installed.

A variant is keyed by the template values, the inputs' dtypes and (where a shape is read) their ranks, and the output
dtypes; its cubin file's name carries a hash of its source, the GPU architecture and NVRTC's version. Where anything
of this fails (no NVRTC found, no cache directory, a compile error), the kernel is MLX's own ``mx.fast.cuda_kernel``
from then on, so a compile error surfaces from MLX as it does for any ``mx.fast.cuda_kernel``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .pdl_prefetch import PDL_WAIT

ELF_MAGIC = b"\x7fELF"  # a cubin is an ELF file
log = logging.getLogger("mlxcel")

CUDA_TYPES = {
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
    mx.float64: "double",
}

# No <cuda/std/limits>: NVRTC keeps its ~250 numeric_limits members in every cubin (59 KB where 19 KB is the kernel),
# and MLX 0.32.4 spends time in proportion to a precompiled kernel's cubin on every launch (on the H200, 70 KB cost
# 12 us more a launch than 4 KB: benchmarks/precompiled_call_cost.py).
PRELUDE = r"""#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/cstdint>

#define inf __int_as_float(0x7f800000)

"""


# Programmatic dependent launch (sm_90+): a kernel waits here for the stream's previous kernel and its writes, then
# lets the next kernel's blocks be placed while its own run. Only a launch made with the programmatic-serialization
# attribute (backends/cuda/graph_decode.py's replays, see pdl_enabled) starts before its predecessor ends; under any
# other launch both instructions return at once.
PDL_PROLOGUE = r"""#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
"""


def pdl_enabled() -> bool:
    """Whether cached kernels carry PDL_PROLOGUE and replayed graphs chain their launches programmatically, so a
    kernel's blocks are placed before the previous kernel ends: on a GPU of sm_90 or newer. On the H200 it gains 5%
    in 1B 4-bit decode, 1% in 1B bf16 and 8B bf16, and 0.2% in 8B 4-bit (benchmarks/RESULTS.md)."""
    match = re.fullmatch(r"sm_(\d+)[a-z]?", str(mx.device_info().get("architecture", "")))
    return match is not None and int(match.group(1)) >= 90


def shape_reads(source: str, input_names: list[str]) -> list[tuple[bool, bool]]:
    """Per input: whether the body reads its shape (NAME_shape) and its rank (NAME_ndim), as MLX decides it."""
    return [(f"{name}_shape" in source, f"{name}_ndim" in source) for name in input_names]


def kernel_text(
    func_name: str,
    source: str,
    header: str,
    input_names: list[str],
    input_dtypes: list,
    input_ndims: list[int],
    output_names: list[str],
    output_dtypes: list,
    template: list,
    pdl: bool = False,
    launch_bounds: tuple[int, int] | None = None,
) -> str:
    """The translation unit of one variant (module docstring: how it differs from MLX's build_kernel); `pdl`: the body
    starts with PDL_PROLOGUE (or has it at its PDL_WAIT marker); `launch_bounds`: (threads a block, blocks an SM) as
    CUDA's __launch_bounds__ takes them, which caps the registers a thread so that many blocks fit an SM."""
    params = [f"    const {CUDA_TYPES[dt]}* {name}" for name, dt in zip(input_names, input_dtypes)]
    params += [f"    {CUDA_TYPES[dt]}* {name}" for name, dt in zip(output_names, output_dtypes)]
    unpack = []
    for name, ndim, (shape, rank) in zip(input_names, input_ndims, shape_reads(source, input_names)):
        if ndim and shape:
            dims = [f"{name}_shape_{d}" for d in range(ndim)]
            params += [f"    int {d}" for d in dims]
            unpack.append(f"  const int {name}_shape[{ndim}] = {{{', '.join(dims)}}};")
        if ndim and rank:
            params.append(f"    int {name}_ndim")
    consts = []
    for key, value in template:
        if isinstance(value, mx.Dtype):
            consts.append(f"  using {key} = {CUDA_TYPES[value]};")
        elif isinstance(value, bool):
            consts.append(f"  constexpr bool {key} = {'true' if value else 'false'};")
        else:
            consts.append(f"  constexpr int {key} = {int(value)};")
    early = PDL_WAIT in source  # (the body places the wait itself and reads PDL_EARLY: pdl_prefetch.py)
    if early:
        source = source.replace(PDL_WAIT + "\n", PDL_PROLOGUE if pdl else "")
    return (
        PRELUDE
        + (f"#define PDL_EARLY {int(pdl)}\n\n" if early else "")
        + header
        + '\nextern "C" __global__ void '
        + (f"__launch_bounds__({launch_bounds[0]}, {launch_bounds[1]}) " if launch_bounds else "")
        + f"{func_name}(\n"
        + ",\n".join(params)
        + ") {\n"
        + "\n".join(unpack + consts)
        + "\n\n"
        + (PDL_PROLOGUE if pdl and not early else "")
        + source
        + "\n}\n"
    )


def shape_scalars(reads: list[tuple[bool, bool]], inputs: list) -> list[int]:
    """The int scalars `kernel_text` declared, in its order: each read input's shape, then its rank (`reads`:
    `shape_reads`, worked out once per kernel: a launch should not search the source)."""
    out: list[int] = []
    for (shape, rank), x in zip(reads, inputs):
        if x.ndim and shape:
            out.extend(x.shape)
        if x.ndim and rank:
            out.append(x.ndim)
    return out


# -- NVRTC through ctypes -----------------------------------------------------------------------------------------


def _loaded_library(stem: str, maps_path: str = "/proc/self/maps") -> str | None:
    """The path of a shared library this process has loaded (MLX's CUDA build loads NVRTC), from /proc/self/maps.

    Matches the file name `stem.so*` only: a process that also loaded torch maps libnvrtc-builtins.so, which has no
    nvrtcVersion."""
    try:
        with open(maps_path) as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if path.rsplit("/", 1)[-1].startswith(f"{stem}.so"):
                    return path
    except OSError:
        pass
    return None


_nvrtc_lib = None


def nvrtc():
    global _nvrtc_lib
    if _nvrtc_lib is None:
        names = [_loaded_library("libnvrtc"), "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
        for name in filter(None, names):
            try:
                _nvrtc_lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise RuntimeError("NVRTC (libnvrtc) not found")
    return _nvrtc_lib


def nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def include_paths() -> list[str]:
    """Where NVRTC finds the CUDA headers: MLX's bundled CCCL, then the toolkit's (MLX's jit_module.cpp order)."""
    paths = [Path(mx.__file__).resolve().parent / "include" / "cccl"]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    paths += [Path(home) / "include", Path(home) / "include" / "cccl"]
    return [str(p) for p in paths if p.is_dir()]


def compile_cubin(text: str, name: str, arch: str) -> bytes:
    """NVRTC: `text` to a cubin for `arch` (e.g. sm_90); raises RuntimeError with the compile log on failure."""
    lib = nvrtc()
    prog = ctypes.c_void_p()

    def check(result: int, what: str) -> None:
        if result != 0:
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what} failed: {lib.nvrtcGetErrorString(result).decode()}")

    check(
        lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), f"{name}.cu".encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        options = [f"--gpu-architecture={arch}", *(f"--include-path={p}" for p in include_paths())]
        argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        if lib.nvrtcCompileProgram(prog, len(options), argv) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, buf)
            raise RuntimeError(f"NVRTC could not compile {name}: {buf.value.decode(errors='replace')[-3000:]}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        buf = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def gpu_architecture() -> str:
    arch = str(mx.device_info().get("architecture", ""))
    if not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise RuntimeError(f"unexpected GPU architecture {arch!r}")
    return arch


# -- the kernel ---------------------------------------------------------------------------------------------------

_warned = False


@dataclass
class Compiles:
    """This process's NVRTC compiles of cached kernels (the server's warm-up reports them: on a fresh machine they are
    the part of its wait that is mlxcel's own, beside MLX's compiles of its kernels). `seconds` is the time waited for
    them: each compile's own where a launch compiled it, a batch's span where compile_ahead.py ran them side by side."""

    variants: int = 0
    seconds: float = 0.0


COMPILES = Compiles()
_ahead = None  # compile_ahead.Ahead while a dry run collects: misses are submitted to it, launches give zeros


@dataclass
class Launch:
    """One launch of a cached kernel as MLX will make it (custom_kernel.cpp): the arguments are the inputs' and outputs'
    data pointers, then `scalars` as ints; the grid is in threads (blocks = ceil(grid / threadgroup)). `func` is None
    for a launch that went to MLX's own kernel (a recording holding one cannot be replayed)."""

    func: str | None
    cubin: bytes
    inputs: list
    outputs: list
    scalars: list[int]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    pdl: bool = False  # the kernel starts with PDL_PROLOGUE: it may be launched before its predecessor ends


_recording: list[Launch] | None = None


@contextmanager
def record_launches():
    """Within it, every launch of a cached kernel is appended to the yielded list, arrays and all (kept alive, so
    their buffers stay where they were once evaluated): benchmarks/graph_replay.py replays a decode step from it."""
    global _recording
    launches: list[Launch] = []
    _recording = launches
    try:
        yield launches
    finally:
        _recording = None


def _report_fallback(name: str, exc: Exception) -> None:
    """Once a process: why its kernels are compiled by MLX in every process (the restart then costs seconds)."""
    global _warned
    if not _warned:
        log.warning(
            "mlxcel: CUDA kernel %s is compiled by MLX, not kept in the kernel cache (%s: %s)",
            name,
            type(exc).__name__,
            exc,
        )
        _warned = True


class CachedKernel:
    """What ``mx.fast.cuda_kernel`` returns, with each variant's cubin read from (or compiled into) `directory`.
    `compile` (tests) stands in for `compile_cubin`."""

    def __init__(
        self,
        name: str,
        input_names: list[str],
        output_names: list[str],
        source: str,
        header: str = "",
        directory: Path | None = None,
        compile=None,
        ensure_row_contiguous: bool = True,
        launch_bounds: tuple[int, int] | None = None,
    ):
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.ensure_row_contiguous, self.launch_bounds = ensure_row_contiguous, launch_bounds
        self.source, self.header, self.directory, self._compile = source, header, directory, compile
        self._reads = shape_reads(source, self.input_names)
        self._variants: dict = {}  # key -> (function name, cubin)
        self.pdl = pdl_enabled()  # (read once: __call__ runs at every launch MLX makes outside compiled steps)
        self._lock = threading.Lock()
        self._mlx = None  # MLX's own kernel, once anything here failed

    def _fallback(self):
        if self._mlx is None:
            self._mlx = mx.fast.cuda_kernel(
                name=self.name,
                input_names=self.input_names,
                output_names=self.output_names,
                source=self.source,
                header=self.header,
                ensure_row_contiguous=self.ensure_row_contiguous,
            )
        return self._mlx

    def variant(
        self, template: list, input_dtypes: list, input_ndims: list[int], output_dtypes: list, pdl: bool = False
    ):
        """(function name, cubin) of one variant: this process's, the cache file's, or compiled now; `pdl`: with
        PDL_PROLOGUE."""
        key = (tuple(template), tuple(input_dtypes), tuple(input_ndims), tuple(output_dtypes), pdl)
        found = self._variants.get(key)
        if found is not None:
            return found
        with self._lock:
            if key in self._variants:
                return self._variants[key]
            arch = gpu_architecture()
            draft = kernel_text(
                "KERNEL_NAME",
                self.source,
                self.header,
                self.input_names,
                input_dtypes,
                input_ndims,
                self.output_names,
                output_dtypes,
                template,
                pdl,
                self.launch_bounds,
            )
            digest = hashlib.sha256(f"{draft}\n{arch}\n{nvrtc_version()}".encode()).hexdigest()[:20]
            func = f"{self.name}_{digest}"
            path = self.directory / f"{func}.cubin"
            try:
                cubin = path.read_bytes()
            except OSError:
                cubin = b""
            if not cubin.startswith(ELF_MAGIC) and _ahead is not None:  # (compiled beside the dry run; not kept
                _ahead.submit(func, draft.replace("KERNEL_NAME", func), arch, path, self._compile or compile_cubin)
                return func, b""  # here: the real run reads the file)
            if not cubin.startswith(ELF_MAGIC):  # none yet, or not a cubin (damaged): compile it again
                began = time.perf_counter()
                cubin = (self._compile or compile_cubin)(draft.replace("KERNEL_NAME", func), func, arch)
                COMPILES.variants += 1
                COMPILES.seconds += time.perf_counter() - began
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                try:
                    tmp.write_bytes(cubin)
                    os.replace(tmp, path)
                except OSError as exc:  # the kernel still runs; the next process compiles again
                    log.debug("could not keep %s: %s", path, exc)
            self._variants[key] = (func, cubin)
            return func, cubin

    def __call__(
        self, *, inputs, template=(), grid, threadgroup, output_shapes, output_dtypes, init_value=None, **kwargs
    ):
        if _ahead is not None and self._mlx is None and not kwargs:  # a dry run (compile_ahead.py)
            self.variant(
                list(template), [x.dtype for x in inputs], [x.ndim for x in inputs], list(output_dtypes), self.pdl
            )
            return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        if self._mlx is None and not kwargs:
            try:
                ndims = [x.ndim for x in inputs]
                pdl = self.pdl
                func, cubin = self.variant(list(template), [x.dtype for x in inputs], ndims, list(output_dtypes), pdl)
                scalars = shape_scalars(self._reads, inputs)
                outputs = mx.fast.precompiled_cuda_kernel(
                    name=func,
                    compiled_source=cubin,
                    inputs=inputs,
                    output_shapes=output_shapes,
                    output_dtypes=output_dtypes,
                    scalars=scalars,
                    grid=grid,
                    threadgroup=threadgroup,
                    init_value=init_value,
                    ensure_row_contiguous=self.ensure_row_contiguous,
                )
                if _recording is not None:
                    replayable = init_value is None
                    _recording.append(
                        Launch(
                            func if replayable else None,
                            cubin,
                            list(inputs),
                            list(outputs),
                            scalars,
                            tuple(grid),
                            tuple(threadgroup),
                            pdl,
                        )
                    )
                return outputs
            except Exception as exc:  # noqa: BLE001 - MLX's path below compiles (and reports) it as before
                _report_fallback(self.name, exc)
        if _recording is not None:
            _recording.append(Launch(None, b"", list(inputs), [], [], tuple(grid), tuple(threadgroup)))
        return self._fallback()(
            inputs=inputs,
            template=template,
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=output_shapes,
            output_dtypes=output_dtypes,
            init_value=init_value,
            **kwargs,
        )


def cuda_kernel(
    name: str,
    input_names: list[str],
    output_names: list[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    launch_bounds: tuple[int, int] | None = None,
):
    """``mx.fast.cuda_kernel`` with its compiled variants kept in the kernel cache (paths.use_kernel_cache), or MLX's
    own where MLX has no precompiled kernels or there is no cache dir (which takes no `launch_bounds`)."""
    directory = None
    if hasattr(mx.fast, "precompiled_cuda_kernel"):
        from mlxcel_core.paths import use_kernel_cache

        directory = use_kernel_cache()
        try:  # (an MLX_PTX_CACHE_DIR of the user's that MLX has not created yet)
            if directory is not None:
                directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            directory = None
    if directory is None:
        return mx.fast.cuda_kernel(
            name=name,
            input_names=input_names,
            output_names=output_names,
            source=source,
            header=header,
            ensure_row_contiguous=ensure_row_contiguous,
        )
    return CachedKernel(
        name,
        input_names,
        output_names,
        source,
        header,
        directory,
        ensure_row_contiguous=ensure_row_contiguous,
        launch_bounds=launch_bounds,
    )
