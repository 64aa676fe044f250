"""paths.py: the cache directory and where MLX keeps compiled CUDA kernels."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from mlxcel_core import paths


class _FakeCuda:
    def __init__(self, available: bool):
        self.available = available

    def is_available(self) -> bool:
        return self.available


@pytest.fixture
def cuda(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(paths.PTX_CACHE_ENV, raising=False)
    monkeypatch.setattr(mx, "cuda", _FakeCuda(True))
    monkeypatch.setattr(mx, "device_info", lambda: {"architecture": "sm_90", "device_name": "NVIDIA H200 (x)"})
    return tmp_path


def test_kernels_persist_under_the_cache_dir_per_mlx_version_and_gpu(cuda):
    want = cuda / "kernels" / f"mlx-{mx.__version__}" / "sm_90-NVIDIA_H200__x_"
    assert paths.use_kernel_cache() == want and want.is_dir()
    assert os.environ[paths.PTX_CACHE_ENV] == str(want)  # what MLX reads at its first compile


def test_an_explicit_mlx_setting_wins(cuda, monkeypatch):
    monkeypatch.setenv(paths.PTX_CACHE_ENV, "/somewhere/else")
    assert paths.use_kernel_cache() == paths.Path("/somewhere/else")
    assert os.environ[paths.PTX_CACHE_ENV] == "/somewhere/else"


def test_an_unwritable_cache_dir_leaves_mlx_default(cuda, monkeypatch):
    (cuda / "kernels").write_text("a file where the directory would go")
    assert paths.use_kernel_cache() is None and paths.PTX_CACHE_ENV not in os.environ


def test_nothing_set_without_cuda(cuda, monkeypatch):
    monkeypatch.setattr(mx, "cuda", _FakeCuda(False))
    assert paths.use_kernel_cache() is None and paths.PTX_CACHE_ENV not in os.environ


def test_model_loading_sets_it_first(cuda, monkeypatch):
    from tiny_models import save_tiny_llama

    from mlxcel_core.loading import load_model
    from mlxcel_core.loading.shapes import build_random_model

    build_random_model("tiny")
    assert os.environ[paths.PTX_CACHE_ENV].startswith(str(cuda / "kernels"))
    monkeypatch.delenv(paths.PTX_CACHE_ENV)
    load_model(str(save_tiny_llama(cuda / "tiny")), log=lambda m: None)
    assert os.environ[paths.PTX_CACHE_ENV].startswith(str(cuda / "kernels"))


def test_the_cuda_driver_cache_is_made_beside_the_kernels(cuda, monkeypatch):
    """mlxcel_core points CUDA_CACHE_PATH there on import (test_init.py); the directory is made with the kernels'."""
    monkeypatch.setenv(paths.DRIVER_CACHE_ENV, str(paths.driver_cache_dir()))
    assert paths.use_kernel_cache() is not None and (cuda / "kernels" / "cuda-driver").is_dir()
    monkeypatch.setenv(paths.DRIVER_CACHE_ENV, str(cuda / "theirs"))  # the user's own: left to the driver
    paths.use_kernel_cache()
    assert not (cuda / "theirs").exists()
