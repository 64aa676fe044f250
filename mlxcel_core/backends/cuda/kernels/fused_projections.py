"""Decode projections of one input as one matmul: an attention block's q/k/v, a gated MLP's gate/up.

    fuse_projections(model)     # the CUDA backend's prepare step; unfuse_projections(model) undoes it

At decode (a few rows of x) each projection is a matrix-vector product, and on a GPU a small one costs mostly its
launch and the tail of a short kernel: fused, a Llama layer makes 2 matmul launches instead of 5 (MLX's k/v GEMVs
on the 8B shape read at 381 GB/s, a third of what the larger ones reach). The layers' weights (and scales, biases)
are concatenated along the output rows once; each layer then keeps a row-range view of the fused array, so memory,
parameter names and every other path (a 16-bit model's prefill, 16-bit batches of more than FUSED_MAX_ROWS rows)
are unchanged.

The models stay as models/ describes them: each fused block's class is swapped, in place, to a subclass of its own
class (made once per class: `FusedAttention` from Attention and FusedAttentionMixin, `FusedGatedMLP` from GatedMLP
and FusedGatedMLPMixin) that holds the FusedProjection (`fused_qkv`, `fused_gate_up`) and overrides the block's
override points (Attention.project and project_rotated, GatedMLP.project_gated); unfuse_projections swaps the
original class back.

Inputs of at most FUSED_MAX_ROWS rows take the fused path:
  - layers where the CUDA matvec kernel runs (fast_linear.py's gate; 4-bit: qmv.py, 16-bit: hmv.py): one launch in
    mode "qkv" (writes q, k and v) or "swiglu" (writes silu(gate) * up);
  - otherwise one matmul (mx.quantized_matmul for quantized layers) and a split, then the activation.

The output projections (o_proj, down_proj) that run the 4-bit kernel also take the residual add of their block
into the same launch (FastQuantizedLinear.fuses_residual, the kernel's "residual" mode): two launches fewer per layer.
Such a projection runs the kernel even below fast_linear.MIN_WEIGHT, where the kernel's read alone would not gain.

Where those launches run (the kernels are CUDA-only), each block's pre-norm (an nn.RMSNorm) is also taken into the
"qkv" and "swiglu" launches (modes "qkv_norm", "swiglu_norm"): two launches fewer per layer; and q and k are rotated
in the q/k/v launch (modes "qkv_rope", "qkv_norm_rope"; rope_fold.py makes the frequencies and positions): two
more. On the H200 a 1B step makes 438 -> 380 ops and takes 7% less host time with both (benchmarks/RESULTS.md).
Elsewhere (no kernel for the call) the fused projections are the matmul and split above, bit for bit the separate
layers' results.

A 4-bit model's decode batch of more rows than the matvec kernel takes (fast_linear.matvec_rows: 6 or more of 16-bit
x) takes the fused projections too, their matmul on kernels/qmm.py (fast_linear.batch_product): q/k/v one launch
instead of three and gate/up one instead of two, each reading one fused weight. The norm and the RoPE stay their own
ops there (qmm.py has no such modes); the values are the separate launches' up to the order of the float32 sums
(another split of K). So does a prompt's rows (fast_linear.prompt_rows): one 16-bit GEMM of the fused weight,
dequantized (fast_linear.prompt_product).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from mlxcel_core.models.activations import swiglu
from mlxcel_core.models.base import normed
from mlxcel_core.models.transformer import Attention, GatedMLP, heads_first

from . import fast_linear, hmv, qmv
from .rope_fold import fold_frequencies, fold_positions

FUSED_MAX_ROWS = qmv.MAX_ROWS  # rows of x up to which the fused path is taken (decode batches)
_PARAMS = ("weight", "scales", "biases", "bias")
_QUANTIZED = (nn.QuantizedLinear, fast_linear.FastQuantizedLinear)
_PLAIN = (nn.Linear, fast_linear.FastLinear)


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
        # gate is on and it takes these operands; 16-bit layers: hmv.py's same modes.
        # (_fusable made the layers alike in everything the kernels check but their rows.)
        first = layers[0]
        self.kernel = self.quantized and fast_linear.enabled() and fast_linear.kernel_takes(first)
        # (16-bit: where the model's layers were swapped, as hmv.enabled decided for the model's width)
        self.half_kernel = type(first) is fast_linear.FastLinear and fast_linear.half_kernel_takes(first)
        self.half_rows = first.kernel_rows if self.half_kernel else None  # (the model's, as its layers keep it)
        self.fold_norm = self.kernel or self.half_kernel  # the block's RMSNorm taken into the kernel's launch
        # (NQ, NK) when the layers are q, k, v with equal k and v widths: the kernel's "qkv" mode.
        self.qkv_split = (widths[0], widths[1]) if len(widths) == 3 and widths[1] == widths[2] else None
        # q and k rotated in that launch (no biases: they come before the rotation).
        self.fold_rope = bool((self.kernel or self.half_kernel) and self.qkv_split and "bias" not in first)
        self.params = {}
        for name in _PARAMS:
            if name in layers[0]:
                fused = mx.concatenate([layer[name] for layer in layers])
                mx.eval(fused)
                self.params[name] = fused
                start = 0
                for layer, width in zip(layers, widths):
                    layer[name] = fused[start : start + width]  # a view: the layers share the fused memory
                    start += width
                mx.eval([layer[name] for layer in layers])

    def takes(self, x: mx.array) -> bool:
        """Whether x takes the fused path: up to FUSED_MAX_ROWS rows, and where the 4-bit kernels run this projection
        a decode batch of more rows or a prompt's rows (one 16-bit GEMM of the fused weight, fast_linear.prompt_rows).
        """
        if qmv.rows_of(x.shape) <= FUSED_MAX_ROWS:
            return True
        return self.kernel and (fast_linear.decode_rows(x) or fast_linear.prompt_rows(x, self.params["scales"]))

    def _kernel_args(self, x: mx.array, mode: str, split=None, eps: float | None = None) -> dict | None:
        """The qmv kernel's launch for x in `mode` (a "_norm" mode: with the norm's `eps`), or None where the kernel
        does not run this call."""
        if not ((self.kernel or self.half_kernel) and qmv.kernel_ready()):
            return None
        p = self.params
        if self.half_kernel:
            return hmv.launch_args(
                x.shape, x.dtype, p["weight"].dtype, p["weight"].shape[0], None, self.half_rows, mode, split, eps
            )
        return qmv.launch_args(
            x.shape,
            x.dtype,
            p["scales"].dtype,
            p["weight"].shape[0],
            self.group_size,
            None,
            fast_linear.matvec_rows(x),
            mode,
            split,
            eps,
        )

    def matmul(self, x: mx.array) -> mx.array:
        """x @ the fused weight (+ bias), every layer's output side by side."""
        p = self.params
        y = None
        if self.kernel and qmv.rows_of(x.shape) > fast_linear.matvec_rows(x):  # (a decode batch: qmm.py; prompt: GEMM)
            y = fast_linear.batch_product(x, p["weight"], p["scales"], p["biases"], self.group_size)
            if y is None:
                y = fast_linear.prompt_product(x, p["weight"], p["scales"], p["biases"], self.group_size, self.bits)
        if y is None and self.quantized:
            y = mx.quantized_matmul(
                x,
                p["weight"],
                scales=p["scales"],
                biases=p["biases"],
                transpose=True,
                group_size=self.group_size,
                bits=self.bits,
            )
        elif y is None:
            y = x @ p["weight"].T
        return y + p["bias"] if "bias" in p else y

    def _norm_inputs(self, norm: nn.Module | None) -> tuple[mx.array, float] | None:
        """(weight, eps) of a norm the kernel can take into its launch (an nn.RMSNorm, where a kernel runs this
        projection), else None. The weight is the launch's input; eps a constant of its compiled kernel."""
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

    def split_roped(
        self, x: mx.array, norm: nn.Module | None, positions: mx.array, inv_freq: mx.array, head_dim: int
    ) -> list[mx.array] | None:
        """q, k, v of x [B, L, K] (of norm(x)) with q and k already rotated (non-traditional RoPE: `positions` [B * L],
        float32, times the RoPE's scale; `inv_freq` [head_dim / 2]), in one launch, heads first: [B, heads, L,
        head_dim] (at L = 1 the launch writes that layout). None where that launch cannot run (no kernel for this
        projection or this call): the caller then projects and rotates as usual."""
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

    def gated(
        self, x: mx.array, activation: Callable[[mx.array, mx.array], mx.array], norm: nn.Module | None = None
    ) -> mx.array:
        """activation(gate(x), up(x)) for layers [gate, up] (of norm(x) when given): the kernel's swiglu mode where it
        applies."""
        if activation is swiglu and "bias" not in self.params:
            y = self._launch(x, "swiglu", norm)
            if y is not None:
                return y
        gate, up = self.split(x, norm)
        return activation(gate, up)


class FusedAttentionMixin:
    """Attention whose q, k and v of a decode step are one FusedProjection (`fused_qkv`), with the block's norm and
    the RoPE taken into its launch where the kernel runs it. Mixed into the block's own class by fuse_projections."""

    fused_qkv: FusedProjection

    def project(self, x: mx.array, norm: nn.Module | None = None) -> tuple[mx.array, mx.array, mx.array]:
        if self.fused_qkv.takes(x):
            return tuple(self.fused_qkv.split(x, norm))
        return super().project(x, norm)

    def project_rotated(
        self, x: mx.array, norm: nn.Module | None, offset: int | mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        fused = self.fused_qkv
        # (q/k norms come between the projection and the rotation: the launch cannot rotate then; nor where the
        # block's own class overrides project_rotated: it computes more than the projections and the rotation)
        own = type(self)._unfused_class.project_rotated is Attention.project_rotated
        if fused.fold_rope and own and not self.qk_norm and fused.takes(x):
            inv_freq = fold_frequencies(self.rope, self.head_dim)
            if inv_freq is not None:
                B, L, _ = x.shape
                positions = fold_positions(offset, B, L, self.rope.scale)
                roped = fused.split_roped(x, norm, positions, inv_freq, self.head_dim)
                if roped is not None:
                    return tuple(roped)
        return super().project_rotated(x, norm, offset)


class FusedGatedMLPMixin:
    """GatedMLP whose act(gate(x)) * up(x) of a decode step is one FusedProjection (`fused_gate_up`), with the block's
    norm taken into its launch where the kernel runs it. Mixed into the block's own class by fuse_projections."""

    fused_gate_up: FusedProjection

    def project_gated(self, x: mx.array, norm: nn.Module | None = None) -> mx.array:
        if self.fused_gate_up.takes(x):
            return self.fused_gate_up.gated(x, self.activation, norm)
        return super().project_gated(x, norm)


_fused_classes: dict[type, type] = {}  # a block's class -> its fused subclass


def _fused_class(cls: type, mixin: type) -> type:
    """`cls` with `mixin`'s overrides, made once per class; `_unfused_class` names `cls` again."""
    fused = _fused_classes.get(cls)
    if fused is None:
        fused = type(f"Fused{cls.__name__}", (mixin, cls), {"_unfused_class": cls})
        _fused_classes[cls] = fused
    return fused


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v of every attention block and gate/up of every gated MLP that allow it, and mark the output
    projections that take their block's residual add; return how many blocks were fused."""
    from mlxcel_core.engine.compiled_decode import forget_traces

    forget_traces(model)  # compiled steps traced before this computed the separate projections

    fused = 0
    for _, module in model.named_modules():
        out_proj = (
            module.get("o_proj")
            if isinstance(module, Attention)
            else (module.get("down_proj") if isinstance(module, GatedMLP) else None)
        )
        if type(out_proj) is nn.QuantizedLinear and fast_linear.enabled() and fast_linear.kernel_takes(out_proj):
            # Below fast_linear.MIN_WEIGHT (a 1B model's o_proj) the kernel reads no faster than MLX, but with the
            # residual add taken in it is one launch instead of two (32 fewer a 1B 4-bit token).
            out_proj.__class__ = fast_linear.FastQuantizedLinear
        if isinstance(out_proj, (fast_linear.FastQuantizedLinear, fast_linear.FastLinear)):
            out_proj.fuses_residual = True
        if isinstance(module, Attention) and not isinstance(module, FusedAttentionMixin) and "q_proj" in module:
            layers = [module.q_proj, module.k_proj, module.v_proj]
            if _fusable(layers):
                projection = FusedProjection(layers)
                module.__class__ = _fused_class(type(module), FusedAttentionMixin)
                module.fused_qkv = projection
                fused += 1
        elif isinstance(module, GatedMLP) and not isinstance(module, FusedGatedMLPMixin):
            layers = [module.gate_proj, module.up_proj]
            if _fusable(layers):
                projection = FusedProjection(layers)
                module.__class__ = _fused_class(type(module), FusedGatedMLPMixin)
                module.fused_gate_up = projection
                fused += 1
    return fused


def unfuse_projections(model: nn.Module) -> int:
    """Back to one matmul per layer and the blocks' own classes (the layers keep their views: same values); return
    how many blocks were fused."""
    from mlxcel_core.engine.compiled_decode import forget_traces

    forget_traces(model)
    count = 0
    for _, module in model.named_modules():
        if isinstance(module, (fast_linear.FastQuantizedLinear, fast_linear.FastLinear)):
            module.fuses_residual = False
        if isinstance(module, FusedAttentionMixin):
            del module.fused_qkv
        elif isinstance(module, FusedGatedMLPMixin):
            del module.fused_gate_up
        else:
            continue
        module.__class__ = type(module)._unfused_class
        count += 1
    return count
