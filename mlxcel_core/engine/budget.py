"""KV budget: how many tokens of KV cache the engine may hold, from bytes or a fraction of memory."""

from __future__ import annotations

import os
import re

import mlx.core as mx

from ..errors import InputError
from ..models.base import kv_layout, state_layout

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
}


def device_memory_bytes() -> int:
    """The accelerator's memory where MLX reports it, else the machine's RAM."""
    try:
        info = mx.device_info()
        size = info.get("memory_size") or info.get("total_memory")
        if size:
            return int(size)
    except (AttributeError, RuntimeError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_bytes_per_token(model, kv_bits: int | None = None, dtype_bytes: int = 2) -> int:
    """Keys + values of every layer for one token, from the model's config (num_key_value_heads, head_dim); for
    multi-head latent attention (DeepSeek-V3: `kv_lora_rank`), the one latent key a layer caches: kv_lora_rank +
    qk_rope_head_dim values, no separate values."""
    args = model.args
    per_value = kv_bits / 8 + 2 * dtype_bytes / 64 if kv_bits else dtype_bytes  # packed + scale/bias per group
    if getattr(args, "kv_lora_rank", None):
        return int(len(model.layers) * (args.kv_lora_rank + args.qk_rope_head_dim) * per_value) or 1
    # Per stored layer, its own heads x head size (models.base.kv_layout: Gemma 4's KV-shared layers store none)
    widths = [heads * head_dim for heads, head_dim in filter(None, kv_layout(model))]
    return int(2 * sum(widths) * per_value) or 1


def state_bytes_per_sequence(model, dtype_bytes: int = 2) -> int:
    """The recurrent state one sequence holds in every recurrent layer (base.state_layout): each part's elements
    times its dtype's size (`dtype_bytes` for parts in the activations' dtype); 0 for a model without such layers."""
    total = 0
    for parts in filter(None, state_layout(model)):
        for shape, dtype in parts:
            count = 1
            for n in shape:
                count *= n
            total += count * (dtype.size if dtype is not None else dtype_bytes)
    return total


def state_tokens_per_sequence(model, kv_bits: int | None = None, dtype_bytes: int = 2) -> int:
    """A sequence's recurrent state in tokens of the KV budget (rounded up): what admission reserves for it besides
    its prompt and output tokens, so that the budget counts the state's memory too."""
    state = state_bytes_per_sequence(model, dtype_bytes)
    return -(-state // kv_bytes_per_token(model, kv_bits, dtype_bytes)) if state else 0


def parse_kv_budget(text: str, bytes_per_token: int) -> int:
    """'0.3' (fraction of device memory), '4GiB', '512m' or '100000t' (tokens) -> tokens."""
    value = text.strip().lower()
    if match := re.fullmatch(r"(\d+)\s*t(okens)?", value):
        tokens = int(match.group(1))
    elif match := re.fullmatch(r"(\d*\.?\d+)\s*([a-z]*)", value):
        number, unit = float(match.group(1)), match.group(2)
        if unit == "" and number <= 1.0:
            tokens = int(number * device_memory_bytes() / bytes_per_token)
        elif unit in _UNITS:
            tokens = int(number * _UNITS[unit] / bytes_per_token)
        else:
            raise InputError(f"KV budget '{text}': unknown unit '{unit}' (use e.g. 0.3, 4GiB, 512MiB or 100000t)")
    else:
        raise InputError(f"KV budget '{text}' is not a fraction, a size or a token count (e.g. 0.3, 4GiB, 100000t)")
    if tokens < 1:
        raise InputError(f"KV budget '{text}' holds no token of this model's KV cache")
    return tokens
