"""MLX's float32 matrix products on the CPU: on mlxcel's own AVX2 kernel, or (a CPU without AVX2 and FMA) through
OpenBLAS in fixed row tiles (16, or fewer where they round apart).

Why: MLX's Linux CPU wheel (`mlx[cpu]`) carries the reference BLAS, whose sgemm runs at 1-3 GFLOP/s on an x86 core;
OpenBLAS runs the same products 20-60x faster (benchmarks/RESULTS.md, "CPU: MLX's float32 products through OpenBLAS").
Every float32 matmul of a model on the CPU goes through here: projections, attention, the output head. A decode step's
products (a few rows against each weight) are another matter: OpenBLAS copies the whole weight into its panel format
at every call, and a lone row pays for a padded tile. csrc/blas_rows.c computes x @ w.T by streaming the weight once,
on OpenMP threads (blocks of 4 rows on AVX-512 where the CPU has it, with the AVX2 kernel's bits).
csrc/blas_packed.c reads a quantized layer's float32 copy (backends/cpu_float32.py) from the packed values it was
dequantized from, where `register_packed` tied them: a decode step reads an eighth of the bytes.

How: `csrc/blas_tiles.c` defines `cblas_sgemm`. Compiled once with the system's C compiler (with blas_rows.c, with
OpenMP where the compiler has it) into the cache dir and loaded with RTLD_GLOBAL before MLX's library, it takes MLX's
calls (a library loaded later binds its undefined symbols in the global scope first). Where the CPU has AVX2 and FMA,
every product goes to blas_rows.c (other forms copied into x @ w.T form first), whose every element is one dot
product computed the same way wherever its row is and however the operands lie (its header says how). Elsewhere
products go to scipy-openblas32's `scipy_cblas_sgemm` (prefixed symbols, so nothing else in the process is affected),
a fixed number of rows of the product at a time, the last tile padded with zero rows. OpenBLAS picks other kernels for
other row counts, which round otherwise; in fixed tiles a row's result is the same alone or in a batch of any size.
So either way (tests/mlxcel_core/test_cpu_blas.py) batched rows, chunked prefill and speculative verification keep a
lone row's greedy tokens as the engine's exact-token tests require. (With OpenBLAS a product's width still matters:
it rounds a column by the number of columns, so a fused projection is not bit-equal to its parts.)

The tile: within one call some OpenBLAS kernels round a row by its place in the tile (its Haswell kernel, run on one
thread, rounds rows 6-15 of 16 apart from rows 0-5), and how a call splits its rows depends on the kernel and the
threads it runs on. So `install` checks the tile sizes 16, 8, 4, 2 in turn, end to end through the tiled library on
every thread count up to this process's, and keeps the first whose rows come out the same alone and together; one row
a call is the same by construction. The choice is cached per OpenBLAS build, kernel and thread count; a CPU with AVX2
and FMA needs none.

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
from typing import Callable

CANDIDATE_TILES = (16, 8, 4, 2)  # largest first; 1 row a call, the fallback, is the same alone by construction
# (columns n, depth k) of the products checked: a small one (one thread, whatever the thread count), a projection's and
# one deeper than OpenBLAS's depth block
CHECK_SHAPES = ((100, 64), (1536, 576), (576, 1536))
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
ACTIVE = ("mlxcel's AVX2 rows", "openblas")  # the beginnings of `status` when the library computes the products
SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("blas_tiles.c", "blas_rows.c", "blas_packed.c"))
HEADERS = (Path(__file__).with_name("csrc") / "blas_rows.h",)  # (in the library's digest, not on the command line)

_status = "not installed"
_tiles: ctypes.CDLL | None = None  # the loaded library, where it computes the products


def status() -> str:
    """Who computes MLX's float32 products: "mlxcel's AVX2 rows (T threads)", "openblas (N-row tiles)" (a CPU without
    AVX2 and FMA), or why neither (MLX's own BLAS serves)."""
    return _status


def active() -> bool:
    """Whether MLX's float32 products run on blas_rows.c or OpenBLAS's tiles (not MLX's reference BLAS)."""
    return _status.startswith(ACTIVE)


def install() -> str:
    """Route MLX's cblas_sgemm to blas_rows.c or OpenBLAS's tiles (module docstring); returns `status()`."""
    global _status
    if active():
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

    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS)).hexdigest()[:16]
    target = cache_dir() / "cpu-blas" / digest / "libmlxcel_blas_tiles.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        # (no contraction: blas_packed.c rounds q s + b twice, as MLX's multiply and add)
        command = [compiler, "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-pthread", "-o", str(built)]
        command += list(map(str, SOURCES))
        # with OpenMP where the compiler has it (blas_rows.c's threads), else one thread
        attempts = (command + ["-fopenmp"], command)
        if all(subprocess.run(attempt, capture_output=True, timeout=120).returncode for attempt in attempts):
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
        tiles.mlxcel_blas_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        _fit_threads(tiles, openblas, cpu_budget())
        sgemm = ctypes.cast(openblas.scipy_cblas_sgemm, ctypes.c_void_p)
        global _tiles
        _tiles = tiles
        pointer, number = ctypes.c_void_p, ctypes.c_int
        tiles.mlxcel_packed_register.argtypes = [pointer, number, number] + [pointer] * 3 + [number] * 2
        tiles.mlxcel_packed_unregister.argtypes = [pointer]
        tiles.mlxcel_packed_hits.restype = ctypes.c_long
        tiles.mlxcel_rows_set_wide.argtypes = [number]
        if tiles.mlxcel_rows_available():
            # Every product on blas_rows.c: no tile to pick. OpenBLAS serves only where a thread's scratch cannot
            # grow, one row a call (the same alone by construction).
            threads = tiles.mlxcel_blas_init(sgemm, 1, 1)
            return f"mlxcel's AVX2 rows ({threads} thread{'s' if threads > 1 else ''})"
        rows = _cached_tile(openblas, lambda: pick_tile(tiles, openblas), library)
        tiles.mlxcel_blas_init(sgemm, rows, 0)
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        return f"OpenBLAS could not be loaded ({type(exc).__name__}: {exc}): MLX's reference BLAS serves"
    return f"openblas ({rows}-row tiles)"


def cpu_budget(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may keep busy: its CPU affinity, capped by a cgroup CPU quota (a container's `--cpus`),
    which neither OpenMP nor OpenBLAS reads: on a many-core host a 2-CPU container would otherwise start a thread a
    core, and their spinning would take turns on its quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_quota(cgroup)
    return max(1, min(cores, -int(-quota // 1))) if quota else cores


def _cgroup_quota(cgroup: Path) -> float | None:
    """CPUs a second the cgroup may use (cgroup v2's cpu.max, else v1's cfs quota and period); None: no quota."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota, period = (int((cgroup / "cpu" / name).read_text()) for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def _fit_threads(tiles: ctypes.CDLL, openblas: ctypes.CDLL, budget: int) -> None:
    """blas_rows.c's and OpenBLAS's threads at most `budget`, where OMP_NUM_THREADS / OPENBLAS_NUM_THREADS do not
    say otherwise."""
    if "OMP_NUM_THREADS" not in os.environ:
        tiles.mlxcel_rows_set_threads(min(budget, tiles.mlxcel_rows_threads()))
    if "OPENBLAS_NUM_THREADS" not in os.environ and openblas.scipy_openblas_get_num_threads() > budget:
        openblas.scipy_openblas_set_num_threads(budget)


def _cached_tile(openblas: ctypes.CDLL, pick: Callable[[], int], library: Path) -> int:
    """The tile `pick` chooses, cached beside the library per OpenBLAS build, kernel and thread count."""
    text = ctypes.c_char_p
    openblas.scipy_openblas_get_config.restype = openblas.scipy_openblas_get_corename.restype = text
    key = "|".join(
        [
            openblas.scipy_openblas_get_config().decode(),
            openblas.scipy_openblas_get_corename().decode(),
            str(openblas.scipy_openblas_get_num_threads()),
            repr((CANDIDATE_TILES, CHECK_SHAPES)),
        ]
    )
    cached = library.parent / f"tile-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    try:
        return int(cached.read_text())
    except (OSError, ValueError):
        pass
    rows = pick()
    partial = cached.with_name(f"{cached.name}.{os.getpid()}")
    partial.write_text(f"{rows}\n")
    os.replace(partial, cached)
    return rows


def pick_tile(tiles: ctypes.CDLL, openblas: ctypes.CDLL) -> int:
    """The largest of CANDIDATE_TILES whose rows OpenBLAS computes the same alone and together on every thread count
    up to the process's (1 where none is); leaves OpenBLAS at the process's thread count."""
    threads = openblas.scipy_openblas_get_num_threads()
    fn = ctypes.cast(openblas.scipy_cblas_sgemm, ctypes.c_void_p)
    try:
        for rows in CANDIDATE_TILES:
            tiles.mlxcel_blas_init(fn, rows, 0)
            if all(_same_alone(tiles, rows, count, openblas) for count in range(1, threads + 1)):
                return rows
        return 1
    finally:
        openblas.scipy_openblas_set_num_threads(threads)


def _same_alone(tiles: ctypes.CDLL, rows: int, threads: int, openblas: ctypes.CDLL) -> bool:
    openblas.scipy_openblas_set_num_threads(threads)
    return all(
        rows_same_alone(tiles.cblas_sgemm, rows, n, k, ta, tb)
        for n, k in CHECK_SHAPES
        for ta in (NO_TRANS, TRANS)
        for tb in (NO_TRANS, TRANS)
    )


def rows_same_alone(sgemm, rows: int, n: int, k: int, ta: int, tb: int) -> bool:
    """Whether every row of a product of 2 tiles and a padded one through `sgemm` (a row-major cblas_sgemm) equals,
    bit for bit, the row computed alone (the tile's first row, the rest padding)."""
    import numpy as np

    rng = np.random.default_rng(rows * n + k + ta + tb)
    m = 2 * rows + 3
    a = rng.standard_normal((k, m) if ta == TRANS else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if tb == TRANS else (k, n), dtype=np.float32)
    together = _product(sgemm, ta, tb, a, b, 0, m, n, k)
    return all(np.array_equal(_product(sgemm, ta, tb, a, b, i, 1, n, k)[0], together[i]) for i in range(m))


def _product(sgemm, ta: int, tb: int, a, b, first: int, m: int, n: int, k: int):
    """Rows first..first+m of op(a) @ op(b) through `sgemm`."""
    import numpy as np

    c = np.zeros((m, n), dtype=np.float32)
    lda, ldb = a.shape[1], b.shape[1]
    start = a.ctypes.data + 4 * (first * lda if ta == NO_TRANS else first)
    args = (ROW_MAJOR, ta, tb, m, n, k, 1.0, start, lda, b.ctypes.data, ldb, 0.0, c.ctypes.data, n)
    pointer, number, scalar = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    sgemm.argtypes = [number] * 6 + [scalar, pointer, number, pointer, number, scalar, pointer, number]
    sgemm(*args)
    return c


def _rows() -> bool:
    """Whether the library is loaded and blas_rows.c computes the products (not OpenBLAS's tiles)."""
    return _tiles is not None and _status.startswith(ACTIVE[0])


def register_packed(weight, packed, scales, biases, group_size: int, bits: int) -> bool:
    """Tie a float32 weight [N, K] (an evaluated MLX array, its own buffer) to the packed `bits`-bit values, float32
    scales and biases it was dequantized from, so that products read those (csrc/blas_packed.c: the same bits, checked
    here for every weight); False where the library does not take it (not loaded, no AVX2, bits other than 4 and 8,
    or a weight that is not their dequantization bit for bit)."""
    if not _rows():
        return False
    import numpy as np

    w = np.frombuffer(memoryview(weight), dtype=np.float32)
    if w.size != weight.size:  # (not the array's own whole buffer: nothing to key a product by)
        return False
    operands = [np.ascontiguousarray(np.asarray(memoryview(a))) for a in (packed, scales, biases)]
    if operands[1].dtype != np.float32 or operands[2].dtype != np.float32:
        return False
    n, k = weight.shape
    addresses = (o.ctypes.data for o in operands)
    return bool(_tiles.mlxcel_packed_register(w.ctypes.data, n, k, *addresses, group_size, bits))


def unregister_packed(weight) -> bool:
    """Untie a weight `register_packed` tied (before its memory goes); whether it was tied."""
    if _tiles is None:
        return False
    import numpy as np

    return bool(_tiles.mlxcel_packed_unregister(np.frombuffer(memoryview(weight), dtype=np.float32).ctypes.data))


def packed_products() -> int:
    """How many products this process computed from registered packed weights (the tests' evidence of the route)."""
    return int(_tiles.mlxcel_packed_hits()) if _tiles is not None else 0


def rows_wide_available() -> bool:
    """Whether blas_rows.c computes here and the CPU has AVX-512F and DQ for the wide blocks of rows."""
    return _rows() and bool(_tiles.mlxcel_rows_wide_available())


def rows_wide() -> bool:
    """Whether blocks of rows run on AVX-512 with the AVX2 kernels' bits: blas_rows.c's 4 (two rows of x a register, 8
    columns a block) and blas_packed.c's 4 and 8 (two weight rows a register): where `rows_wide_available()`, unless
    `set_rows_wide(False)`."""
    return _rows() and bool(_tiles.mlxcel_rows_wide())


def set_rows_wide(on: bool) -> None:
    """Choose the AVX-512 kernels (on: only where they are available) or the AVX2 ones for blocks of rows (the tests
    compare the two bit for bit)."""
    if _rows():
        _tiles.mlxcel_rows_set_wide(int(bool(on)))
