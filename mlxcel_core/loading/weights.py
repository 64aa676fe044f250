"""Build a model from config + weights, quantizing exactly the layers that ship quantized."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import CorruptModelError
from ..models import model_class_for
from ..models.base import is_quantizable

# MLX's quantization modes without biases, by (group size, bits): their scales are 8-bit floats (E8M0 or E4M3).
_MODES_WITHOUT_BIASES = {(32, 4): "mxfp4", (16, 4): "nvfp4", (32, 8): "mxfp8"}


def _quantization_of(path: str, module: nn.Module, weights: dict[str, mx.array]) -> dict | bool:
    """Per-layer group size, bits and mode, read off the packed shapes (works for GGUF and MLX checkpoints): affine
    where the layer has `.biases`, else the float mode of that group size and bits (gpt-oss's MXFP4 experts)."""
    scales = weights.get(f"{path}.scales")
    if scales is None or not is_quantizable(module):
        return False
    in_dims = module.weight.shape[-1]
    packed = weights[f"{path}.weight"].shape[-1]
    found = {"group_size": in_dims // scales.shape[-1], "bits": packed * 32 // in_dims}
    if f"{path}.biases" not in weights:
        mode = _MODES_WITHOUT_BIASES.get((found["group_size"], found["bits"]))
        if mode is None:
            raise CorruptModelError(f"{path} is quantized without biases at {found}: no MLX mode stores that")
        found["mode"] = mode
    return found


def _check_names(model: nn.Module, weights: dict[str, mx.array], model_type: str) -> None:
    expected = {name for name, _ in tree_flatten(model.parameters())}
    missing = sorted(expected - weights.keys())
    unexpected = sorted(weights.keys() - expected)
    for kind, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise CorruptModelError(f"checkpoint does not match the {model_type} architecture: {kind} tensors {shown}")


def build_model(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    dtype: mx.Dtype | None = None,
    group: "mx.distributed.Group | None" = None,
) -> nn.Module:
    """`group` (size > 1): shard the model for tensor parallelism; each rank evaluates only its slices.
    `weights` may then hold loading/sliced.py handles (read here, after slicing) as well as arrays."""
    model_cls, args_cls = model_class_for(config)
    try:
        args = args_cls.from_dict(config)
    except TypeError as exc:
        raise CorruptModelError(f"config.json is incomplete for {config.get('model_type')}: {exc}") from exc
    model = model_cls(args)
    sharded = group is not None and group.size() > 1
    if sharded:
        from ..distributed.shard import check_shardable, sanitize_reads_handles
        from .sliced import materialize

        check_shardable(model, group.size())  # before sanitize: only the supported families' sanitize sees handles
        if not sanitize_reads_handles(model):  # it reshapes tensors: read them whole (each rank keeps its slices)
            weights = materialize(weights)
    weights = model.sanitize(weights)
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    if any(k.endswith(".scales") for k in weights):
        nn.quantize(model, class_predicate=lambda p, m: _quantization_of(p, m, weights))
    if sharded:
        from ..distributed.shard import shard_model

        weights = materialize(shard_model(model, weights, group))
    _check_names(model, weights, config["model_type"])
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        message = " ".join(str(exc).split())
        raise CorruptModelError(f"weights do not match the {config['model_type']} architecture: {message}") from exc
    mx.eval(model.parameters())
    model.eval()
    return model


def float32_on_cpu(model: nn.Module) -> bool:
    """On the CPU, a quantized model with half-precision scales computes in float32 (every floating parameter cast):
    MLX's CPU quantized kernels run several times faster with float32 scales and inputs than with bfloat16 or
    float16 ones, and float32 is the closer of the two to the checkpoint's own math. Returns whether it cast."""
    if mx.default_device() != mx.cpu:
        return False
    half = (mx.float16, mx.bfloat16)
    params = tree_flatten(model.parameters())
    if not any(path.endswith(".scales") and value.dtype in half for path, value in params):
        return False
    model.set_dtype(mx.float32)
    return True
