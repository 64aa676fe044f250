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


def _on_cuda() -> bool:
    return qmv.cuda_kernel_available() and mx.default_device().type == mx.DeviceType.gpu


def _assert_route_around_agrees(got: mx.array, want: np.ndarray, x: mx.array, layer: nn.Module) -> None:
    """The routed-around product (x @ dequantize(W).T) against MLX's quantized_matmul computed on the CPU stream:
    equal up to float32 rounding where float32 matmuls are float32 (the CPU); on CUDA, where MLX runs float32 matmuls
    as TF32 (inputs rounded to 10-bit mantissas), within 2^-9 x |x| @ |W|.T (TF32's rounding of x and W is at most
    2^-11 of each product). A garbage product (the fault's) is off by about |x| @ |W|.T itself."""
    got = np.array(got)
    if not _on_cuda():
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        return
    with mx.stream(mx.cpu):
        w = mx.dequantize(layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits)
        mx.eval(w)
    mag = np.abs(np.array(x, np.float64)) @ np.abs(np.array(w, np.float64)).T
    np.testing.assert_array_less(np.abs(got - want), 2.0**-9 * mag + 1e-5)


def test_only_layers_whose_input_is_one_group_change_class():
    model = quantized_tiny()
    x = mx.random.normal((3, 64))
    # MLX's quantized_matmul at K == group size: on the CPU stream, where it is right (on CUDA it is the fault)
    with mx.stream(mx.cpu):
        narrow_before = np.array(model.narrow(x))
        lm_head_before = np.array(model.embed.as_linear(x))
    grouped32_before = np.array(model.grouped32(x))  # (K = 64, group 32: right on every device; the same call after)
    params_before = dict(tree_flatten(model.parameters()))
    assert mlx_workarounds.route_around_qmm_fault(model) == 2
    assert type(model.narrow) is mlx_workarounds.OneGroupQuantizedLinear
    assert type(model.embed) is mlx_workarounds.OneGroupQuantizedEmbedding
    assert type(model.wide) is nn.QuantizedLinear and type(model.grouped32) is nn.QuantizedLinear
    # the parameters stay packed and the same
    assert dict(tree_flatten(model.parameters())).keys() == params_before.keys()
    # the same weights the quantized matmul used: equal up to float32 rounding (TF32's on CUDA)
    _assert_route_around_agrees(model.narrow(x), narrow_before, x, model.narrow)
    np.testing.assert_allclose(np.array(model.grouped32(x)), grouped32_before, rtol=0, atol=0)
    _assert_route_around_agrees(model.embed.as_linear(x), lm_head_before, x, model.embed)


def test_prepare_model_routes_around_it_only_on_cuda():
    model = quantized_tiny()
    prepare_model(model)
    assert (type(model.narrow) is mlx_workarounds.OneGroupQuantizedLinear) == qmv.cuda_kernel_available()


def test_float_expert_banks_drop_the_sorted_hint_and_compute_the_same():
    from mlxcel_core.models.moe import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

    mx.random.seed(4)
    glu, quantized = SwitchGLU(64, 32, 4, bias=True), SwitchGLU(64, 32, 4)
    nn.quantize(quantized, group_size=32, bits=4)
    x = mx.random.normal((40, 64))  # 80 routed pairs: the sorted path
    indices = mx.random.randint(0, 4, (40, 2)).astype(mx.uint32)
    before = np.array(glu(x, indices))
    assert mlx_workarounds.route_around_sorted_gather_race(glu) == 3
    assert mlx_workarounds.route_around_sorted_gather_race(quantized) == 0
    assert type(glu.gate_proj) is mlx_workarounds.UnsortedHintSwitchLinear and isinstance(glu.up_proj, SwitchLinear)
    assert type(quantized.down_proj) is QuantizedSwitchLinear
    np.testing.assert_allclose(np.array(glu(x, indices)), before, rtol=0, atol=1e-5)


def test_prepare_model_drops_the_hint_only_on_cuda():
    from mlxcel_core.models.moe import SwitchGLU, SwitchLinear

    glu = SwitchGLU(64, 32, 4)
    prepare_model(glu)
    assert (type(glu.gate_proj) is not SwitchLinear) == qmv.cuda_kernel_available()
