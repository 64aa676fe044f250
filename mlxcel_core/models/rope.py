"""Rotary position embeddings: default, linear, llama3, yarn and longrope (alias su).

Each variant gives what transformers' `modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type]` gives:
inverse frequencies and an attention factor ("mscale"; 1.0 except yarn/longrope) that transformers
multiplies into cos and sin. `mx.fast.rope` takes a base or explicit per-dimension periods
(1 / inv_freq); since the rotation is linear, multiplying the rotated dims of its output by the factor
equals scaling cos/sin. Dimensions past `dims` (partial rotary) pass through unscaled, as in transformers.

LongRoPE picks its short or long factors per forward, as transformers does per call: long when the last
position of the call is past `original_max_position_embeddings` (transformers: max(position_ids) + 1 >
original). A KV cache that grows past that threshold keeps the keys it already holds rotated with the
short factors and rotates new tokens with the long ones. transformers' Phi-3 instead drops its cache
and re-runs the whole sequence with long factors at that step; we do not re-prefill, so a generation
that crosses the threshold can differ from transformers' `generate` after the crossing. Prompts that
start past the threshold, or generations that stay below it, match exactly. With a per-row offset
array the choice is made per row; left padding counts as positions there (it shifts the threshold
of a padded row by its padding).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError

SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope", "su")
ALIASES = {"su": "longrope"}


def default_inv_freq(dims: int, base: float) -> mx.array:
    return 1.0 / (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))


def llama3_inv_freq(dims: int, base: float, scaling: dict[str, Any]) -> mx.array:
    inv_freq = default_inv_freq(dims, base)
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings") or 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = mx.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = mx.logical_and(wavelen >= high_freq_wavelen, wavelen <= low_freq_wavelen)
    return mx.where(is_medium, smoothed, scaled)


def _context_factor(scaling: dict[str, Any]) -> float:
    """`factor`, or (Phi-3 style) max_position_embeddings / original_max_position_embeddings."""
    if scaling.get("factor") is not None:
        return float(scaling["factor"])
    if scaling.get("max_position_embeddings") is None:
        raise UnsupportedModelError(f"rope scaling '{scaling['rope_type']}' needs 'factor' or max_position_embeddings")
    return scaling["max_position_embeddings"] / scaling["original_max_position_embeddings"]


def yarn_parameters(dims: int, base: float, scaling: dict[str, Any]) -> tuple[mx.array, float]:
    """YaRN (transformers' _compute_yarn_parameters): ramp between interpolated and original frequencies."""
    factor = _context_factor(scaling)
    original = scaling["original_max_position_embeddings"]

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dims * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def longrope_parameters(dims: int, base: float, scaling: dict[str, Any], long: bool) -> tuple[mx.array, float]:
    """LongRoPE (transformers' _compute_longrope_parameters): per-dimension rescaled frequencies."""
    original = scaling["original_max_position_embeddings"]
    factor = _context_factor(scaling)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = scaling["long_factor" if long else "short_factor"]
    if len(ext) != dims // 2:
        raise UnsupportedModelError(f"longrope factors have length {len(ext)}, expected {dims // 2} (rotary dims / 2)")
    inv_freq = 1.0 / (mx.array(ext, dtype=mx.float32) * base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
    return inv_freq, float(attention_factor)


def rope_frequencies(
    dims: int, base: float, scaling: dict | None, seq_len: int | None = None
) -> tuple[mx.array, float]:
    """(inv_freq, attention_factor) as transformers' ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=seq_len).

    `scaling` is the output of `standardize_scaling`; None means the default RoPE.
    """
    kind = "default" if scaling is None else scaling["rope_type"]
    if kind == "default":
        return default_inv_freq(dims, base), 1.0
    if kind == "linear":
        return default_inv_freq(dims, base) / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return llama3_inv_freq(dims, base, scaling), 1.0
    if kind == "yarn":
        return yarn_parameters(dims, base, scaling)
    if kind == "longrope":
        long = bool(seq_len) and seq_len > scaling["original_max_position_embeddings"]
        return longrope_parameters(dims, base, scaling, long)
    raise UnsupportedModelError(f"rope scaling type '{kind}' is not supported (supported: {', '.join(SUPPORTED)})")


class RoPE(nn.Module):
    def __init__(
        self,
        dims: int,
        base: float,
        traditional: bool = False,
        scale: float = 1.0,
        inv_freq: mx.array | None = None,
        mscale: float = 1.0,
    ):
        super().__init__()
        self.dims = dims
        self.base = None if inv_freq is not None else base
        self.traditional = traditional
        self.scale = scale
        self.mscale = mscale  # transformers' attention_factor: multiplies cos and sin
        # Stored under a private name so it is not mistaken for a checkpoint parameter.
        self._periods = None if inv_freq is None else 1.0 / inv_freq

    def _rotate(self, x: mx.array, offset, periods: mx.array | None) -> mx.array:
        """The rotation proper (a backend may compute it otherwise with the same bits: backends/cpu_rope.py)."""
        base = self.base if periods is None else None
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=base, scale=self.scale, offset=offset, freqs=periods
        )

    def _rope(self, x: mx.array, offset, periods: mx.array | None) -> mx.array:
        out = self._rotate(x, offset, periods)
        if self.mscale == 1.0:
            return out
        if self.dims == x.shape[-1]:
            return out * self.mscale
        return mx.concatenate([out[..., : self.dims] * self.mscale, out[..., self.dims :]], axis=-1)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return self._rope(x, offset, self._periods)


class LongRoPE(RoPE):
    """Short factors while every position is within original_max_position_embeddings, long ones after."""

    def __init__(self, dims: int, base: float, traditional: bool, scaling: dict[str, Any]):
        short, mscale = longrope_parameters(dims, base, scaling, long=False)
        long, _ = longrope_parameters(dims, base, scaling, long=True)
        super().__init__(dims, base, traditional, inv_freq=short, mscale=mscale)
        self._long_periods = 1.0 / long
        self.original_max_position_embeddings = int(scaling["original_max_position_embeddings"])

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        end = offset + x.shape[-2]  # transformers: max(position_ids) + 1
        if isinstance(end, int):
            long = end > self.original_max_position_embeddings
            return self._rope(x, offset, self._long_periods if long else self._periods)
        long = end > self.original_max_position_embeddings
        if long.ndim == 1:
            long = long.reshape(-1, *([1] * (x.ndim - 1)))
        return mx.where(long, self._rope(x, offset, self._long_periods), self._rope(x, offset, self._periods))


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


def standardize_scaling(
    scaling: dict | None,
    max_position_embeddings: int | None = None,
    original_max_position_embeddings: int | None = None,
) -> dict | None:
    """Resolve aliases and fill the context lengths the way transformers' standardize_rope_params does.

    A top-level `original_max_position_embeddings` (Phi-3 writes one) wins over the one in the dict; else
    the dict's, else max_position_embeddings. llama3 keeps its historical 8192 fallback when neither is known.
    """
    if scaling is None:
        return None
    kind = ALIASES.get(scaling["rope_type"], scaling["rope_type"])
    out = {**scaling, "rope_type": kind}
    if max_position_embeddings is not None:
        out["max_position_embeddings"] = max_position_embeddings
    if kind in ("llama3", "yarn", "longrope"):
        original = (
            original_max_position_embeddings or out.get("original_max_position_embeddings") or max_position_embeddings
        )
        if original is None and kind != "llama3":
            raise UnsupportedModelError(f"rope scaling '{kind}' needs original_max_position_embeddings")
        out["original_max_position_embeddings"] = original
    return out


def initialize_rope(
    dims: int,
    base: float,
    traditional: bool,
    scaling: dict | None,
    max_position_embeddings: int | None = None,
    original_max_position_embeddings: int | None = None,
) -> RoPE:
    """`dims` is the rotary dimension (head_dim * partial_rotary_factor)."""
    scaling = standardize_scaling(scaling, max_position_embeddings, original_max_position_embeddings)
    if scaling is None:
        return RoPE(dims, base, traditional)
    kind = scaling["rope_type"]
    if kind == "linear":
        return RoPE(dims, base, traditional, scale=1.0 / float(scaling["factor"]))
    if kind == "longrope":
        return LongRoPE(dims, base, traditional, scaling)
    inv_freq, mscale = rope_frequencies(dims, base, scaling)
    return RoPE(dims, base, traditional, inv_freq=inv_freq, mscale=mscale)
