"""Decode GEMVs of 4-bit layers on the CUDA kernel (kernels/qmv.py): a class swap on a built model.

    maybe_use_fast_quantized_linear(model)   # load_model / build_random_model call this once the model is built

Plain ``nn.QuantizedLinear`` layers (exact type: tensor-parallel subclasses such as RowParallelQuantizedLinear
keep their own __call__) that the kernel can run (4-bit affine, group size 32/64/128, K a multiple of 32) and that
are big enough to gain (N x K >= MIN_WEIGHT) become `FastQuantizedLinear`, and such plain ``nn.QuantizedEmbedding``
layers `FastQuantizedEmbedding` (whose ``as_linear`` is the tied LM head). Only the class changes, as
distributed/shard.py does: parameters, names and isinstance checks stay those of MLX's classes. An input of at most
LAYER_MAX_ROWS rows (decode) runs the kernel on the CUDA device, a decode batch of more rows of 16-bit x
kernels/qmm.py, a prompt of PROMPT_MIN_ROWS rows or more a 16-bit GEMM of the dequantized weight
(`prompt_product`); anything else is MLX's own call, unchanged.

Gate (`enabled`): wherever MLX runs on CUDA with the kernel available. The kernel passes its accuracy tests on the
H200; with it, compiled decode steps and fused projections, batch-1 decode of the 8B 4-bit shape runs at 1.25x
mlx-lm (benchmarks/RESULTS.md).

16-bit layers the same way on kernels/hmv.py (`FastLinear`, `FastEmbedding`; on models up to hmv.DEFAULT_MAX_HIDDEN
wide, `hmv.enabled`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import hmv, qembedding, qmm, qmv

# Rows of x up to which a 4-bit layer call uses the kernel. On the H200 (benchmarks/qmm_batch.py) the kernel beats
# MLX's quantized_matmul on Llama-3-8B's projections at every M up to 8 but gate/up at 8 (level, 65-70 us): q/o 26 vs
# 64 us, k/v 11 vs 66, down 73 vs 195; an 8B 4-bit batch of 8 decodes at 887 tok/s with 8 rows, 265 with 2.
LAYER_MAX_ROWS = qmv.MAX_ROWS
# Rows of a decode batch ([B, 1, K]) up to which it takes the matvec kernel; from one more it takes the tensor-core
# batch kernel (kernels/qmm.py), whose dequantization work does not grow with the rows: on an 8B 4-bit model it
# decodes batches of 6 and 8 faster than the matvec kernel and batches of 5 slower (benchmarks/RESULTS.md, "Issue 42
# experiments").
DECODE_MATVEC_ROWS = 5
# The same for the 16-bit kernel, by the model's width (half_rows): on the H200 (benchmarks/RESULTS.md) 8 rows against
# 2 decode a Llama-3.2-1B bf16 batch of 8 (2048 wide) at 3119 vs 1685 tok/s, and a Llama-3-8B bf16 one (4096 wide) at
# 717 vs 1108 (b=32: 2628 vs 3111): at 8B the GPU, not the host, bounds the step and MLX's GEMM reads 8 rows' weights
# better than this kernel.
HALF_ROWS_MAX_HIDDEN = 2048  # models up to this wide: hmv.MAX_ROWS rows a launch; wider ones: 2
# Smallest weight (N x K values) swapped: at 1024 x 4096 (Llama-3-8B's k/v) the kernel is no faster than MLX (6.1 vs
# 6.2 us) and every call costs more host time than MLX's.
MIN_WEIGHT = 1 << 23


def enabled() -> bool:
    """Whether loaded models get the fast layers: MLX on CUDA with the kernel available."""
    return qmv.cuda_kernel_available()


def kernel_takes(layer: nn.Module) -> bool:
    """The 4-bit layer's own operands suit kernels/qmv.py (also what a fused projection of such layers asks)."""
    weight, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    if getattr(layer, "mode", "affine") != "affine" or biases is None or weight.ndim != 2:
        return False
    k = weight.shape[1] * 32 // layer.bits
    return qmv.shape_supported(
        (1, k),
        mx.float32,
        weight.shape,
        weight.dtype,
        scales.shape,
        scales.dtype,
        biases.shape,
        biases.dtype,
        layer.group_size,
        layer.bits,
    )


def _layer_supported(layer: nn.Module) -> bool:
    """The kernel takes the layer and it is big enough to gain (checked once, at the swap)."""
    weight = layer["weight"]
    return kernel_takes(layer) and weight.shape[0] * weight.shape[1] * 32 // layer.bits >= MIN_WEIGHT


def _kernel_matvec(layer: nn.Module, x: mx.array, mode: str = "plain", extra: tuple = ()) -> mx.array | None:
    """x @ layer's 4-bit weight on the kernel, or None when this call is not for it (too many rows, no CUDA)."""
    w, scales = layer["weight"], layer["scales"]
    args = qmv.launch_args(x.shape, x.dtype, scales.dtype, w.shape[0], layer.group_size, None, matvec_rows(x), mode)
    if args is None or not qmv.kernel_ready():
        return None
    return qmv.launch(args, x, w, scales, layer["biases"], mode, extra)


# A decode batch of more rows than the kernel takes runs kernels/qmm.py: the tensor cores, qmm.MAX_ROWS rows a
# launch. On CUDA, MLX 0.32's quantized_matmul runs a decode batch's x [B, 1, K] as B matvecs that each read the whole
# weight: an 8B 4-bit batch of 32 decodes at 300 tok/s on MLX's, 1094 on qmm.py (benchmarks/RESULTS.md). Per
# gate_proj call at B = 32 (benchmarks/qmm_batch.py): 859 us as [32, 1, K] on MLX's, 211 us on qmm.py.


def decode_rows(x: mx.array) -> bool:
    """x is a decode batch as the engine holds it: [B, 1, K], B > 1 (a prompt's rows go in as they come)."""
    return x.ndim == 3 and x.shape[0] > 1 and x.shape[1] == 1


def matvec_rows(x: mx.array) -> int:
    """Rows of x up to which a 4-bit call takes the matvec kernel (kernels/qmv.py): DECODE_MATVEC_ROWS for a 16-bit
    decode batch (`decode_rows`; more go to the batch kernel, kernels/qmm.py), LAYER_MAX_ROWS for a short prompt's
    rows and for float32 x, which the batch kernel does not take."""
    return DECODE_MATVEC_ROWS if decode_rows(x) and x.dtype in qmm.X_TYPES else LAYER_MAX_ROWS


def batch_product(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int) -> mx.array | None:
    """x @ dequantize(w).T for a decode batch of more than `matvec_rows(x)` rows on kernels/qmm.py, or None where it
    does not take this call (a prompt's rows, no CUDA, other types)."""
    if not decode_rows(x) or x.shape[0] <= matvec_rows(x):
        return None
    step = qmm.MAX_ROWS
    first_shape = (min(x.shape[0], step), *x.shape[1:])  # (no slice op just to ask)
    if (
        not qmv.kernel_ready()
        or qmm.launch_args(first_shape, x.dtype, scales.dtype, w.shape[0], x.shape[-1], group_size) is None
    ):
        return None
    # x itself when one launch takes it: a slice is one more op in every layer of a decode step's graph
    rows = [x] if x.shape[0] <= step else [x[i : i + step] for i in range(0, x.shape[0], step)]
    parts = [qmm.quantized_matmul(r, w, scales, biases, group_size) for r in rows]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


# A prompt's rows (prefill) multiply a 4-bit layer's weight dequantized to x's 16-bit dtype, then MLX's matmul
# (cuBLAS, tensor cores), once a call has PROMPT_MIN_ROWS rows or more: the dequantization reads the 4-bit weight and
# writes a 16-bit copy that the GEMM reads back, which costs less than MLX 0.32's quantized_matmul computing the
# prompt's product on its own (benchmarks/prefill_products.py; benchmarks/RESULTS.md). The values are MLX's
# dequantized weights, the same for both; each output differs from quantized_matmul's by the order of the float32
# sums only. The copy lives for one product (a gate/up weight of the 8B shape: 117 MB in bf16).
PROMPT_MIN_ROWS = 128


def prompt_rows(x: mx.array, scales: mx.array) -> bool:
    """x is a prompt's rows the 16-bit GEMM takes: PROMPT_MIN_ROWS or more, 16-bit as the scales, on the GPU."""
    return (
        qmv.rows_of(x.shape) >= PROMPT_MIN_ROWS
        and x.dtype in (mx.bfloat16, mx.float16)
        and scales.dtype == x.dtype
        and qmv.kernel_ready()
    )


def prompt_product(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int):
    """x @ dequantize(w).T as a 16-bit GEMM where `prompt_rows`, else None."""
    if not prompt_rows(x, scales):
        return None
    return x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, dtype=x.dtype).T


class _DecodeKernelLayer:
    """A linear layer's `__call__` and `add_to` whose decode calls run a kernel (`_matvec`, None where it does not
    run that call: then the MLX class's own call). `fuses_residual` (set by kernels/fused_projections.py on o_proj
    and down_proj): add_to runs the kernel's residual mode."""

    fuses_residual = False

    def _matvec(self, x: mx.array, mode: str = "plain", extra: tuple = ()) -> mx.array | None:
        raise NotImplementedError

    def _product_dtype(self, x: mx.array):
        raise NotImplementedError

    def _mlx_call(self, x: mx.array) -> mx.array:
        """The MLX class's own call (where the kernel does not run this one)."""
        return super().__call__(x)

    def __call__(self, x: mx.array) -> mx.array:
        y = self._matvec(x)
        if y is None:
            return self._mlx_call(x)
        return y + self["bias"] if "bias" in self else y

    def add_to(self, x: mx.array, residual: mx.array) -> mx.array:
        """residual + self(x) (models.transformer.add_projection): a decode call is one launch of the kernel's
        residual mode, the same values as the separate matvec and add."""
        out_shape = (*x.shape[:-1], self["weight"].shape[0])
        if (
            self.fuses_residual
            and "bias" not in self
            and residual.shape == out_shape
            and residual.dtype == self._product_dtype(x)
        ):
            y = self._matvec(x, "residual", (residual,))
            if y is not None:
                return y
        return residual + self(x)


class FastQuantizedLinear(_DecodeKernelLayer, nn.QuantizedLinear):
    """nn.QuantizedLinear whose decode calls (<= matvec_rows(x) rows of x) run the 4-bit CUDA matvec kernel; larger
    decode batches run kernels/qmm.py (`batch_product`), a prompt's rows a 16-bit GEMM (`prompt_product`)."""

    def _matvec(self, x: mx.array, mode: str = "plain", extra: tuple = ()) -> mx.array | None:
        y = _kernel_matvec(self, x, mode, extra)
        if y is None and mode == "plain":
            return batch_product(x, self["weight"], self["scales"], self["biases"], self.group_size)
        return y

    def _product_dtype(self, x: mx.array):
        return mx.result_type(x, self["scales"])

    def _mlx_call(self, x: mx.array) -> mx.array:
        y = prompt_product(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
        if y is None:
            return super()._mlx_call(x)
        return y + self["bias"] if "bias" in self else y


class FastQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose decode lookups (a few ids) are one launch of kernels/qembedding.py and whose
    `as_linear` (a tied LM head) runs the kernel for decode."""

    def __call__(self, ids: mx.array) -> mx.array:
        if qembedding.kernel_runs(ids, self):
            return qembedding.quantized_embedding(ids, self["weight"], self["scales"], self["biases"], self.group_size)
        return super().__call__(ids)

    def as_linear(self, x: mx.array) -> mx.array:
        y = _kernel_matvec(self, x)
        if y is None:
            y = batch_product(x, self["weight"], self["scales"], self["biases"], self.group_size)
        return super().as_linear(x) if y is None else y


def half_rows(hidden_size: int | None) -> int:
    """Rows of x up to which a 16-bit model `hidden_size` wide calls kernels/hmv.py (see HALF_ROWS_MAX_HIDDEN)."""
    return hmv.MAX_ROWS if hidden_size is not None and hidden_size <= HALF_ROWS_MAX_HIDDEN else 2


def _half_matvec(layer: nn.Module, x: mx.array, mode: str = "plain", extra: tuple = ()) -> mx.array | None:
    """x @ layer's 16-bit weight on kernels/hmv.py, or None when this call is not for it."""
    w = layer["weight"]
    args = hmv.launch_args(x.shape, x.dtype, w.dtype, w.shape[0], None, layer.kernel_rows, mode)
    if args is None or not qmv.kernel_ready():
        return None
    return hmv.launch(args, x, w, mode, extra)


class FastLinear(_DecodeKernelLayer, nn.Linear):
    """nn.Linear (bf16/fp16) whose decode calls run kernels/hmv.py (hmv.enabled)."""

    kernel_rows = 2  # use_fast_half_linear sets the model's (half_rows)

    def _matvec(self, x: mx.array, mode: str = "plain", extra: tuple = ()) -> mx.array | None:
        return _half_matvec(self, x, mode, extra)

    def _product_dtype(self, x: mx.array):
        return mx.result_type(x, self["weight"])


class FastEmbedding(nn.Embedding):
    """nn.Embedding (bf16/fp16) whose decode lookups are one launch of kernels/qembedding.py's 16-bit copy (one a CUDA
    graph can replay) and whose `as_linear` (a tied LM head) runs kernels/hmv.py for decode."""

    kernel_rows = 2  # as FastLinear's

    def __call__(self, ids: mx.array) -> mx.array:
        if qembedding.half_kernel_runs(ids, self):
            return qembedding.embedding(ids, self["weight"])
        return super().__call__(ids)

    def as_linear(self, x: mx.array) -> mx.array:
        y = _half_matvec(self, x)
        return super().as_linear(x) if y is None else y


_SWAPS = {nn.QuantizedLinear: FastQuantizedLinear, nn.QuantizedEmbedding: FastQuantizedEmbedding}
_HALF_SWAPS = {nn.Linear: FastLinear, nn.Embedding: FastEmbedding}
_RESTORES = {fast: plain for plain, fast in (*_SWAPS.items(), *_HALF_SWAPS.items())}


def use_fast_quantized_linear(model: nn.Module) -> int:
    """Swap every plain nn.QuantizedLinear / nn.QuantizedEmbedding the kernel supports; return how many.

    Unconditional (no backend or env check): on a backend without the kernel the fast layers compute exactly
    what MLX's do, through mx.quantized_matmul."""
    from mlxcel_core.engine.compiled_decode import forget_traces

    forget_traces(model)  # compiled steps traced before the swap ran MLX's layers
    swapped = 0
    for _, module in model.named_modules():
        fast = _SWAPS.get(type(module))
        if fast is not None and _layer_supported(module):
            module.__class__ = fast
            swapped += 1
    return swapped


def restore_quantized_linear(model: nn.Module) -> int:
    """Undo `use_fast_quantized_linear` and `use_fast_half_linear`: the fast layers become MLX's classes again;
    return how many."""
    from mlxcel_core.engine.compiled_decode import forget_traces

    forget_traces(model)
    restored = 0
    for _, module in model.named_modules():
        plain = _RESTORES.get(type(module))
        if plain is not None:
            module.__class__ = plain
            restored += 1
    return restored


def half_kernel_takes(layer: nn.Module) -> bool:
    """The 16-bit layer's weight suits kernels/hmv.py (also what a fused projection of such layers asks)."""
    w = layer["weight"]
    return w.ndim == 2 and hmv.shape_supported((1, w.shape[1]), w.dtype, w.shape, w.dtype)


def use_fast_half_linear(model: nn.Module) -> int:
    """Swap every plain bf16/fp16 nn.Linear / nn.Embedding kernels/hmv.py supports, each taking up to the model
    width's `half_rows`; return how many (unconditional, as use_fast_quantized_linear)."""
    from mlxcel_core.engine.compiled_decode import forget_traces

    forget_traces(model)
    rows = half_rows(embedding_width(model))
    swapped = 0
    for _, module in model.named_modules():
        fast = _HALF_SWAPS.get(type(module))
        if fast is not None and half_kernel_takes(module):
            module.__class__ = fast
            module.kernel_rows = rows
            swapped += 1
    return swapped


def embedding_width(model: nn.Module) -> int | None:
    """The hidden size of a model with a 16-bit token embedding (the largest-vocabulary one: a vision tower's position
    embedding is not it), else None; what hmv.enabled's default asks."""
    tables = [
        module.weight.shape for _, module in model.named_modules() if type(module) in (nn.Embedding, FastEmbedding)
    ]
    return max(tables)[1] if tables else None


def maybe_use_fast_quantized_linear(model: nn.Module) -> int:
    """`use_fast_quantized_linear` when `enabled()` (MLX on CUDA), and `use_fast_half_linear` when `hmv.enabled` for
    the model's width; return how many layers were swapped."""
    swapped = use_fast_quantized_linear(model) if enabled() else 0
    return swapped + (use_fast_half_linear(model) if hmv.enabled(embedding_width(model)) else 0)
