"""MLX's float32 products on the CPU through OpenBLAS in 16-row tiles (mlxcel_core/cpu_blas.py): installed when
mlxcel_core is imported, right for every transposition, a row's result the same alone or in a batch of any size, and
the C library's own loop (before OpenBLAS is handed over) right too."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_core import cpu_blas

openblas = pytest.mark.skipif(
    not cpu_blas.status().startswith("openblas"), reason=f"OpenBLAS is not in use here: {cpu_blas.status()}"
)


def test_the_test_process_uses_openblas_where_mlx_carries_the_reference_blas():
    if sys.platform.startswith("linux") and cpu_blas._reference_blas() is not None:
        assert cpu_blas.status() == "openblas (16-row tiles)"
    else:
        assert not cpu_blas.status().startswith("openblas")


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
