"""The backend seam (backends/base.py says what it covers): `current()` is the backend of this process.

The CUDA wing (backends/cuda/) serves when MLX runs on a CUDA device and MLXCEL_CUDA is not 0; every other machine
gets the portable backend and imports no CUDA module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import settings

if TYPE_CHECKING:  # (imported at first use: importing the package imports no MLX)
    from .base import Backend

_current: Backend | None = None


def cuda_available() -> bool:
    """True when MLX has a CUDA backend with a usable device and can JIT-compile custom kernels."""
    import mlx.core as mx

    try:
        return bool(getattr(mx, "cuda", None) and mx.cuda.is_available() and hasattr(mx.fast, "cuda_kernel"))
    except Exception:  # noqa: BLE001 - a broken CUDA install is no CUDA
        return False


def current() -> Backend:
    """This process's backend, chosen at first use."""
    global _current
    if _current is None:
        if settings.get("MLXCEL_CUDA") and cuda_available():
            from .cuda.backend import CudaBackend

            _current = CudaBackend()
        else:
            from .base import Backend

            _current = Backend()
    return _current


def use(backend: Backend | None) -> Backend | None:
    """Make `backend` this process's (None: choose again at next use); returns the one it replaces. For tests and
    for comparing a kernel path against the portable one in one process."""
    global _current
    previous, _current = _current, backend
    return previous
