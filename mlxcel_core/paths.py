"""Where mlxcel keeps its files: `MLXCEL_CACHE_DIR`, else the platform's user cache dir."""

import os
from pathlib import Path


def cache_dir() -> Path:
    from . import settings

    env = settings.get("MLXCEL_CACHE_DIR")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("mlxcel"))


def models_dir() -> Path:
    return cache_dir() / "models"


PTX_CACHE_ENV = "MLX_PTX_CACHE_DIR"
DRIVER_CACHE_ENV = "CUDA_CACHE_PATH"


def driver_cache_dir() -> Path:
    return cache_dir() / "kernels" / "cuda-driver"


def keep_driver_cache() -> None:
    """Unless CUDA_CACHE_PATH is set, point the CUDA driver's JIT cache (the PTX it compiles for this GPU: MLX's own
    shipped kernels) beside the kernel cache, instead of ~/.nv, which a fresh container loses: an empty one adds
    seconds to a process's start. The driver reads the variable when
    CUDA initializes, so mlxcel_core sets it on import, before mlx (the directory is made by use_kernel_cache)."""
    if not os.environ.get(DRIVER_CACHE_ENV):
        os.environ[DRIVER_CACHE_ENV] = str(driver_cache_dir())


def use_kernel_cache() -> Path | None:
    """Point MLX's kernel cache (the CUDA kernels it compiles of its own; kernels/cubin_cache.py keeps ours there)
    into the cache dir and return it:
    MLX_PTX_CACHE_DIR as set, else, on a CUDA device, cache_dir()/kernels/mlx-<version>/<architecture>-<device>
    (set in the environment here, before MLX's first compile reads it); None on other backends (nothing to keep).

    MLX's own default, /tmp/mlx/<version>/ptx, is lost with /tmp: every fresh machine or container then compiles
    again before its first token (about 70 s for an 8B 4-bit model on the H200, mlx-lm 6 s). MLX names its cache
    files by kernel module, not by GPU (jit_module.cpp, read_cached_ptx), so one directory per GPU."""
    import mlx.core as mx

    if os.environ.get(PTX_CACHE_ENV):
        return Path(os.environ[PTX_CACHE_ENV])
    cuda = getattr(mx, "cuda", None)  # (not in every build)
    if cuda is None or not cuda.is_available():
        return None
    info = mx.device_info()
    device = f"{info.get('architecture', '')}-{info.get('device_name', '')}"
    path = (
        cache_dir()
        / "kernels"
        / f"mlx-{mx.__version__}"
        / "".join(c if c.isalnum() or c in "._-" else "_" for c in device)
    )
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.environ.get(DRIVER_CACHE_ENV) == str(driver_cache_dir()):
            driver_cache_dir().mkdir(exist_ok=True)
    except OSError:
        return None  # not writable: MLX's default (where MLX cannot create its directory it keeps nothing at all)
    os.environ[PTX_CACHE_ENV] = str(path)
    return path
