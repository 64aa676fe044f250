"""Known model shapes with random weights: benchmark an architecture at its real size without a checkpoint.

    model, config = build_random_model("llama-3-8b", bits=4)   # random normal * 0.02, quantized (group 64)

Each shape is a config.json-style dict, so the model is built through the same registry as a real
checkpoint (`model_class_for`), and another runtime (mlx-lm) can build the identical architecture.
Layers are generated and quantized one at a time, so a 4-bit 70B never exists in 16-bit all at once.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from .shape_table import SHAPES

DTYPES = ("bfloat16", "float16", "float32")
QUANT_GROUP_SIZE = 64


def shape_names() -> list[str]:
    return list(SHAPES)


def add_shape_arguments(parser, default_shape: str = "llama-3.2-1b") -> None:
    """The benchmark scripts' model options: --model-shape, --bits, --dtype, --prompt-tokens (an argparse parser)."""
    parser.add_argument("--model-shape", choices=shape_names(), default=default_shape)
    parser.add_argument("--bits", type=int, choices=(4, 8))
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--prompt-tokens", type=int, default=512)


def shape_config(name: str) -> dict[str, Any]:
    """A copy of the shape's config.json-style dict; InputError for unknown names."""
    if name not in SHAPES:
        raise InputError(f"unknown model shape '{name}' (known: {', '.join(SHAPES)})")
    config = dict(SHAPES[name])
    if "rope_scaling" in config:
        config["rope_scaling"] = dict(config["rope_scaling"])
    return config


def check_shape_options(name: str, bits: int | None, dtype: str) -> None:
    shape_config(name)
    if bits not in (None, 4, 8):
        raise InputError(f"--bits must be 4 or 8, got {bits}")
    if dtype not in DTYPES:
        raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")


def describe_shape(name: str, bits: int | None, dtype: str) -> str:
    short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[dtype]
    experts = ", experts mxfp4" if _mxfp4_experts(SHAPES.get(name, {})) else ""
    return f"{name} (random) " + (f"Q{bits} g{QUANT_GROUP_SIZE}" if bits else short) + experts


def _mxfp4_experts(config: dict[str, Any]) -> bool:
    """Whether the shape's checkpoints ship their MoE experts as MXFP4 (gpt-oss's `quantization_config`)."""
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def build_random_model(
    name: str, bits: int | None = None, dtype: str = "bfloat16", seed: int = 0, group=None, config=None
):
    """Return (model, config): the shape's architecture, weights random normal * 0.02 in `dtype`.

    `config`: a variant of the shape's config dict to build instead (benchmarks/scaled_shapes.py's scaled-down
    copies); None builds the shape itself.

    `group` (size > 1): this rank's tensor-parallel shard. Every rank draws the same whole layer from the
    same seed and keeps its slices before the next layer is drawn, so the shards of all ranks together are
    exactly the single-process model and a rank never holds more than its shard plus one whole layer.

    RMSNorm weights are ones (as at initialisation), so activations keep a realistic scale.
    With `bits`, every Linear and Embedding is quantized with nn.quantize (group size 64, affine),
    the way MLX-quantized checkpoints are; norms stay in `dtype`. A shape whose checkpoints ship MXFP4 experts
    (gpt-oss) gets its expert banks in MLX's mxfp4 mode (group 32), with or without `bits`.
    """
    import mlx.core as mx

    from .. import backends
    from ..models import model_class_for
    from ..paths import use_kernel_cache
    from .weights import float32_on_cpu

    use_kernel_cache()  # before anything compiles
    check_shape_options(name, bits, dtype)
    config = dict(config) if config is not None else shape_config(name)
    model_cls, args_cls = model_class_for(config)
    model = model_cls(args_cls.from_dict(config))
    sharded = group is not None and group.size() > 1
    if sharded:
        from ..distributed.shard import check_shardable

        check_shardable(model, group.size())
    fill = _RandomFill(seed, getattr(mx, dtype), bits, _mxfp4_experts(config))
    # One layer at a time: peak memory stays near the final model plus one layer in `dtype`.
    for i, layer in enumerate(model.layers):
        fill(layer)
        if sharded:
            from ..distributed.shard import shard_layer

            shard_layer(layer, f"model.layers.{i}", {}, group)
            mx.eval(layer.parameters())
    fill(model, skip="model.layers.")  # embeddings, final norm, LM head
    float32_on_cpu(model)  # as a loaded checkpoint does
    model.eval()
    backends.current().prepare_model(model)  # the backend's kernel modules, where it has any
    return model, config


class _RandomFill:
    """Fills a module's parameters (matrices normal * 0.02, biases zeros, norm weights ones, in `dtype`) and
    quantizes them as build_random_model says, each call drawing its keys from where the last one stopped."""

    def __init__(self, seed: int, dtype, bits: int | None, mxfp4: bool):
        import mlx.core as mx

        self.key, self.dtype, self.bits, self.mxfp4 = mx.random.key(seed), dtype, bits, mxfp4

    def __call__(self, module, skip: str | None = None) -> None:
        import mlx.core as mx
        import mlx.nn as nn

        self._randomize(module, skip)
        if self.bits or self.mxfp4:
            nn.quantize(
                module,
                group_size=QUANT_GROUP_SIZE,
                bits=self.bits,
                class_predicate=lambda p, m: (not skip or not p.startswith(skip)) and self._quantization(m),
            )
        mx.eval(module.parameters())

    def _randomize(self, module, skip: str | None) -> None:
        import mlx.core as mx
        from mlx.utils import tree_flatten, tree_unflatten

        new = []
        for path, value in tree_flatten(module.parameters()):
            if skip and path.startswith(skip):
                continue
            self.key, sub = mx.random.split(self.key)
            if value.ndim >= 2:  # matrices and embeddings
                value = (mx.random.normal(value.shape, key=sub) * 0.02).astype(self.dtype)
            elif path.endswith("bias"):
                value = mx.zeros(value.shape, dtype=self.dtype)
            else:  # norm weights
                value = mx.ones(value.shape, dtype=self.dtype)
            new.append((path, value))
        module.update(tree_unflatten(new), strict=False)

    def _quantization(self, module) -> bool | dict:
        from ..models.moe import SwitchLinear

        if self.mxfp4 and isinstance(module, SwitchLinear):
            return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        quantizable = hasattr(module, "to_quantized") and module.weight.shape[-1] % QUANT_GROUP_SIZE == 0
        return bool(self.bits) and quantizable


def count_parameters(model) -> tuple[int, int]:
    """(logical parameter count, bytes in memory): quantized weights count as the values they encode."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from ..models.moe import QuantizedSwitchLinear

    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
    n_params = 0
    n_bytes = 0
    for _, module in model.named_modules():
        own = {k: v for k, v in module.items() if hasattr(v, "size") and hasattr(v, "nbytes")}
        bits = getattr(module, "bits", None) if isinstance(module, quantized) else None
        for name, value in own.items():
            n_bytes += value.nbytes
            if bits and name == "weight":
                n_params += value.size * 32 // bits
            elif bits and name in ("scales", "biases"):
                continue
            else:
                n_params += value.size
    if n_bytes == 0:  # a model without named_modules children: count flat arrays
        for _, value in tree_flatten(model.parameters()):
            n_params += value.size
            n_bytes += value.nbytes
    return n_params, n_bytes
