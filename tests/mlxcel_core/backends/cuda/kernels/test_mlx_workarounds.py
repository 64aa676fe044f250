"""The load-time route around MLX's CUDA quantized_matmul fault at K == group size (kernels/mlx_workarounds.py)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlxcel_core.backends.cuda.kernels import mlx_workarounds, prepare_model, qmv


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.narrow = nn.Linear(64, 96, bias=True)  # K = 64 = the group size: the fault
        self.wide = nn.Linear(128, 64)  # K = 128: fine
        self.grouped32 = nn.Linear(64, 32)  # quantized with group 32 below: fine


def quantized_tiny():
    mx.random.seed(3)
    model = Tiny()
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda path, m: path != "grouped32")
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda path, m: path == "grouped32")
    return model


def test_only_layers_whose_input_is_one_group_change_class():
    model = quantized_tiny()
    x = mx.random.normal((3, 64))
    before = {name: np.array(getattr(model, name)(x)) for name in ("narrow", "grouped32")}
    lm_head_before = np.array(model.embed.as_linear(x))
    params_before = dict(tree_flatten(model.parameters()))
    assert mlx_workarounds.route_around_qmm_fault(model) == 2
    assert type(model.narrow) is mlx_workarounds.OneGroupQuantizedLinear
    assert type(model.embed) is mlx_workarounds.OneGroupQuantizedEmbedding
    assert type(model.wide) is nn.QuantizedLinear and type(model.grouped32) is nn.QuantizedLinear
    # the parameters stay packed and the same
    assert dict(tree_flatten(model.parameters())).keys() == params_before.keys()
    # the same weights the quantized matmul used: equal up to float32 rounding
    np.testing.assert_allclose(np.array(model.narrow(x)), before["narrow"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.array(model.grouped32(x)), before["grouped32"], rtol=0, atol=0)
    np.testing.assert_allclose(np.array(model.embed.as_linear(x)), lm_head_before, rtol=0, atol=1e-5)


def test_prepare_model_routes_around_it_only_on_cuda():
    model = quantized_tiny()
    prepare_model(model)
    assert (type(model.narrow) is mlx_workarounds.OneGroupQuantizedLinear) == qmv.cuda_kernel_available()
