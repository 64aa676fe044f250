"""MLX's float32 products on the CPU through OpenBLAS in fixed row tiles (mlxcel_core/cpu_blas.py): installed when
mlxcel_core is imported, right for every transposition, a row's result the same alone or in a batch of any size (on
one OpenBLAS thread and on two), the tile the largest whose rows the kernel computes the same, and the C library's own
loop (before OpenBLAS is handed over) right too."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_core import cpu_blas

openblas = pytest.mark.skipif(
    not cpu_blas.active(), reason=f"OpenBLAS and the AVX2 rows are not in use here: {cpu_blas.status()}"
)


def test_the_test_process_uses_openblas_where_mlx_carries_the_reference_blas():
    if sys.platform.startswith("linux") and cpu_blas._reference_blas() is not None:
        rows, tiles = r"mlxcel's AVX2 rows \(\d+ threads?\)", r"openblas \((16|8|4|2|1)-row tiles\)"
        has_avx2 = ctypes.CDLL(str(cpu_blas._library())).mlxcel_rows_available()
        assert re.fullmatch(rows if has_avx2 else tiles, cpu_blas.status())
    else:
        assert not cpu_blas.active()


@openblas
@pytest.mark.parametrize("m,n,k", [(1, 7, 5), (16, 33, 17), (37, 70, 129), (5, 300, 64)])
def test_every_transposition_computes_the_product(m, n, k):
    rng = np.random.default_rng(m * n + k)
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    with mx.stream(mx.cpu):
        for x, y in [(a, b), (a.T.copy(), b), (a, b.T.copy()), (a.T.copy(), b.T.copy())]:
            left = mx.array(x) if x.shape == (m, k) else mx.array(x).T
            right = mx.array(y) if y.shape == (k, n) else mx.array(y).T
            got = np.array(left @ right)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(k))
            # (+ C = beta C: addmm goes through the same sgemm with beta 1)
            c = rng.standard_normal((m, n), dtype=np.float32)
            got = np.array(mx.addmm(mx.array(c), left, right))
            np.testing.assert_allclose(got, want + c, rtol=1e-5, atol=1e-4 * np.sqrt(k))


@openblas
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    with mx.stream(mx.cpu):
        mx.random.seed(0)
        w, x = mx.random.normal((1536, 576)), mx.random.normal((40, 576))
        alone = [(x[i : i + 1] @ w.T)[0] for i in range(40)]
        for m in (2, 15, 16, 17, 33, 40):
            together = x[:m] @ w.T
            assert all(mx.array_equal(together[i], alone[i]).item() for i in range(m)), m
        q, keys = mx.random.normal((4, 40, 64)), mx.random.normal((4, 100, 64))
        scores = q @ keys.transpose(0, 2, 1)
        for i in range(40):
            assert mx.array_equal(scores[:, i : i + 1], q[:, i : i + 1] @ keys.transpose(0, 2, 1)).item(), i


own_rows = pytest.mark.skipif("AVX2 rows" not in cpu_blas.status(), reason=f"No AVX2 rows here: {cpu_blas.status()}")


@own_rows
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("n,k", [(1, 1), (2, 7), (3, 8), (9, 9), (25, 100), (49, 576)])
def test_x_at_w_t_on_the_rows_kernel_computes_the_product_for_every_block_edge(m, n, k):
    """Rows in fours and ones, columns in threes, eights and ones, depths with and without a tail past the lanes, and
    the product added to C (beta 1)."""
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a, w = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32)
    c = rng.standard_normal((m, n), dtype=np.float32)
    want = a.astype(np.float64) @ w.T.astype(np.float64)
    with mx.stream(mx.cpu):
        x, weight = mx.array(a), mx.array(w)
        np.testing.assert_allclose(np.array(x @ weight.T), want, rtol=1e-5, atol=1e-5 * np.sqrt(k))
        got = np.array(mx.addmm(mx.array(c), x, weight.T))
    np.testing.assert_allclose(got, want + c, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@own_rows
@pytest.mark.parametrize(
    "m,n,k", [(1, 64, 37), (10, 8, 8), (13, 70, 129), (1, 33, 64), (3, 7, 16), (9, 100, 5), (2, 64, 200), (40, 90, 300)]
)
def test_a_product_has_the_same_bits_however_its_operands_lie_in_memory(m, n, k):
    """x @ w.T with w as rows of k, or as its transpose's rows (the keys of a first chunk against the same keys
    gathered from paged blocks), and x transposed too: one result, bit for bit."""
    rng = np.random.default_rng(m + n + k)
    a, w = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32)
    with mx.stream(mx.cpu):
        want = mx.array(a) @ mx.array(w).T
        for left in (mx.array(a), mx.array(a.T.copy()).T):
            for right in (mx.array(w).T, mx.array(w.T.copy())):
                assert mx.array_equal(left @ right, want).item()


@pytest.fixture
def rows_wide_back():
    """Whatever a test chooses, the process's choice of blas_rows.c's AVX-512 blocks afterwards."""
    before = cpu_blas.rows_wide()
    yield
    cpu_blas.set_rows_wide(before)


@own_rows
@pytest.mark.skipif(not cpu_blas.rows_wide_available(), reason="no AVX-512F and DQ on this CPU")
@pytest.mark.parametrize("m", [4, 5, 8, 13])
@pytest.mark.parametrize("n,k", [(8, 8), (9, 7), (17, 64), (24, 577), (25, 100), (49, 576), (100, 1536)])
def test_the_avx512_blocks_give_the_avx2_kernels_bits(rows_wide_back, m, n, k):
    """Blocks of 4 rows x 8 columns on AVX-512 (two rows a register) against the AVX2 kernel's 4 x 3 blocks: every
    element the same bits, with column and depth edges, and the product added to C (beta 1)."""
    rng = np.random.default_rng(m * 100 + n + k)
    a, w = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32)
    c = rng.standard_normal((m, n), dtype=np.float32)
    results = {}
    with mx.stream(mx.cpu):
        x, weight, base = mx.array(a), mx.array(w), mx.array(c)
        for wide in (False, True):
            cpu_blas.set_rows_wide(wide)
            assert cpu_blas.rows_wide() == wide
            results[wide] = [np.array(x @ weight.T), np.array(mx.addmm(base, x, weight.T))]
    for avx2, avx512 in zip(results[False], results[True]):
        assert avx2.tobytes() == avx512.tobytes()
    want = a.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(results[True][0], want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@own_rows
def test_x_at_w_t_on_the_rows_kernel_is_the_same_on_one_thread_and_on_two():
    """Threads take whole column blocks: a product large enough to be split comes out bit for bit as on one thread
    (a new process each: OpenMP reads its thread count when it loads)."""
    code = """
import hashlib, mlxcel_core, mlx.core as mx, numpy as np
from mlxcel_core import cpu_blas
with mx.stream(mx.cpu):
    mx.random.seed(2)
    w, x = mx.random.normal((1000, 576)), mx.random.normal((13, 576))
    print(cpu_blas.status(), hashlib.sha256(np.array(x @ w.T).tobytes()).hexdigest())
"""
    outs = {}
    for threads in ("1", "2"):
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_env(OMP_NUM_THREADS=threads)
        )
        outs[threads] = run.stdout.strip().splitlines()[-1]
    assert "(1 thread)" in outs["1"] and "(2 threads)" in outs["2"], outs
    assert outs["1"].split()[-1] == outs["2"].split()[-1]


@openblas
@pytest.mark.parametrize("order", [101, 102])  # row-major, column-major
def test_the_librarys_own_loop_before_openblas_is_handed_over(tmp_path, order):
    """A second copy of the library, never initialized: cblas_sgemm computes with its plain loop."""
    library = tmp_path / "copy.so"
    library.write_bytes(cpu_blas._library().read_bytes())
    fresh = ctypes.CDLL(str(library))
    rng = np.random.default_rng(1)
    m, n, k = 5, 6, 7
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    c = rng.standard_normal((m, n), dtype=np.float32)
    want = 2.0 * (a.astype(np.float64) @ b) + 0.5 * c
    if order == 101:
        left, right, out, lda, ldb, ldc = a, b, c.copy(), k, n, n
    else:  # column-major storage: the transposes' row-major arrays
        left, right, out, lda, ldb, ldc = a.T.copy(), b.T.copy(), c.T.copy(), m, k, m
    f = fresh.cblas_sgemm
    ptr = ctypes.POINTER(ctypes.c_float)
    f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ptr, ctypes.c_int, ptr, ctypes.c_int, ctypes.c_float, ptr]
    f.argtypes += [ctypes.c_int]
    f(order, 111, 111, m, n, k, 2.0, *_p(left), lda, *_p(right), ldb, 0.5, *_p(out), ldc)
    got = out if order == 101 else out.T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _p(array: np.ndarray):
    return (array.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),)


def _status_in_a_new_process(code: str, **env) -> str:
    import os

    out = subprocess.run(
        [sys.executable, "-c", code + "\nfrom mlxcel_core import cpu_blas; print(cpu_blas.status())"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


@openblas
def test_it_can_be_turned_off_and_says_why_not():
    assert _status_in_a_new_process("import mlxcel_core", MLXCEL_CPU_BLAS="0") == "off (MLXCEL_CPU_BLAS=0)"
    assert "imported before" in _status_in_a_new_process("import mlx.core\nimport mlxcel_core")


@openblas
@pytest.mark.parametrize("threads", ["1", "2"])
def test_rows_come_out_the_same_alone_on_one_openblas_thread_and_on_two(threads):
    """The tile chosen for the thread count holds rows apart (a new process: OpenBLAS reads its threads at load)."""
    code = """
import mlxcel_core, mlx.core as mx
from mlxcel_core import cpu_blas
with mx.stream(mx.cpu):
    mx.random.seed(1)
    w, x = mx.random.normal((1536, 576)), mx.random.normal((37, 576))
    together = x @ w.T
    apart = [i for i in range(37) if not mx.array_equal(together[i], (x[i : i + 1] @ w.T)[0]).item()]
print(cpu_blas.status(), apart)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_env(OPENBLAS_NUM_THREADS=threads)
    )
    assert out.stdout.strip().endswith("[]"), out.stdout


def _env(**extra):
    import os

    return {**os.environ, **extra}


def _fake_openblas(threads: int, apart: dict[tuple[int, int], int]) -> SimpleNamespace:
    """An OpenBLAS stand-in (a numpy sgemm): a call of R rows on T threads computes rows from apart[(R, T)] on one
    unit in the last place off, as a kernel that rounds rows by their place does."""
    state = {"threads": threads}
    ptr = ctypes.c_void_p

    signature = ctypes.CFUNCTYPE(
        None,
        *[ctypes.c_int] * 6,
        ctypes.c_float,
        ptr,
        ctypes.c_int,
        ptr,
        ctypes.c_int,
        ctypes.c_float,
        ptr,
        ctypes.c_int,
    )

    def sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        assert order == cpu_blas.ROW_MAJOR
        left = _view(a, (m, lda) if ta == cpu_blas.NO_TRANS else (k, lda))
        left = left[:, :k] if ta == cpu_blas.NO_TRANS else left[:, :m].T
        right = _view(b, (k, ldb) if tb == cpu_blas.NO_TRANS else (n, ldb))
        right = right[:, :n] if tb == cpu_blas.NO_TRANS else right[:, :k].T
        out = _view(c, (m, ldc))[:, :n]
        product = alpha * (left.astype(np.float64) @ right) + beta * out
        first = apart.get((m, state["threads"]), m)
        product[first:] = np.nextafter(product[first:].astype(np.float32), np.float32(np.inf))
        out[:] = product

    state["fn"] = signature(sgemm)
    return SimpleNamespace(
        scipy_cblas_sgemm=state["fn"],
        scipy_openblas_get_num_threads=lambda: threads,
        scipy_openblas_set_num_threads=lambda count: state.update(threads=count),
        state=state,
    )


def _view(address: int, shape: tuple[int, int]) -> np.ndarray:
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_float)), shape=shape)


@openblas
@pytest.mark.parametrize(
    "threads,apart,want",
    [
        (1, {}, 16),  # every row the same alone: the largest tile
        (1, {(16, 1): 6}, 8),  # rows 6-15 of a 16-row call apart (OpenBLAS's Haswell kernel on one thread)
        (2, {(16, 1): 6}, 8),  # on a process of two threads too: a small product runs on one
        (2, {(16, 2): 8, (8, 2): 4}, 4),  # apart on two threads only
        (2, {(16, 1): 1, (8, 1): 1, (4, 2): 3, (2, 1): 1}, 1),  # none holds: one row a call
    ],
)
def test_the_tile_is_the_largest_whose_rows_come_out_the_same_alone(tmp_path, monkeypatch, threads, apart, want):
    monkeypatch.setattr(cpu_blas, "CHECK_SHAPES", ((20, 9), (33, 70)))
    library = tmp_path / "copy.so"
    library.write_bytes(cpu_blas._library().read_bytes())
    tiles = ctypes.CDLL(str(library))
    tiles.mlxcel_blas_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    fake = _fake_openblas(threads, apart)
    assert cpu_blas.pick_tile(tiles, fake) == want
    assert fake.state["threads"] == threads  # (left at the process's count)


@openblas
def test_the_tile_is_picked_once_per_openblas_build_kernel_and_thread_count(tmp_path):
    picks = []
    fake = SimpleNamespace(
        scipy_openblas_get_config=lambda: b"OpenBLAS 0.3 fake",
        scipy_openblas_get_corename=lambda: b"Fake",
        scipy_openblas_get_num_threads=lambda: 3,
    )
    library = tmp_path / "lib.so"
    assert cpu_blas._cached_tile(fake, lambda: picks.append(1) or 4, library) == 4
    assert cpu_blas._cached_tile(fake, lambda: picks.append(1) or 8, library) == 4
    fake.scipy_openblas_get_num_threads = lambda: 2
    assert cpu_blas._cached_tile(fake, lambda: picks.append(1) or 8, library) == 8
    assert len(picks) == 2


@pytest.mark.parametrize(
    "files,cpus",
    [
        ({}, None),  # no cgroup files: the affinity's cores
        ({"cpu.max": "max 100000\n"}, None),  # v2 without a quota
        ({"cpu.max": "150000 100000\n"}, 2),  # v2: 1.5 CPUs a second, rounded up
        ({"cpu.max": "50000 100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1 without a quota
        ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
    ],
)
def test_the_cpu_budget_is_the_affinity_capped_by_a_cgroup_quota(tmp_path, files, cpus):
    import os

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    cores = len(os.sched_getaffinity(0))
    assert cpu_blas.cpu_budget(tmp_path) == (cores if cpus is None else min(cores, cpus))


@pytest.mark.parametrize("env", [{}, {"OMP_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "4"}])
def test_threads_fit_the_budget_unless_the_environment_sets_them(monkeypatch, env):
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    calls = {}
    tiles = SimpleNamespace(
        mlxcel_rows_threads=lambda: 8, mlxcel_rows_set_threads=lambda n: calls.setdefault("rows", n)
    )
    openblas = SimpleNamespace(
        scipy_openblas_get_num_threads=lambda: 8, scipy_openblas_set_num_threads=lambda n: calls.setdefault("blas", n)
    )
    cpu_blas._fit_threads(tiles, openblas, 2)
    assert calls == ({} if env else {"rows": 2, "blas": 2})


@own_rows
def test_the_rows_kernel_runs_on_the_threads_it_is_given(tmp_path):
    """A copy of the library (its own state): the count handed over is the count its products run on."""
    library = tmp_path / "copy.so"
    library.write_bytes(cpu_blas._library().read_bytes())
    copy = ctypes.CDLL(str(library))
    if not hasattr(copy, "omp_get_max_threads"):  # (dlsym searches the libraries it links: libgomp)
        pytest.skip("built without OpenMP: one thread")
    copy.mlxcel_rows_set_threads(3)
    assert copy.mlxcel_rows_threads() == 3
