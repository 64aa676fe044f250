"""LoRA / DoRA adapters in the format mlx-lm's trainer writes, fused into a built model's weights at load.

An adapter directory holds adapter_config.json (`fine_tune_type` lora | dora | full, `num_layers`,
`lora_parameters` {rank, scale, dropout, keys}) and adapters.safetensors. Which layers an adapter targets follows
mlx_lm/tuner/utils.py: `keys` (default: every Linear, Embedding and expert bank inside a decoder layer) in the last
`num_layers` layers (all of them for num_layers <= 0, as mlx-lm slices), and keys naming top-level modules
(`lm_head`). The fused weights are what mlx_lm/tuner/lora.py and dora.py compute:

- Linear:    W + scale * lora_b^T @ lora_a^T           (lora_a [in, r], lora_b [r, out])
- Embedding: W + scale * lora_a @ lora_b               (lora_a [vocab, r], lora_b [r, dims])
- experts:   W + scale * lora_b @ lora_a, per expert   (lora_a [E, r, in], lora_b [E, out, r])
- DoRA:      the LoRA weight with each row rescaled to norm m (m defaults to the base rows' norms)

A quantized base layer is dequantized (exactly what its kernels compute with), fused, and kept in float: the result
is the adapted model exactly, at the cost of those layers' memory (requantizing would round the adapter away in
part). `full` adapters replace the named parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .dequantize import dequantized_layer, dequantized_weight, is_quantized
from .errors import CorruptModelError, InputError, UnsupportedModelError
from .models.moe import QuantizedSwitchLinear, SwitchLinear

_LINEAR = (nn.Linear, nn.QuantizedLinear)
_EMBEDDING = (nn.Embedding, nn.QuantizedEmbedding)
_EXPERTS = (SwitchLinear, QuantizedSwitchLinear)
_TARGETS = _LINEAR + _EMBEDDING + _EXPERTS


@dataclass(frozen=True)
class AdapterConfig:
    kind: str  # lora | dora | full
    num_layers: int
    rank: int
    scale: float
    keys: list[str] | None


def read_config(directory: Path) -> AdapterConfig:
    if not directory.is_dir():
        raise InputError(f"adapter path {directory} is not a directory")
    path = directory / "adapter_config.json"
    if not path.is_file():
        raise InputError(f"{directory} has no adapter_config.json (not an mlx-lm adapter directory)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CorruptModelError(f"{path} is not valid JSON: {exc}") from None
    kind = raw.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora", "full"):
        raise UnsupportedModelError(f"{path}: fine_tune_type '{kind}' is not supported (lora, dora, full)")
    if kind == "full":
        return AdapterConfig(kind, 0, 0, 0.0, None)
    params = raw.get("lora_parameters")
    if not isinstance(params, dict) or not isinstance(raw.get("num_layers"), int):
        raise CorruptModelError(f"{path} needs an integer num_layers and a lora_parameters object")
    if "scale" not in params:
        hint = " (it has 'alpha': mlx-lm's adapters give 'scale')" if "alpha" in params else ""
        raise CorruptModelError(f"{path}: lora_parameters has no 'scale'{hint}")
    keys = params.get("keys")
    if not isinstance(params.get("rank"), int) or not isinstance(params["scale"], (int, float)):
        raise CorruptModelError(f"{path}: lora_parameters needs an integer rank and a numeric scale")
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise CorruptModelError(f"{path}: lora_parameters.keys must be a list of module names")
    return AdapterConfig(kind, raw["num_layers"], params["rank"], float(params["scale"]), keys)


def _read_weights(directory: Path) -> dict[str, mx.array]:
    path = directory / "adapters.safetensors"
    if not path.is_file():
        raise InputError(f"{directory} has no adapters.safetensors")
    try:
        return mx.load(str(path))
    except Exception as exc:
        raise CorruptModelError(f"cannot read {path}: {str(exc).splitlines()[0]}") from None


def target_modules(model: nn.Module, config: AdapterConfig) -> dict[str, nn.Module]:
    """The modules the adapter applies to, by full path (mlx-lm's linear_to_lora_layers)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise UnsupportedModelError("this model has no decoder layer list to apply LoRA adapters to")
    paths = {id(m): name for name, m in model.named_modules()}
    keys = config.keys
    if keys is None:
        keys = {k for layer in layers for k, m in layer.named_modules() if isinstance(m, _TARGETS)}
    targets: dict[str, nn.Module] = {}
    for layer in layers[-max(config.num_layers, 0) :]:
        prefix = paths[id(layer)]
        targets.update({f"{prefix}.{k}": m for k, m in layer.named_modules() if k in keys})
    targets.update({k: m for k, m in model.named_modules() if k in keys})
    everywhere = {k for layer in layers for k, _ in layer.named_modules()} | {k for k, _ in model.named_modules()}
    unknown = sorted(set(keys) - everywhere)
    if unknown:
        raise InputError(f"adapter key '{unknown[0]}' matches no layer of the model")
    wrong = sorted(p for p, m in targets.items() if not isinstance(m, _TARGETS))
    if wrong:
        raise UnsupportedModelError(f"cannot apply LoRA to {wrong[0]} ({type(targets[wrong[0]]).__name__})")
    return targets


def _expected_shapes(module: nn.Module, rank: int, dora: bool) -> dict[str, tuple]:
    weight = dequantized_weight(module) if is_quantized(module) else module.weight
    if isinstance(module, _EXPERTS):
        experts, out_dims, in_dims = weight.shape
        return {"lora_a": (experts, rank, in_dims), "lora_b": (experts, out_dims, rank)}
    if isinstance(module, _EMBEDDING):
        rows, dims = weight.shape
        shapes = {"lora_a": (rows, rank), "lora_b": (rank, dims)}
    else:
        rows, in_dims = weight.shape
        shapes = {"lora_a": (in_dims, rank), "lora_b": (rank, rows)}
    return {**shapes, "m": (rows,)} if dora else shapes


def _fused_weight(module: nn.Module, tensors: dict[str, mx.array], scale: float, dora: bool) -> mx.array:
    weight = dequantized_weight(module) if is_quantized(module) else module.weight
    a, b = tensors["lora_a"], tensors["lora_b"]
    if isinstance(module, _EMBEDDING):
        delta = (scale * a) @ b
    elif isinstance(module, _EXPERTS):
        delta = (scale * b) @ a
    else:
        delta = (scale * b.T) @ a.T
    fused = weight + delta.astype(weight.dtype)
    if not dora:
        return fused
    m = tensors.get("m")
    if m is None:  # mlx-lm's initial magnitude: the base rows' norms
        m = mx.linalg.norm(weight.astype(mx.float32), axis=1)
    return ((m / mx.linalg.norm(fused, axis=1))[:, None] * fused).astype(weight.dtype)


def _check_tensors(weights: dict[str, mx.array], targets: dict[str, nn.Module], config: AdapterConfig) -> dict:
    dora = config.kind == "dora"
    expected = {
        f"{path}.{leaf}": shape
        for path, m in targets.items()
        for leaf, shape in _expected_shapes(m, config.rank, dora).items()
    }
    for name, value in weights.items():
        if name not in expected:
            raise InputError(f"adapter tensor {name} matches no adapted layer of the model")
        if tuple(value.shape) != expected[name]:
            raise InputError(f"adapter tensor {name} has shape {tuple(value.shape)}, the model needs {expected[name]}")
    grouped: dict[str, dict[str, mx.array]] = {}
    for name, value in weights.items():
        path, leaf = name.rsplit(".", 1)
        grouped.setdefault(path, {})[leaf] = value
    for path, tensors in grouped.items():
        if not {"lora_a", "lora_b"} <= tensors.keys():
            raise InputError(f"adapter for {path} needs both lora_a and lora_b")
    return grouped


def _load_full(model: nn.Module, weights: dict[str, mx.array]) -> int:
    params = dict(tree_flatten(model.parameters()))
    for name, value in weights.items():
        if name not in params:
            raise InputError(f"adapter tensor {name} is not a parameter of the model")
        if value.shape != params[name].shape:
            raise InputError(
                f"adapter tensor {name} has shape {tuple(value.shape)}, the model {tuple(params[name].shape)}"
            )
    model.load_weights(list(weights.items()), strict=False)
    return len(weights)


def fuse_adapters(model: nn.Module, directory: Path | str, log: Callable[[str], None] = lambda _: None) -> int:
    """Fuse the adapter in `directory` into `model` in place; the number of layers changed."""
    directory = Path(directory).expanduser()
    config = read_config(directory)
    weights = _read_weights(directory)
    if config.kind == "full":
        count = _load_full(model, weights)
        mx.eval(model.parameters())
        log(f"adapter {directory}: {count} parameters replaced (full fine-tune)")
        return count
    targets = target_modules(model, config)
    grouped = _check_tensors(weights, targets, config)
    replaced, dequantized = [], 0
    for path, tensors in grouped.items():
        module = targets[path]
        if config.kind == "dora" and isinstance(module, _EXPERTS):
            raise UnsupportedModelError(f"DoRA on expert banks ({path}) is not supported (mlx-lm has none either)")
        fused = _fused_weight(module, tensors, config.scale, config.kind == "dora")
        if is_quantized(module):
            replaced.append((path, dequantized_layer(module, fused)))
            dequantized += 1
        else:
            module.weight = fused
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    mx.eval(model.parameters())
    note = f"; {dequantized} quantized layers dequantized to fuse exactly (they stay in float)" if dequantized else ""
    log(f"adapter {directory}: {config.kind} fused into {len(grouped)} layers{note}")
    return len(grouped)
