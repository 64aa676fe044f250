"""MLX's float32 matrix products on the CPU through OpenBLAS, in fixed 16-row tiles.

Why: MLX's Linux CPU wheel (`mlx[cpu]`) carries the reference BLAS, whose sgemm runs at 1-3 GFLOP/s on an x86 core;
OpenBLAS runs the same products 20-60x faster (benchmarks/RESULTS.md, "CPU: MLX's float32 products through OpenBLAS").
Every float32 matmul of a model on the CPU goes through it: projections, attention, the output head.

How: `csrc/blas_tiles.c` defines `cblas_sgemm`. Compiled once with the system's C compiler into the cache dir and
loaded with RTLD_GLOBAL before MLX's library, it takes MLX's calls (a library loaded later binds its undefined
symbols in the global scope first) and hands them to scipy-openblas32's `scipy_cblas_sgemm` (prefixed symbols, so
nothing else in the process is affected), 16 rows of the product at a time, the last tile padded with zero rows.
OpenBLAS picks other kernels for other row counts, which round otherwise; in fixed tiles a row's result is the same
alone or in a batch of any size (tests/mlxcel_core/test_cpu_blas.py), so batched rows, chunked prefill and speculative
verification keep a lone row's greedy tokens as the engine's exact-token tests require. (A product's width still
matters: OpenBLAS rounds a column by the number of columns, so a fused projection is not bit-equal to its parts.)

`install` runs when mlxcel_core is imported. It does nothing, and MLX's own BLAS serves, where: MLX is already
imported (its symbols are bound), the platform is not Linux, MLX's CPU wheel's reference BLAS is not there (a CUDA
or macOS build), scipy-openblas32 is missing, no C compiler builds the library, or MLXCEL_CPU_BLAS=0. `status` says
which. 16-bit products are MLX's own code either way.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TILE_ROWS = 16
SOURCE = Path(__file__).with_name("csrc") / "blas_tiles.c"

_status = "not installed"


def status() -> str:
    """'openblas (16-row tiles)' when MLX's float32 products go through OpenBLAS; else why not."""
    return _status


def install() -> str:
    """Route MLX's cblas_sgemm through OpenBLAS (module docstring); returns `status()`."""
    global _status
    if _status.startswith("openblas"):
        return _status
    _status = _why_not() or _load()
    return _status


def _why_not() -> str | None:
    from . import settings

    if not settings.get("MLXCEL_CPU_BLAS"):
        return "off (MLXCEL_CPU_BLAS=0)"
    if not sys.platform.startswith("linux"):
        return "not Linux: MLX's own BLAS"
    if "mlx.core" in sys.modules:
        return "MLX was imported before mlxcel_core: its reference BLAS serves"
    if _reference_blas() is None:
        return "MLX's build does not carry the reference BLAS"
    if _openblas() is None:
        return "scipy-openblas32 is not installed"
    return None


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _reference_blas() -> Path | None:
    """The reference BLAS that MLX's Linux CPU wheel vendors beside it (mlx_cpu.libs/libblas-*.so*)."""
    mlx = _package_dir("mlx")
    if mlx is None:
        return None
    return next(iter(sorted((mlx.parent / "mlx_cpu.libs").glob("libblas-*.so*"))), None)


def _openblas() -> Path | None:
    package = _package_dir("scipy_openblas32")
    if package is None:
        return None
    return next(iter(sorted((package / "lib").glob("libscipy_openblas*.so"))), None)


def _library() -> Path | None:
    """The compiled blas_tiles library in the cache dir, compiled first if missing (None: no compiler or it failed)."""
    from .paths import cache_dir

    source = SOURCE.read_bytes()
    target = cache_dir() / "cpu-blas" / hashlib.sha256(source).hexdigest()[:16] / "libmlxcel_blas_tiles.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(SOURCE)], capture_output=True, timeout=120
        )
        if done.returncode != 0:
            return None
        os.replace(built, target)  # (atomic: a concurrent process compiles its own copy and replaces it whole)
    return target


def _load() -> str:
    try:
        library = _library()
        if library is None:
            return "no C compiler built csrc/blas_tiles.c: MLX's reference BLAS serves"
        openblas = ctypes.CDLL(str(_openblas()))
        tiles = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        tiles.mlxcel_blas_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
        tiles.mlxcel_blas_init(ctypes.cast(openblas.scipy_cblas_sgemm, ctypes.c_void_p), TILE_ROWS)
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        return f"OpenBLAS could not be loaded ({type(exc).__name__}: {exc}): MLX's reference BLAS serves"
    return f"openblas ({TILE_ROWS}-row tiles)"
