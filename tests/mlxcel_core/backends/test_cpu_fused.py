"""On the CPU with blas_rows.c, q/k/v and gate/up projections as one product each (backends/cpu_fused.py): the same
logits bit for bit as the layers one by one (a prompt, then decode steps; 4-, 8-bit, half precision; biases), the
layers still computing alone, each block's stack a product a step, and unprepare giving the model back. Both tests
of logits run a prompt and decode steps, so the queries' and keys' heads rotated together (one call) are checked too."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxcel_core import cpu_blas
from mlxcel_core.backends import cpu_float32, cpu_fused
from mlxcel_core.cache import make_cache
from mlxcel_core.loading.shape_table import SHAPES
from mlxcel_core.loading.shapes import build_random_model
from mlxcel_core.models.transformer import Attention, GatedMLP

pytestmark = pytest.mark.skipif(not cpu_fused.applies(), reason="not on the CPU with blas_rows.c")

PROMPT = [[5, 9, 33, 2, 71, 18, 40, 3, 66]]


def _model(bits, dtype="float32", model_type="llama", seed=3):
    config = dict(SHAPES["tiny"], model_type=model_type)
    return build_random_model("tiny", bits=bits, dtype=dtype, seed=seed, config=config)[0]


def _logits(model, steps: int = 8) -> list[mx.array]:
    """The prompt's logits, then each greedy decode step's."""
    cache = make_cache(len(model.model.layers))
    out = [model(mx.array(PROMPT), cache=cache)]
    for _ in range(steps):
        out.append(model(mx.argmax(out[-1][:, -1:], axis=-1), cache=cache))
    mx.eval(out)
    return out


def _blocks(model) -> list:
    return [m for _, m in model.named_modules() if isinstance(m, (Attention, GatedMLP))]


@pytest.mark.parametrize(
    "bits,dtype,model_type",
    [
        (4, "float32", "llama"),
        (8, "float32", "llama"),
        (None, "bfloat16", "llama"),
        (4, "float32", "qwen2"),  # (q/k/v biases)
        (4, "float32", "qwen3"),  # (per-head q/k norms: q and k rotated apart)
    ],
)
def test_the_stacked_products_give_the_layers_logits_bit_for_bit(bits, dtype, model_type):
    stacked = _model(bits, dtype, model_type)
    assert all(type(b).__name__.startswith("Stacked") for b in _blocks(stacked))
    plain = _model(bits, dtype, model_type)
    assert cpu_fused.unprepare(plain) == 4
    for a, b in zip(_logits(stacked), _logits(plain)):
        assert mx.array_equal(a, b).item()


def test_each_stack_is_one_product_and_the_layers_still_compute_alone():
    model = _model(4)
    attn = model.model.layers[0].self_attn
    x = mx.random.normal((1, 1, attn.q_proj.float32.weight.shape[1]), key=mx.random.key(1))
    alone = [layer(x) for layer in (attn.q_proj, attn.k_proj, attn.v_proj)]
    mx.eval(alone)
    before = cpu_blas.packed_products()
    together = attn.project(x)
    mx.eval(together)
    assert cpu_blas.packed_products() - before == 1
    assert all(mx.array_equal(a, b).item() for a, b in zip(alone, together))


def test_mixed_widths_are_not_stacked():
    model = _model(None, "bfloat16")
    cpu_float32.unprepare(model)  # (the stacks too)
    assert {type(b) for b in _blocks(model)} == {Attention, GatedMLP}
    attn = model.model.layers[0].self_attn
    attn.v_proj.weight = attn.v_proj.weight.astype(mx.float16)  # (another output dtype partner)
    cpu_float32.prepare(model)
    assert cpu_fused.prepare(model) == 3  # both MLPs and the other layer's attention
    assert type(attn) is Attention


def test_unprepare_gives_the_plain_blocks_back():
    model = _model(4)
    assert cpu_fused.unprepare(model) == 4
    assert {type(b) for b in _blocks(model)} == {Attention, GatedMLP}
    assert not any("qkv_stack" in b.__dict__ or "gate_up_stack" in b.__dict__ for b in _blocks(model))
    assert cpu_float32.unprepare(model) > 0  # (the layers' views of the stacks go with it)
