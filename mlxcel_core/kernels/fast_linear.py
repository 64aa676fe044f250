"""Decode GEMVs of 4-bit layers on the CUDA kernel (kernels/qmv.py): a class swap on a built model.

    maybe_use_fast_quantized_linear(model)   # load_model / build_random_model call this once the model is built

Plain ``nn.QuantizedLinear`` layers (exact type: tensor-parallel subclasses such as RowParallelQuantizedLinear
keep their own __call__) that the kernel can run (4-bit affine, group size 32/64/128, K a multiple of 32) and that
are big enough to gain (N x K >= MIN_WEIGHT) become `FastQuantizedLinear`, and such plain ``nn.QuantizedEmbedding``
layers `FastQuantizedEmbedding` (whose ``as_linear`` is the tied LM head). Only the class changes, as
distributed/shard.py does: parameters, names and isinstance checks stay those of MLX's classes. An input of at most
LAYER_MAX_ROWS rows (decode) runs the kernel on the CUDA device; anything else is MLX's own call, unchanged.

Gate: on only when MLX runs on CUDA and MLXCEL_QMV is not "0" (default "1" since the kernel's accuracy tests passed
on the H200 and, with compiled decode steps and fused projections, batch-1 decode of the 8B 4-bit shape went from
0.92x to 1.25x mlx-lm: benchmarks/RESULTS.md). MLXCEL_QMV=0 restores MLX's quantized_matmul everywhere.

16-bit layers the same way on kernels/hmv.py (`FastLinear`, `FastEmbedding`; MLXCEL_HMV, by default on models up
to hmv.DEFAULT_MAX_HIDDEN wide).
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import mlx.nn as nn

from . import hmv, qembedding, qmm, qmv

ENV = "MLXCEL_QMV"
DEFAULT_QMV = "1"  # on where MLX runs on CUDA


def _env_int(name: str, default: int, low: int, high: int) -> int:
    """The environment's whole number `name`, clamped to low..high; unset: `default`; anything else: reported on
    stderr (one line) and ignored (`default`)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return min(high, max(low, int(value)))
    except ValueError:
        print(f"mlxcel: {name}={value!r} is not a whole number; ignored", file=sys.stderr)
        return default


# Rows of x up to which a 4-bit layer call uses the kernel (MLXCEL_QMV_MAX_ROWS, 1..8; default 8). On the H200
# (fifteenth session, benchmarks/qmm_batch.py) the kernel beat MLX's quantized_matmul on Llama-3-8B's projections at
# every M up to 8 but gate/up at 8 (level, 65-70 us): q/o 26 vs 64 us, k/v 11 vs 66, down 73 vs 195; an 8B 4-bit
# batch of 8 decoded at 887 tok/s, against 265 at the old default of 2.
LAYER_MAX_ROWS = _env_int("MLXCEL_QMV_MAX_ROWS", qmv.MAX_ROWS, 1, qmv.MAX_ROWS)
# The same for the 16-bit kernel: MLXCEL_HMV_MAX_ROWS (1..8) for every model, else by the model's width (half_rows):
# on the H200 (seventeenth session, benchmarks/RESULTS.md) 8 rows against 2 decoded a Llama-3.2-1B bf16 batch of 8
# (2048 wide) at 3119 vs 1685 tok/s, and a Llama-3-8B bf16 one (4096 wide) at 717 vs 1108 (b=32: 2628 vs 3111): at
# 8B the GPU, not the host, bounds the step and MLX's GEMM reads 8 rows' weights better than this kernel.
HALF_MAX_ROWS = _env_int("MLXCEL_HMV_MAX_ROWS", 0, 0, hmv.MAX_ROWS) or None
HALF_ROWS_MAX_HIDDEN = 2048  # models up to this wide: hmv.MAX_ROWS rows a launch; wider ones: 2
# Smallest weight (N x K values) swapped (MLXCEL_QMV_MIN_WEIGHT; default 2^23): at 1024 x 4096 (Llama-3-8B's k/v)
# the kernel was no faster than MLX (6.1 vs 6.2 us) and every call costs more host time than MLX's.
MIN_WEIGHT = _env_int("MLXCEL_QMV_MIN_WEIGHT", 1 << 23, 0, 1 << 40)


def enabled() -> bool:
    """Whether loaded models get the fast layers: MLX on CUDA and MLXCEL_QMV (default DEFAULT_QMV) not "0"."""
    return os.environ.get(ENV, DEFAULT_QMV).strip() != "0" and qmv.cuda_kernel_available()


def kernel_takes(layer: nn.Module) -> bool:
    """The 4-bit layer's own operands suit kernels/qmv.py (also what a fused projection of such layers asks)."""
    weight, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    if getattr(layer, "mode", "affine") != "affine" or biases is None or weight.ndim != 2:
        return False
    k = weight.shape[1] * 32 // layer.bits
    return qmv.shape_supported((1, k), mx.float32, weight.shape, weight.dtype, scales.shape, scales.dtype,
                               biases.shape, biases.dtype, layer.group_size, layer.bits)


def _layer_supported(layer: nn.Module) -> bool:
    """The kernel takes the layer and it is big enough to gain (checked once, at the swap)."""
    weight = layer["weight"]
    return kernel_takes(layer) and weight.shape[0] * weight.shape[1] * 32 // layer.bits >= MIN_WEIGHT


def _kernel_matvec(layer: nn.Module, x: mx.array, mode: str = "plain", extra: tuple = ()) -> mx.array | None:
    """x @ layer's 4-bit weight on the kernel, or None when this call is not for it (too many rows, no CUDA)."""
    w, scales = layer["weight"], layer["scales"]
    args = qmv.launch_args(x.shape, x.dtype, scales.dtype, w.shape[0], layer.group_size, None, LAYER_MAX_ROWS,
                           mode)
    if args is None or not qmv.kernel_ready():
        return None
    return qmv.launch(args, x, w, scales, layer["biases"], mode, extra)


# A decode batch of more rows than the kernel takes (MLXCEL_QMM_BATCH, default "mma"). On CUDA, MLX 0.32's
# quantized_matmul runs a decode batch's x [B, 1, K] as B matvecs that each read the whole weight: an 8B 4-bit batch of
# 32 decoded at 300 tok/s under "mlx", 1094 under "mma" (benchmarks/RESULTS.md, sixteenth session). Per gate_proj call
# at B = 32 (benchmarks/qmm_batch.py): 859 us as [32, 1, K], 92 us as one [32, K] matrix, 262 us as four 8-row kernel
# launches, 211 us on qmm.py. Read at import, as the other switches here.
#   "mma"     kernels/qmm.py: the tensor cores, qmm.MAX_ROWS rows a launch (the default: the fastest end to end)
#   "mlx"     MLX's quantized_matmul on x as it comes
#   "matrix"  MLX's quantized_matmul on the rows as one [B, K] matrix (its b=32 runs have not finished within 115 s,
#             where "mma" and "mlx" took 104-109 s; the cause is not known)
#   "chunks"  this kernel, LAYER_MAX_ROWS rows a launch (each row's values are those of a batch within the limit; its
#             b=32 run did not finish within 115 s either)
BATCH_MODES = ("mma", "mlx", "matrix", "chunks")


def batch_mode(value: str | None) -> str:
    """MLXCEL_QMM_BATCH's mode: one of BATCH_MODES, any case; unset, empty or anything else is "mma"."""
    value = (value or "").strip().lower()
    return value if value in BATCH_MODES else "mma"


_REQUESTED = os.environ.get("MLXCEL_QMM_BATCH", "")
BATCH_MODE = batch_mode(_REQUESTED)
if _REQUESTED.strip() and BATCH_MODE != _REQUESTED.strip().lower():
    print(f"mlxcel: MLXCEL_QMM_BATCH={_REQUESTED!r} is not one of {', '.join(BATCH_MODES)}; using mma", file=sys.stderr)


def _decode_rows(x: mx.array) -> bool:
    """x is a decode batch as the engine holds it: [B, 1, K], B > 1 (a prompt's rows go in as they come)."""
    return x.ndim == 3 and x.shape[0] > 1 and x.shape[1] == 1


def as_rows(matmul, x: mx.array) -> mx.array:
    """matmul(x) for a 4-bit product, with a decode batch's x [B, 1, K] given as one [B, K] matrix under
    MLXCEL_QMM_BATCH=matrix (the values are the same product's: bit for bit on CPU)."""
    if BATCH_MODE != "matrix" or not _decode_rows(x):
        return matmul(x)
    return matmul(x.reshape(x.shape[0], x.shape[2]))[:, None, :]


def _batch_matvec(layer: nn.Module, x: mx.array) -> mx.array | None:
    """A decode batch too large for one launch of this kernel, as MLXCEL_QMM_BATCH says: "mma", kernels/qmm.py
    (qmm.MAX_ROWS rows a launch); "chunks", this kernel (LAYER_MAX_ROWS rows a launch). None where this call is not
    for either (no CUDA, other types: then MLX's own call)."""
    if BATCH_MODE not in ("chunks", "mma") or not _decode_rows(x) or x.shape[0] <= LAYER_MAX_ROWS:
        return None
    if BATCH_MODE == "mma":
        w, scales = layer["weight"], layer["scales"]
        step = qmm.MAX_ROWS
        first_shape = (min(x.shape[0], step), *x.shape[1:])  # (no slice op just to ask)
        if not qmv.kernel_ready() or qmm.launch_args(first_shape, x.dtype, scales.dtype, w.shape[0], x.shape[-1],
                                                     layer.group_size) is None:
            return None
        # x itself when one launch takes it: a slice is one more op in every layer of a decode step's graph
        rows = [x] if x.shape[0] <= step else [x[i:i + step] for i in range(0, x.shape[0], step)]
        parts = [qmm.quantized_matmul(r, w, scales, layer["biases"], layer.group_size) for r in rows]
    else:
        parts = [_kernel_matvec(layer, x[:LAYER_MAX_ROWS])]
        if parts[0] is None:  # no kernel here (later chunks are no larger: the kernel takes them where it took this)
            return None
        parts += [_kernel_matvec(layer, x[i:i + LAYER_MAX_ROWS]) for i in range(LAYER_MAX_ROWS, x.shape[0],
                                                                                LAYER_MAX_ROWS)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


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
        if (self.fuses_residual and "bias" not in self and residual.shape == out_shape
                and residual.dtype == self._product_dtype(x)):
            y = self._matvec(x, "residual", (residual,))
            if y is not None:
                return y
        return residual + self(x)


class FastQuantizedLinear(_DecodeKernelLayer, nn.QuantizedLinear):
    """nn.QuantizedLinear whose decode calls (<= LAYER_MAX_ROWS rows of x) run the 4-bit CUDA matvec kernel; larger
    decode batches go as MLXCEL_QMM_BATCH says (`_batch_matvec`, `as_rows`)."""

    def _matvec(self, x: mx.array, mode: str = "plain", extra: tuple = ()) -> mx.array | None:
        y = _kernel_matvec(self, x, mode, extra)
        return _batch_matvec(self, x) if y is None and mode == "plain" else y

    def _mlx_call(self, x: mx.array) -> mx.array:
        return as_rows(super()._mlx_call, x)

    def _product_dtype(self, x: mx.array):
        return mx.result_type(x, self["scales"])


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
            y = _batch_matvec(self, x)
        return as_rows(super().as_linear, x) if y is None else y


def half_rows(hidden_size: int | None) -> int:
    """Rows of x up to which a 16-bit model `hidden_size` wide calls kernels/hmv.py (see HALF_MAX_ROWS)."""
    return hmv.MAX_ROWS if hidden_size is not None and hidden_size <= HALF_ROWS_MAX_HIDDEN else 2


def half_limit(model_rows: int) -> int:
    """The row limit of a call: MLXCEL_HMV_MAX_ROWS where set, else the model's (`half_rows`, kept by its layers)."""
    return HALF_MAX_ROWS or model_rows


def _half_matvec(layer: nn.Module, x: mx.array, mode: str = "plain", extra: tuple = ()) -> mx.array | None:
    """x @ layer's 16-bit weight on kernels/hmv.py, or None when this call is not for it."""
    w = layer["weight"]
    args = hmv.launch_args(x.shape, x.dtype, w.dtype, w.shape[0], None, half_limit(layer.kernel_rows), mode)
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
    from ..engine.compiled_decode import forget_traces

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
    from ..engine.compiled_decode import forget_traces

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
    from ..engine.compiled_decode import forget_traces

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
    tables = [module.weight.shape for _, module in model.named_modules()
              if type(module) in (nn.Embedding, FastEmbedding)]
    return max(tables)[1] if tables else None


def maybe_use_fast_quantized_linear(model: nn.Module) -> int:
    """`use_fast_quantized_linear` when `enabled()` (MLX on CUDA and MLXCEL_QMV not "0"), and `use_fast_half_linear`
    when `hmv.enabled` for the model's width (MLXCEL_HMV, or its size default); return how many layers were swapped."""
    swapped = use_fast_quantized_linear(model) if enabled() else 0
    return swapped + (use_fast_half_linear(model) if hmv.enabled(embedding_width(model)) else 0)
