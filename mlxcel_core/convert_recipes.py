"""Which layers `mlxcel convert -q` quantizes, at which bits, and the `quantization` entry config.json gets.

The rules are mlx-lm's (mlx_lm/utils.py quantize_model, mlx_lm/convert.py mixed_quant_predicate_builder), so a
converted directory has the layout `mlx_lm.convert` writes: a layer is quantized when it can be (Linear, Embedding,
expert banks) and its input dimension splits into whole groups; a mixed recipe `mixed_L_H` puts `v_proj` and
`down_proj` of the first and last eighth of the layers and of every third layer between at H bits, `lm_head` at H
bits and the rest at L bits. One addition: the input embedding (`embed_tokens`) is kept at H bits too, as the
output head is (in a model with tied embeddings it *is* the head).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import mlx.nn as nn

from .errors import InputError
from .models.base import is_quantizable

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
RECIPES = {"mixed_2_6": (2, 6), "mixed_3_4": (3, 4), "mixed_3_6": (3, 6), "mixed_4_6": (4, 6)}

Predicate = Callable[[str, nn.Module], "bool | dict"]


def mixed_predicate(recipe: str, model: nn.Module, group_size: int) -> Predicate:
    """mlx-lm's mixed recipe `recipe` for `model` (plus `embed_tokens` at the high bits)."""
    if recipe not in RECIPES:
        raise InputError(f"--q-recipe must be one of {', '.join(RECIPES)}, got '{recipe}'")
    low, high = RECIPES[recipe]
    down = [name for name, _ in model.named_modules() if "down_proj" in name]
    if not down:
        raise InputError(f"--q-recipe {recipe} needs a model with down_proj layers; this one has none")
    parts = down[0].split(".")
    where = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
    n = len(model.layers)

    def predicate(path: str, module: nn.Module) -> dict:
        parts = path.split(".")
        index = int(parts[where]) if len(parts) > where and parts[where].isdigit() else 0
        more = index < n // 8 or index >= 7 * n // 8 or (index - n // 8) % 3 == 2
        attention_value = any(key in path for key in ("v_proj", "v_a_proj", "v_b_proj"))
        head = "lm_head" in path or path.endswith("embed_tokens")
        bits = high if head or (more and (attention_value or "down_proj" in path)) else low
        return {"group_size": group_size, "bits": bits, "mode": "affine"}

    return predicate


def quantize_layers(model: nn.Module, bits: int, group_size: int, recipe: str | None = None) -> int:
    """Quantize `model` in place (affine); the number of layers quantized."""
    if bits not in SUPPORTED_BITS:
        raise InputError(f"--q-bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise InputError(
            f"--q-group-size must be one of {', '.join(map(str, SUPPORTED_GROUP_SIZES))}, got {group_size}"
        )
    chosen = mixed_predicate(recipe, model, group_size) if recipe else None
    count = 0

    def predicate(path: str, module: nn.Module):
        nonlocal count
        if not is_quantizable(module) or module.weight.shape[-1] % group_size != 0:
            return False
        count += 1
        return chosen(path, module) if chosen else True

    nn.quantize(model, group_size=group_size, bits=bits, mode="affine", class_predicate=predicate)
    return count


def quantization_entry(model: nn.Module) -> dict | None:
    """config.json's `quantization` for `model` as it is: None when no layer is quantized; the most common
    {group_size, bits, mode}, and every quantized layer by path when the layers differ (as mlx-lm writes a mixed
    recipe). mlxcel reads the layers' settings off the packed shapes; mlx-lm reads them from here."""
    layers = {
        name: {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}
        for name, m in model.named_modules()
        if "scales" in m and hasattr(m, "bits")
    }
    if not layers:
        return None
    counts = Counter(tuple(sorted(v.items())) for v in layers.values())
    entry = dict(counts.most_common(1)[0][0])
    entry = {"group_size": entry["group_size"], "bits": entry["bits"], "mode": entry["mode"]}
    if len(counts) > 1:
        entry.update(layers)
    return entry
