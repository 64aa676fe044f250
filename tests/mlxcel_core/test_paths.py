"""paths.py: the cache directory and where MLX keeps compiled CUDA kernels: a directory of each process's own, whose
new modules are published into the shared one whole."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import pytest

from mlxcel_core import paths
from mlxcel_core.backends.cuda import mlx_jit_ahead
from mlxcel_core.backends.cuda.paged_attention import cuda_kernel_available


class _FakeCuda:
    def __init__(self, available: bool):
        self.available = available

    def is_available(self) -> bool:
        return self.available


@pytest.fixture
def cuda(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(paths.PTX_CACHE_ENV, "")  # (restored afterwards, as use_kernel_cache sets it)
    monkeypatch.delenv(paths.PTX_CACHE_ENV)
    monkeypatch.setattr(mx, "cuda", _FakeCuda(True))
    monkeypatch.setattr(mx, "device_info", lambda: {"architecture": "sm_90", "device_name": "NVIDIA H200 (x)"})
    return tmp_path


def test_kernels_persist_under_the_cache_dir_per_mlx_version_and_gpu(cuda):
    want = cuda / "kernels" / f"mlx-{mx.__version__}" / "sm_90-NVIDIA_H200__x_"
    assert paths.use_kernel_cache() == want and want.is_dir()
    own = want / paths._private_name()
    assert os.environ[paths.PTX_CACHE_ENV] == str(own) and own.is_dir()  # what MLX reads at its first compile
    assert paths.use_kernel_cache() == want and paths.mlx_kernel_dir() == own  # (asked again: the same)


def test_an_explicit_mlx_setting_wins(cuda, monkeypatch):
    theirs = cuda / "somewhere" / "else"
    monkeypatch.setenv(paths.PTX_CACHE_ENV, str(theirs))
    assert paths.use_kernel_cache() == theirs
    assert os.environ[paths.PTX_CACHE_ENV] == str(theirs / paths._private_name())


def _module(directory, name: str, cubin: bytes = b"cubin") -> None:
    """A module's files as MLX writes them (jit_module.cpp, write_cached_ptx)."""
    (directory / name).parent.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.ptx").write_bytes(cubin)
    (directory / f"{name}.txt").write_text(f"{name}\t_Z{name}\n")
    (directory / f"{name}.cu").write_text("// source")


def test_a_process_reads_the_shared_modules_and_publishes_its_own_whole(cuda):
    shared = cuda / "shared"
    _module(shared, "gather_a")
    _module(shared, "G" * 40 + "/long")  # (MLX splits a long module name into folders)
    (shared / "ours.cubin").write_bytes(b"mlxcel's")  # (kernels/cubin_cache.py's: not MLX's to read)
    os.environ[paths.PTX_CACHE_ENV] = str(shared)
    assert paths.use_kernel_cache() == shared
    own = paths.mlx_kernel_dir()
    assert own == shared / paths._private_name()
    assert (own / "gather_a.ptx").samefile(shared / "gather_a.ptx") and (own / ("G" * 40) / "long.txt").exists()
    assert not (own / "ours.cubin").exists()
    _module(own, "gather_b", b"new")  # MLX compiles one here
    _module(own, ".ahead-1-gather_c/gather_c")  # (a helper's scratch: mlx_jit_ahead moves its modules in)
    assert paths.publish_kernels() == 1 and (shared / "gather_b.ptx").read_bytes() == b"new"
    assert (shared / "gather_b.txt").exists() and (shared / "gather_b.cu").exists()
    assert not list(shared.glob(".tmp-*")) and not (shared / "gather_c.ptx").exists()
    assert paths.publish_kernels() == 0  # (published once)


def test_a_process_takes_the_modules_others_published_since_it_began_as_copies(cuda):
    shared = cuda / "shared"
    _module(shared, "gather_a")
    os.environ[paths.PTX_CACHE_ENV] = str(shared)
    paths.use_kernel_cache()
    own = paths.mlx_kernel_dir()
    _module(shared, "gather_b")  # another process publishes one
    _module(shared, "G" * 40 + "/long")
    _module(own, "gather_c", b"compiled here")
    assert paths.adopt_kernels() == 2 and paths.adopt_kernels() == 0
    copied = own / "gather_b.ptx"
    assert copied.read_bytes() == b"cubin" and not copied.samefile(shared / "gather_b.ptx")
    assert (own / "gather_b.txt").exists() and (own / ("G" * 40) / "long.ptx").exists()
    assert not list(own.rglob(".tmp-*")) and (own / "gather_c.ptx").read_bytes() == b"compiled here"
    assert paths.publish_kernels() == 1  # (gather_c: the adopted ones are the shared ones)


def test_a_dead_processs_directory_is_swept_unpublished(cuda):
    shared = cuda / "shared"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _module(shared / f"{paths._private_name().rsplit('-', 1)[0]}-{int(dead.stdout)}", "half_written")
    _module(shared / f".proc-elsewhere-{int(dead.stdout)}", "another_hosts")  # (not ours to sweep)
    (shared / f".tmp-{int(dead.stdout)}-x.ptx").write_bytes(b"")
    os.environ[paths.PTX_CACHE_ENV] = str(shared)
    paths.use_kernel_cache()
    assert sorted(p.name for p in shared.iterdir()) == [f".proc-elsewhere-{int(dead.stdout)}", paths._private_name()]


def test_a_child_process_gets_a_directory_of_its_own(cuda):
    """Started by an mlxcel process (serve's tests, tensor-parallel ranks), it inherits that one's setting."""
    shared = cuda / "shared"
    parents = shared / f"{paths._private_name().rsplit('-', 1)[0]}-1"  # (pid 1 lives: not swept)
    parents.mkdir(parents=True)
    os.environ[paths.PTX_CACHE_ENV] = str(parents)
    assert paths.use_kernel_cache() == shared and paths.mlx_kernel_dir() == shared / paths._private_name()
    helper = shared / paths._private_name() / ".ahead-1-gather_a"  # a compile helper's: its own already
    os.environ[paths.PTX_CACHE_ENV] = str(helper)
    assert paths.use_kernel_cache() == shared and os.environ[paths.PTX_CACHE_ENV] == str(helper)


EXITS = """
import os, sys
import mlx.core as mx
class Cuda:
    def is_available(self): return True
mx.cuda = Cuda()
from mlxcel_core import paths
from mlxcel_core.backends.cuda import mlx_jit_ahead
from mlxcel_core.backends.cuda.paged_attention import cuda_kernel_available
paths.use_kernel_cache()
own = paths.mlx_kernel_dir()
(own / "gather_x.txt").write_text("k\\tk\\n")
(own / "gather_x.ptx").write_bytes(b"cubin")
"""


def test_a_process_publishes_its_modules_when_it_exits(tmp_path):
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", EXITS], env=env, check=True, timeout=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gather_x.ptx", "gather_x.txt"]


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


COMPILES = """
import mlx.core as mx
from mlxcel_core import paths
from mlxcel_core.backends.cuda import mlx_jit_ahead
from mlxcel_core.backends.cuda.paged_attention import cuda_kernel_available
from mlxcel_core.backends.cuda import mlx_jit_ahead as j
paths.use_kernel_cache()
for name in j.modules_for(mx.bfloat16):
    mx.eval(j.trigger(name))
"""


@pytest.mark.skipif(not cuda_kernel_available(), reason="needs MLX's CUDA backend and a CUDA device")
def test_on_cuda_processes_starting_together_on_an_empty_cache_each_run_and_keep_whole_modules(tmp_path):
    """Four processes compiling the same modules of MLX's own at once (tensor-parallel ranks on one host do)."""
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp_path))
    processes = [subprocess.Popen([sys.executable, "-c", COMPILES], env=env) for _ in range(4)]
    assert [p.wait(timeout=600) for p in processes] == [0] * 4
    names = mlx_jit_ahead.modules_for(mx.bfloat16)
    assert sorted(p.name for p in tmp_path.glob("*.ptx")) == sorted(f"{name}.ptx" for name in names)
    assert all((tmp_path / f"{name}.txt").stat().st_size > 0 for name in names)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
