"""Rotary position embeddings: default, linear and llama3 scaling.

Frequencies follow transformers' `modeling_rope_utils` definitions; `mx.fast.rope` takes
either a base or explicit per-dimension periods (1 / inv_freq).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError


def default_inv_freq(dims: int, base: float) -> mx.array:
    return 1.0 / (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))


def llama3_inv_freq(dims: int, base: float, scaling: dict[str, Any]) -> mx.array:
    inv_freq = default_inv_freq(dims, base)
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = mx.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = mx.logical_and(wavelen >= high_freq_wavelen, wavelen <= low_freq_wavelen)
    return mx.where(is_medium, smoothed, scaled)


class RoPE(nn.Module):
    def __init__(self, dims: int, base: float, traditional: bool = False, scale: float = 1.0,
                 inv_freq: mx.array | None = None):
        super().__init__()
        self.dims = dims
        self.base = None if inv_freq is not None else base
        self.traditional = traditional
        self.scale = scale
        # Stored under a private name so it is not mistaken for a checkpoint parameter.
        self._periods = None if inv_freq is None else 1.0 / inv_freq

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base,
                            scale=self.scale, offset=offset, freqs=self._periods)


def rope_scaling_config(rope_scaling: dict | None, rope_parameters: dict | None) -> dict | None:
    """transformers < 5 writes `rope_scaling`; transformers 5 folds it into `rope_parameters`."""
    cfg = rope_scaling or rope_parameters
    if not cfg:
        return None
    kind = cfg.get("rope_type", cfg.get("type", "default"))
    return None if kind == "default" else {**cfg, "rope_type": kind}


def rope_base(rope_theta: float | None, rope_parameters: dict | None, default: float = 10000.0) -> float:
    if rope_parameters and "rope_theta" in rope_parameters:
        return float(rope_parameters["rope_theta"])
    return float(rope_theta) if rope_theta is not None else default


def initialize_rope(dims: int, base: float, traditional: bool, scaling: dict | None) -> RoPE:
    if scaling is None:
        return RoPE(dims, base, traditional)
    kind = scaling["rope_type"]
    if kind == "linear":
        return RoPE(dims, base, traditional, scale=1.0 / float(scaling["factor"]))
    if kind == "llama3":
        return RoPE(dims, base, traditional, inv_freq=llama3_inv_freq(dims, base, scaling))
    raise UnsupportedModelError(f"rope scaling type '{kind}' is not supported (supported: default, linear, llama3)")
