"""Where mlxcel keeps its files: `MLXCEL_CACHE_DIR`, else the platform's user cache dir."""

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("MLXCEL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("mlxcel"))


def models_dir() -> Path:
    return cache_dir() / "models"
