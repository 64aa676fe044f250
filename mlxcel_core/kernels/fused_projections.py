"""Decode projections of one input as one matmul: an attention block's q/k/v, a gated MLP's gate/up.

    fuse_projections(model)   # prepare_model (load_model, build_random_model) calls it when fusion_enabled()

At decode (a few rows of x) each projection is a matrix-vector product, and on a GPU a small one costs mostly its
launch and the tail of a short kernel: fused, a Llama layer makes 2 matmul launches instead of 5 (MLX's k/v GEMVs
on the 8B shape read at 381 GB/s, a third of what the larger ones reach). The layers' weights (and scales, biases)
are concatenated along the output rows once; each layer then keeps a row-range view of the fused array, so memory,
parameter names and every other path (prefill, batches of more than FUSED_MAX_ROWS rows) are unchanged.

Inputs of at most FUSED_MAX_ROWS rows take the fused path:
  - 4-bit layers where the CUDA matvec kernel runs (kernels/fast_linear.py's gate, MLXCEL_QMV): one launch of
    kernels/qmv.py in mode "qkv" (writes q, k and v) or "swiglu" (writes silu(gate) * up);
  - otherwise one matmul (mx.quantized_matmul for quantized layers) and a split, then the activation.

The output projections (o_proj, down_proj) that run the 4-bit kernel also take the residual add of their block
into the same launch (FastQuantizedLinear.fuses_residual, the kernel's "residual" mode): two launches fewer per layer.
Such a projection runs the kernel even below fast_linear.MIN_WEIGHT, where the kernel's read alone would not gain.

Where those launches run (the kernels are CUDA-only), each block's pre-norm (an RMSNorm) is also taken into the "qkv"
and "swiglu" launches (modes "qkv_norm", "swiglu_norm"; MLXCEL_FUSE_NORM=0 turns it off): two launches fewer per
layer; and q and k are rotated in the q/k/v launch (modes "qkv_rope", "qkv_norm_rope"; Attention._project_roped;
MLXCEL_FUSE_ROPE=0 turns it off): two more. On by default since the ninth session's H200 runs: 438 -> 380 ops and
7% less host time a 1B step, and a higher ratio to mlx-lm in every paired run (benchmarks/RESULTS.md).

Gate (fusion_enabled): MLXCEL_FUSE=1 / 0 forces it; unset, on only where MLX runs on a GPU (on the CPU a
matmul's launch costs nothing worth saving, and concatenating costs a copy of those weights at load).
"""

from __future__ import annotations

import os
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..models.activations import swiglu
from ..models.base import normed
from ..models.transformer import heads_first
from . import fast_linear, hmv, qmv

ENV = "MLXCEL_FUSE"
NORM_ENV = "MLXCEL_FUSE_NORM"
ROPE_ENV = "MLXCEL_FUSE_ROPE"
FUSED_MAX_ROWS = qmv.MAX_ROWS  # rows of x up to which the fused path is taken (decode batches)
_PARAMS = ("weight", "scales", "biases", "bias")
_QUANTIZED = (nn.QuantizedLinear, fast_linear.FastQuantizedLinear)
_PLAIN = (nn.Linear, fast_linear.FastLinear)


def fusion_enabled() -> bool:
    env = os.environ.get(ENV, "").strip()
    if env in ("0", "1"):
        return env == "1"
    return mx.default_device().type == mx.DeviceType.gpu


def _on_unless_zero(env: str) -> bool:
    return os.environ.get(env, "").strip() != "0"


def norm_fusion_enabled() -> bool:
    """Whether fused projections on a kernel take their block's RMSNorm into the launch (on unless
    MLXCEL_FUSE_NORM=0)."""
    return _on_unless_zero(NORM_ENV)


def rope_fusion_enabled() -> bool:
    """Whether fused q/k/v projections on a kernel apply the RoPE to q and k in the launch (on unless
    MLXCEL_FUSE_ROPE=0)."""
    return _on_unless_zero(ROPE_ENV)


def _fusable(layers: list[nn.Module]) -> bool:
    """Same class (plain Linear, or affine QuantizedLinear with the same bits and groups), input size, dtypes and
    bias; tensor-parallel subclasses keep their own calls."""
    first = layers[0]
    kinds = set(_PLAIN) if type(first) in _PLAIN else set(_QUANTIZED)
    if not all(type(layer) in kinds for layer in layers):
        return False
    if isinstance(first, nn.QuantizedLinear):
        same = {(layer.bits, layer.group_size, getattr(layer, "mode", "affine"), "biases" in layer) for layer in layers}
        if len(same) != 1 or getattr(first, "mode", "affine") != "affine" or "biases" not in first:
            return False
    for name in _PARAMS:
        present = {name in layer for layer in layers}
        if len(present) != 1:
            return False
        if name in first and len({(layer[name].dtype, layer[name].shape[1:]) for layer in layers}) != 1:
            return False
    return True


class FusedProjection:
    """Several projections of the same input, their parameters row ranges of one array each.

    Not an nn.Module: the parameters stay the layers' own (views), so the model's parameter tree is unchanged."""

    def __init__(self, layers: list[nn.Module]):
        widths = [layer["weight"].shape[0] for layer in layers]
        self.bounds = [sum(widths[:i]) for i in range(1, len(widths))]  # mx.split's indices of each output
        self.quantized = isinstance(layers[0], nn.QuantizedLinear)
        self.bits = getattr(layers[0], "bits", None)
        self.group_size = getattr(layers[0], "group_size", None)
        # The qmv kernel's modes serve this projection (decided once, as fast_linear's swap is, at load), where its
        # gate is on and it takes these operands; 16-bit layers: kernels/hmv.py's same modes.
        # (_fusable made the layers alike in everything the kernels check but their rows.)
        first = layers[0]
        self.kernel = self.quantized and fast_linear.enabled() and fast_linear.kernel_takes(first)
        # (16-bit: where the model's layers were swapped, as hmv.enabled decided for the model's width)
        self.half_kernel = type(first) is fast_linear.FastLinear and fast_linear.half_kernel_takes(first)
        self.half_rows = first.kernel_rows if self.half_kernel else None  # (the model's, as its layers keep it)
        self.fold_norm = (self.kernel or self.half_kernel) and norm_fusion_enabled()
        # (NQ, NK) when the layers are q, k, v with equal k and v widths: the kernel's "qkv" mode.
        self.qkv_split = (widths[0], widths[1]) if len(widths) == 3 and widths[1] == widths[2] else None
        # q and k rotated in that launch (no biases: they come before the rotation).
        self.fold_rope = bool((self.kernel or self.half_kernel) and self.qkv_split and "bias" not in first
                              and rope_fusion_enabled())
        self.params = {}
        for name in _PARAMS:
            if name in layers[0]:
                fused = mx.concatenate([layer[name] for layer in layers])
                mx.eval(fused)
                self.params[name] = fused
                start = 0
                for layer, width in zip(layers, widths):
                    layer[name] = fused[start:start + width]  # a view: the layers share the fused memory
                    start += width
                mx.eval([layer[name] for layer in layers])

    def takes(self, x: mx.array) -> bool:
        return qmv.rows_of(x.shape) <= FUSED_MAX_ROWS

    def _kernel_args(self, x: mx.array, mode: str, split=None, eps: float | None = None) -> dict | None:
        """The qmv kernel's launch for x in `mode` (a "_norm" mode: with the norm's `eps`), or None where the kernel
        does not run this call."""
        if not ((self.kernel or self.half_kernel) and qmv.kernel_ready()):
            return None
        p = self.params
        if self.half_kernel:
            return hmv.launch_args(x.shape, x.dtype, p["weight"].dtype, p["weight"].shape[0], None,
                                   fast_linear.half_limit(self.half_rows), mode, split, eps)
        return qmv.launch_args(x.shape, x.dtype, p["scales"].dtype, p["weight"].shape[0], self.group_size, None,
                               fast_linear.LAYER_MAX_ROWS, mode, split, eps)

    def matmul(self, x: mx.array) -> mx.array:
        """x @ the fused weight (+ bias), every layer's output side by side."""
        p = self.params
        if self.quantized:
            y = fast_linear.as_rows(lambda rows: mx.quantized_matmul(
                rows, p["weight"], scales=p["scales"], biases=p["biases"], transpose=True, group_size=self.group_size,
                bits=self.bits), x)
        else:
            y = x @ p["weight"].T
        return y + p["bias"] if "bias" in p else y

    def _norm_inputs(self, norm: nn.Module | None) -> tuple[mx.array, float] | None:
        """(weight, eps) of a norm the kernel can take into its launch (an nn.RMSNorm, unless MLXCEL_FUSE_NORM=0), else
        None. The weight is the launch's input; eps a constant of its compiled kernel."""
        if norm is None or not self.fold_norm or type(norm) is not nn.RMSNorm:
            return None
        return norm.weight, float(norm.eps)

    def _launch(self, x: mx.array, mode: str, norm: nn.Module | None, split=None, rope: tuple = ()):
        """The kernel's `mode` on x (norm(x) with a norm: folded into the launch where it can be; `rope` = (positions,
        inverse frequencies): the "_rope" variant), or None where the kernel does not run this call."""
        folded = self._norm_inputs(norm)
        if folded is not None:
            mode += "_norm"
        if rope:
            mode += "_rope"
        args = self._kernel_args(x, mode, split, folded[1] if folded is not None else None)
        if args is None:
            return None
        p = self.params
        x_in = x if folded is not None else normed(x, norm)
        extra = (*(folded[:1] if folded is not None else ()), *rope)
        if self.half_kernel:
            return hmv.launch(args, x_in, p["weight"], mode, extra)
        return qmv.launch(args, x_in, p["weight"], p["scales"], p["biases"], mode, extra)

    def split_roped(self, x: mx.array, norm: nn.Module | None, positions: mx.array, inv_freq: mx.array,
                    head_dim: int) -> list[mx.array] | None:
        """q, k, v of x [B, L, K] (of norm(x)) with q and k already rotated (non-traditional RoPE: `positions` [B * L],
        float32, times the RoPE's scale; `inv_freq` [head_dim / 2]), in one launch, heads first: [B, heads, L,
        head_dim] (at L = 1 the launch writes that layout). None where that launch cannot run (gate off, no kernel
        for this call): the caller then projects and rotates as usual."""
        if not self.fold_rope:
            return None
        outs = self._launch(x, "qkv", norm, (*self.qkv_split, head_dim), (positions, inv_freq))
        if outs is None or outs[0].ndim == 4:
            return outs
        return [heads_first(t, t.shape[-1] // head_dim) for t in outs]

    def split(self, x: mx.array, norm: nn.Module | None = None) -> list[mx.array]:
        """Each layer's output, in order, of x (of norm(x) when given)."""
        outs = self._launch(x, "qkv", norm, self.qkv_split) if self.qkv_split else None
        if outs is None:
            return mx.split(self.matmul(normed(x, norm)), self.bounds, axis=-1)
        p = self.params
        if "bias" in p:
            outs = [o + b for o, b in zip(outs, mx.split(p["bias"], self.bounds))]
        return outs

    def gated(self, x: mx.array, activation: Callable[[mx.array, mx.array], mx.array],
              norm: nn.Module | None = None) -> mx.array:
        """activation(gate(x), up(x)) for layers [gate, up] (of norm(x) when given): the kernel's swiglu mode where it
        applies."""
        if activation is swiglu and "bias" not in self.params:
            y = self._launch(x, "swiglu", norm)
            if y is not None:
                return y
        gate, up = self.split(x, norm)
        return activation(gate, up)


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v of every attention block and gate/up of every gated MLP that allow it; return how many."""
    from ..engine.compiled_decode import forget_traces
    from ..models.transformer import Attention, GatedMLP

    forget_traces(model)  # compiled steps traced before this computed the separate projections

    fused = 0
    for _, module in model.named_modules():
        out_proj = module.get("o_proj") if isinstance(module, Attention) else (
            module.get("down_proj") if isinstance(module, GatedMLP) else None)
        if type(out_proj) is nn.QuantizedLinear and fast_linear.enabled() and fast_linear.kernel_takes(out_proj):
            # Below fast_linear.MIN_WEIGHT (a 1B model's o_proj) the kernel reads no faster than MLX, but with the
            # residual add taken in it is one launch instead of two (32 fewer a 1B 4-bit token).
            out_proj.__class__ = fast_linear.FastQuantizedLinear
        if isinstance(out_proj, (fast_linear.FastQuantizedLinear, fast_linear.FastLinear)):
            out_proj.fuses_residual = True
        if isinstance(module, Attention) and module.fused_qkv is None and "q_proj" in module:
            layers = [module.q_proj, module.k_proj, module.v_proj]
            if _fusable(layers):
                module.fused_qkv = FusedProjection(layers)
                fused += 1
        elif isinstance(module, GatedMLP) and module.fused_gate_up is None:
            layers = [module.gate_proj, module.up_proj]
            if _fusable(layers):
                module.fused_gate_up = FusedProjection(layers)
                fused += 1
    return fused


def unfuse_projections(model: nn.Module) -> int:
    """Back to one matmul per layer (the layers keep their views: same values); return how many were fused."""
    from ..engine.compiled_decode import forget_traces
    from ..models.transformer import Attention, GatedMLP

    forget_traces(model)
    count = 0
    for _, module in model.named_modules():
        if isinstance(module, (fast_linear.FastQuantizedLinear, fast_linear.FastLinear)):
            module.fuses_residual = False
        if isinstance(module, Attention) and module.fused_qkv is not None:
            module.fused_qkv, count = None, count + 1
        elif isinstance(module, GatedMLP) and module.fused_gate_up is not None:
            module.fused_gate_up, count = None, count + 1
    return count


def maybe_fuse_projections(model: nn.Module) -> int:
    return fuse_projections(model) if fusion_enabled() else 0
