"""Tests that start two tensor-parallel ranks on this host: on a CUDA machine those use NCCL, one GPU each."""

from __future__ import annotations

import pytest


def one_gpu_for_nccl() -> bool:
    import mlx.core as mx

    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available()) and mx.device_count(mx.gpu) < 2


two_ranks_here = pytest.mark.skipif(one_gpu_for_nccl(), reason="two NCCL ranks need two GPUs; this machine has one")
