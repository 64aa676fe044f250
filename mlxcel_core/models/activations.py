"""Fused element-wise ops shared by every family, compiled once (shapeless) and reused for any shape.

`mx.compile(..., shapeless=True)` traces each function once per input dtype/rank and fuses the
element-wise graph into one kernel, so a gated MLP costs one pass over the intermediate activations
instead of three or four. Python float constants inside the traced functions are fixed constants;
the soft-capping value varies per model, so it is passed as an array scalar (an input of the
compiled graph) rather than baked in as a constant.
"""

from __future__ import annotations

import math

import mlx.core as mx

_GELU_C = math.sqrt(2.0 / math.pi)


def swiglu_eager(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up, as transformers' SiLU-gated MLP (Llama, Mistral, Qwen...)."""
    return gate * mx.sigmoid(gate) * up


def geglu_eager(gate: mx.array, up: mx.array) -> mx.array:
    """gelu_tanh(gate) * up: the tanh-approximated GELU of transformers' `gelu_pytorch_tanh` (Gemma)."""
    return 0.5 * gate * (1.0 + mx.tanh(_GELU_C * (gate + 0.044715 * gate * gate * gate))) * up


def softcap_eager(x: mx.array, cap: mx.array | float) -> mx.array:
    """tanh(x / cap) * cap: Gemma 2's attention and final-logit soft-capping."""
    return mx.tanh(x / cap) * cap


swiglu = mx.compile(swiglu_eager, shapeless=True)
geglu = mx.compile(geglu_eager, shapeless=True)
_softcap = mx.compile(softcap_eager, shapeless=True)
_caps: dict[tuple[float, mx.Dtype], mx.array] = {}


def softcap(x: mx.array, cap: float) -> mx.array:
    """Compiled soft-capping; `cap` becomes a scalar input in x's dtype, so one graph serves every cap."""
    key = (float(cap), x.dtype)
    cap_array = _caps.get(key)
    if cap_array is None:
        cap_array = _caps[key] = mx.array(float(cap), dtype=x.dtype)
    return _softcap(x, cap_array)
