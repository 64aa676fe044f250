"""benchmarks/paged_kernel.py without a GPU: --min-blocks compiles the tensor-core body, and only it, with the launch
bounds asked for, under a name of its own."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import paged_kernel  # noqa: E402

from mlxcel_core.backends.cuda import paged_attention as cpa  # noqa: E402
from mlxcel_core.backends.cuda.kernels import cubin_cache  # noqa: E402


def test_min_blocks_bounds_the_tensor_core_body_only(monkeypatch):
    built = []
    monkeypatch.setattr(cubin_cache, "cuda_kernel", lambda **kwargs: built.append(kwargs) or kwargs)
    monkeypatch.setattr(cpa, "_kernel", cpa._kernel)  # (restored, with its cache, after the test)
    try:
        paged_kernel.bound_tensor_core_body(4)
        cpa._kernel(False, True, True, False, True)
        cpa._kernel(False, True, True, False, False)
    finally:
        cpa._kernel.cache_clear()
    tensor, lanes = built
    assert tensor["name"] == "paged_decode_split_combine_new_kv_mma_lb4" and tensor["launch_bounds"] == (128, 4)
    assert lanes["name"] == "paged_decode_split_combine_new_kv" and "launch_bounds" not in lanes
