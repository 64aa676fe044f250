"""KV budget: how many tokens of KV cache the engine may hold, from bytes or a fraction of memory."""

from __future__ import annotations

import os
import re

import mlx.core as mx

from ..errors import InputError

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
    """Keys + values of every layer for one token, from the model's config (num_key_value_heads, head_dim)."""
    args = model.args
    heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    per_value = kv_bits / 8 + 2 * dtype_bytes / 64 if kv_bits else dtype_bytes  # packed + scale/bias per group
    return int(len(model.layers) * 2 * heads * head_dim * per_value) or 1


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
