"""autotune/graph_chain.py: a tune candidate's chain of launches is timed as a replayed CUDA graph, cycling through
enough weight copies that no launch finds its weight in the L2 cache. The replay needs the CUDA kernels (the last
test)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from autotune.graph_chain import ROTATE_BYTES, weight_copies
from mlxcel_core.backends.cuda.kernels import qmv


@pytest.mark.parametrize(
    "weight_bytes, calls, want",
    [
        (ROTATE_BYTES, 20, 1),  # one weight as large as the rotation: each launch reads it from memory
        (ROTATE_BYTES * 3, 20, 1),
        (ROTATE_BYTES // 4, 20, 4),
        (ROTATE_BYTES // 4 - 1, 20, 5),
        (1 << 20, 20, 20),  # small weights: one copy a launch, the chain as long as it is
        (0, 3, 3),
    ],
)
def test_weight_copies_cover_the_rotation_or_the_chain(weight_bytes, calls, want):
    assert weight_copies(weight_bytes, calls) == want


@pytest.mark.skipif(not qmv.kernel_ready(), reason="needs MLX's CUDA backend and a CUDA device")
def test_a_replayed_chain_writes_what_mlx_computes():
    from autotune.graph_chain import GraphChains

    n, k, m = 1024, 4096, 2
    x = mx.random.normal((m, k), key=mx.random.key(0)).astype(mx.float16)
    ws = [mx.random.normal((n, k), key=mx.random.key(1 + i)).astype(mx.float16) * 0.02 for i in range(3)]
    ws = [mx.quantize(w, group_size=64, bits=4) for w in ws]
    mx.eval(x, ws)

    def chain():
        y = qmv.cuda_quantized_matvec(x, *ws[0], 64)
        for i in (1, 2):
            y = qmv.cuda_quantized_matvec(mx.depends(x, y), *ws[i], 64)
        return y

    want = np.array(qmv.cuda_quantized_matvec(x, *ws[2], 64), np.float32)
    graphs = GraphChains()
    try:
        run = graphs.capture(chain)
        assert len(graphs.graphs) == 1
        out = run()
        graphs.sync()
        np.testing.assert_array_equal(np.array(out, np.float32), want)
    finally:
        graphs.close()
