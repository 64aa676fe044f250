"""A gated delta-net layer's decode step on the two kernels (delta_net.py): which layers are swapped and when the ops
path stays; on CUDA, the kernels against the ops path (outputs, and the rows' state updated in place in its slots,
the other slots untouched), and a Qwen3.5 model's greedy tokens through the engine's paged decode (the kernels)
against the plain path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_qmv import needs_cuda

from mlxcel_core.backends.cuda.kernels import delta_net
from mlxcel_core.engine.recurrent_rollback import DecodeTokens
from mlxcel_core.models import model_class_for

ARGS = dict(
    model_type="qwen3_5_text",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=64,
    full_attention_interval=2,
    linear_conv_kernel_dim=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def _layer(dk: int = 16, dv: int = 16, dtype=mx.float32, seed: int = 0):
    """A Qwen3.5 delta-net layer with random parameters (dt_bias, A_log, the convolution's taps included)."""
    config = dict(ARGS, linear_key_head_dim=dk, linear_value_head_dim=dv)
    model_class, args_class = model_class_for(config)
    layer = model_class(args_class.from_dict(config)).model.layers[0].linear_attn
    rng = np.random.default_rng(seed)
    layer.update(
        {
            "conv1d": {"weight": mx.array(rng.normal(0, 0.5, layer.conv1d.weight.shape), dtype)},
            "A_log": mx.array(rng.normal(0, 1, (layer.num_v_heads,)), dtype),
            "dt_bias": mx.array(rng.normal(0, 1, (layer.num_v_heads,)), dtype),
        }
    )
    return layer


class _Cache:
    """The rows' state at `slots` of two pool arrays: gathered and scattered (the ops path), or in place."""

    def __init__(self, parts, slots, in_place: bool):
        self.parts, self.slots, self.kernel = parts, slots, in_place
        self.updated, self.noted = None, []

    def recurrent_state(self):
        return [p[self.slots] for p in self.parts]

    def update_state(self, state, length):
        self.updated = state

    def in_place(self):
        return (self.parts, self.slots) if self.kernel else None

    def wrote_in_place(self, array):
        self.noted.append(array)


def _inputs(layer, rows: int, dtype, seed: int = 1):
    rng = np.random.default_rng(seed)
    mixed = mx.array(rng.normal(0, 1, (rows, 1, layer.conv_dim)), dtype)
    b, a = (mx.array(rng.normal(0, 1, (rows, 1, layer.num_v_heads)), dtype) for _ in range(2))
    slots_total = 6
    conv = mx.array(rng.normal(0, 1, (slots_total, layer.conv_kernel - 1, layer.conv_dim)), dtype)
    shape = (slots_total, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    state = mx.array(rng.normal(0, 0.3, shape), mx.float32)
    mx.eval(mixed, b, a, conv, state)
    return mixed, b, a, [conv, state]


def test_every_delta_net_layer_is_swapped_and_restored():
    config = dict(ARGS, linear_key_head_dim=16, linear_value_head_dim=16, num_hidden_layers=4)
    model_class, args_class = model_class_for(config)
    model = model_class(args_class.from_dict(config))
    plain = {type(layer.linear_attn) for layer in model.model.layers if hasattr(layer, "linear_attn")}
    assert delta_net.use_delta_net_kernels(model) == 2
    assert all(isinstance(layer.linear_attn, delta_net.DeltaNetKernelsMixin) for layer in model.model.layers[::2])
    assert delta_net.use_delta_net_kernels(model) == 0  # already swapped
    assert delta_net.restore_delta_net(model) == 2
    assert {type(layer.linear_attn) for layer in model.model.layers if hasattr(layer, "linear_attn")} == plain


def test_the_ops_path_stays_where_the_state_is_not_in_place():
    """A cache that offers no in-place state, a forward over generated tokens (its checkpoint keeps the pool's
    arrays), or the CPU: the layer's own mix, the same arrays as the plain class's."""
    layer = _layer()
    mixed, b, a, parts = _inputs(layer, rows=2, dtype=mx.float32)
    slots = mx.array([3, 1], mx.int32)
    want = layer.mix(mixed, b, a, _Cache(parts, slots, in_place=False))
    delta_net.use_delta_net_kernels(layer)
    got = layer.mix(mixed, b, a, _Cache(parts, slots, in_place=False))
    assert mx.array_equal(got, want)
    verify = DecodeTokens(_Cache(parts, slots, in_place=True))  # speculative verification's (a checkpoint holds parts)
    assert mx.array_equal(layer.mix(mixed, b, a, verify), want) and verify.noted == []
    if not delta_net.on_gpu():
        cache = _Cache(parts, slots, in_place=True)
        assert mx.array_equal(layer.mix(mixed, b, a, cache), want) and cache.noted == []


@needs_cuda
@pytest.mark.parametrize(
    "dk, dv, dtype, tolerance",
    [
        (16, 16, mx.float32, 2e-5),
        (128, 128, mx.float32, 2e-5),
        (128, 128, mx.bfloat16, 2e-2),
        (64, 48, mx.float16, 2e-2),
    ],
)
def test_the_kernels_compute_the_ops_path_and_update_only_the_rows_slots(dk, dv, dtype, tolerance):
    layer = _layer(dk, dv, dtype)
    mixed, b, a, parts = _inputs(layer, rows=3, dtype=dtype)
    slots = mx.array([4, 0, 2], mx.int32)
    reference = _Cache(parts, slots, in_place=False)
    want = layer.mix(mixed, b, a, reference)
    mx.eval(want, reference.updated)
    before = [np.array(p.astype(mx.float32)) for p in parts]

    delta_net.use_delta_net_kernels(layer)
    cache = _Cache(parts, slots, in_place=True)
    got = layer.mix(mixed, b, a, cache)
    mx.eval(got)
    assert cache.noted and cache.noted[0] is got and got.dtype == dtype and got.shape == want.shape
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=tolerance)
    rows = np.array(slots)
    for part, old, new in zip(parts, before, reference.updated):
        after = np.array(part.astype(mx.float32))  # the kernels wrote into the pool's own buffers
        np.testing.assert_allclose(after[rows], np.array(new.astype(mx.float32)), atol=tolerance)
        others = np.setdiff1d(np.arange(old.shape[0]), rows)
        np.testing.assert_array_equal(after[others], old[others])
