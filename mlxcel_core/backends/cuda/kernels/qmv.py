"""4-bit quantized matrix-vector product for decode (a few rows of x) as one CUDA kernel (``mx.fast.cuda_kernel``).

    y = quantized_matvec(x, w, scales, biases, group_size=64, bits=4)   # == x @ dequantize(w).T

Same contract as ``mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits)`` in MLX's affine
mode: x [..., K] (float16, bfloat16 or float32), w [N, K/8] uint32 with element j of a word in bits [4j, 4j+4)
(what ``mx.quantize(..., bits=4)`` packs), scales and biases [N, K/group_size]; weight (n, k) is
q * scales[n, k // group_size] + biases[n, k // group_size]. y [..., N] has MLX's result dtype
(``mx.result_type(x, scales)``: x's dtype in a model). The kernel runs where `supports` says so: MLX on CUDA,
bits 4, group size 32/64/128, K a multiple of 32, at most MAX_ROWS rows of x; anything else (and every call on
CPU or Metal) is ``mx.quantized_matmul`` itself, so the result there is MLX's, bit for bit.

Kernel ("mlxcel_qmv"): one thread block of WARPS x 32 threads per ROWS consecutive output rows. Lane l of warp v takes
32-element chunks of K at k = (v * 32 + l) * 32 + i * WARPS * 1024, i.e. one 16-byte load (a uint4: 4 words, 32
nibbles) per weight row per chunk, the warp's 32 loads contiguous along K (coalesced 512 bytes), UNROLL chunks' loads
issued before any is used. A chunk lies inside one quantization group, so per chunk and row the lane reads one scale
and one bias and uses sum_k x_k (q_k s + b) = s * sum_k x_k q_k + b * sum_k x_k, where sum_k x_k is shared by all ROWS
rows. Dequantization costs one LOP3 per two nibbles: (word & 0x000F000F) | 0x64006400 is the fp16 pair (1024 + q_0,
1024 + q_4); (word & 0x00F000F0) | 0x54005400 is (64 + q_1, 64 + q_5) (0x5400 is 64.0, whose mantissa unit is 1/16, so
a nibble in bits 4-7 reads as q); word >> 8 gives nibbles 2,6 and 3,7 the same way. The pairs are widened to float32
and multiplied with x in float32; the constant offsets (1024 for even nibbles, 64 for odd ones) are removed once per
chunk, sum x (O + q) - (1024 sum_even x + 64 sum_odd x) (exact in real arithmetic; in float32 it costs a few ulps of
1024 |x| per chunk, far below the output's fp16/bf16 rounding). A float32 output (x or scales float32) instead
subtracts the offset from each weight, exactly, before the multiply: float32 models get float32 accuracy. All of x's
rows (M <= MAX_ROWS) are handled by the same launch, reusing each loaded word M times. Accumulation is float32
throughout; a warp-shuffle reduction, then one shared-memory sum across the WARPS warps, then one write per output.

The kernel is compiled (NVRTC, by MLX) once per (dtypes, M, group size, ROWS, WARPS, UNROLL) -- the five ints
travel packed in one template argument, CFG, as MLX converts and formats every template argument on every call;
N and K are runtime values. Its name carries a hash of the source, because MLX caches compiled kernels on disk by name
(MLX_PTX_CACHE_DIR, default /tmp/mlx/<version>/ptx): an edited source must not load a stale binary.

The source text is kernels/qmv_source.py. Validated by tests/mlxcel_core/backends/cuda/kernels/test_qmv.py (the
kernel tests are skipped without CUDA); timed by benchmarks/qmv.py.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from ..paged_attention import cuda_kernel_available
from ..small_arrays import float32_bits
from . import pdl_prefetch
from .cubin_cache import cuda_kernel
from .matvec_config import QMV_CHUNK as CHUNK
from .matvec_config import qmv_launch_config as launch_config  # the untuned rule
from .qmv_source import _HEADER, KERNEL_NAME, MODES, base_mode, header, kernel_name, kernel_source  # noqa: F401

MAX_ROWS = 8  # rows of x one launch handles (decode batch); more rows go to mx.quantized_matmul
GROUP_SIZES = (32, 64, 128)
BITS = 4
FLOAT_TYPES = (mx.float16, mx.bfloat16, mx.float32)


@functools.cache
def _kernel(mode: str = "plain"):
    early = pdl_prefetch.budget()
    return cuda_kernel(
        name=kernel_name(mode, "q4", early),
        input_names=["x", "w", "scales", "biases", *MODES[mode][0]],
        output_names=list(MODES[mode][1]),
        source=kernel_source(mode, "q4", early),
        header=header("q4", early),
    )


def rows_of(x_shape) -> int:
    """Rows of x (every leading dimension): what one launch multiplies by the weight."""
    rows = 1
    for d in x_shape[:-1]:
        rows *= d
    return rows


def shape_supported(
    x_shape,
    x_dtype,
    w_shape,
    w_dtype,
    scales_shape,
    scales_dtype,
    biases_shape,
    biases_dtype,
    group_size: int,
    bits: int,
) -> bool:
    """Whether the kernel handles these operands (shapes and dtypes only; `supports` adds the backend)."""
    if bits != BITS or group_size not in GROUP_SIZES or biases_shape is None:
        return False
    if len(w_shape) != 2 or w_dtype != mx.uint32 or len(x_shape) < 1:
        return False
    n, k = w_shape[0], w_shape[1] * 8
    if n < 1 or k < 1 or k % CHUNK or k % group_size or x_shape[-1] != k:
        return False
    groups = (n, k // group_size)
    if tuple(scales_shape) != groups or tuple(biases_shape) != groups:
        return False
    if x_dtype not in FLOAT_TYPES or scales_dtype not in FLOAT_TYPES or biases_dtype != scales_dtype:
        return False
    return 1 <= rows_of(x_shape) <= MAX_ROWS


def kernel_ready() -> bool:
    """MLX has a usable CUDA device and computes on it by default (the kernel runs on the GPU only)."""
    return cuda_kernel_available() and mx.default_device() == mx.gpu


def supports(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int = 64, bits: int = 4
) -> bool:
    """True when `quantized_matvec` runs the CUDA kernel for these operands (else it is mx.quantized_matmul)."""
    if biases is None or not kernel_ready():
        return False
    return shape_supported(
        x.shape, x.dtype, w.shape, w.dtype, scales.shape, scales.dtype, biases.shape, biases.dtype, group_size, bits
    )


def chosen_config(n: int, k: int, m: int, group_size: int, x_dtype) -> tuple[int, int, int]:
    """The launch configuration of a call without one: the autotune cache's winner for this cell where
    MLXCEL_AUTOTUNE reads the cache and one is stored (`mlxcel tune --op qmv-multirow`, autotune/matvec_ops.py), else
    `launch_config`'s rule."""
    from autotune.matvec_ops import QMV, tuned_config

    return tuned_config(QMV, n, k, m, group_size, "plain", x_dtype) or launch_config(n, k, m)


def pack_config(m: int, group_size: int, rows: int, warps: int, unroll: int, groups: int = 1) -> int:
    """The kernel's one int template argument CFG (unpacked at the top of each main loop in qmv_source.py)."""
    return m | group_size << 4 | rows << 12 | warps << 16 | unroll << 20 | groups << 24


def unpack_launch(config: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(ROWS, WARPS, UNROLL, GROUPS) of a launch configuration given as (ROWS, WARPS, UNROLL) or with GROUPS, the
    independent groups of WARPS warps in one CUDA block (qmv_source.py's _GROUP_IDS; 1 unless given)."""
    rows, warps, unroll, *more = config
    groups = more[0] if more else 1
    if not (
        1 <= rows <= 15
        and warps in (1, 2, 4, 8)
        and 1 <= unroll <= 15
        and groups in (1, 2, 4, 8)
        and groups * warps <= 32
    ):
        raise ValueError(f"launch configuration {config}: ROWS 1-15, WARPS and GROUPS 1/2/4/8, at most 32 warps")
    return rows, warps, unroll, groups


def mode_layout(
    mode: str,
    n: int,
    m: int,
    rows: int,
    warps: int,
    split: tuple[int, ...] | None,
    x_shape: tuple,
    out_dtype,
    template: list,
    eps: float | None = None,
    groups: int = 1,
) -> dict:
    """The launch of `mode` over a weight of n rows (both weight kinds): template ints, grid and outputs.

    The "_norm" modes take the norm's epsilon `eps` (a compile-time constant of the launch).

    mode "qkv" (and "qkv_norm") takes split = (NQ, NK), n = NQ + 2 NK, and "qkv_rope" / "qkv_norm_rope" split =
    (NQ, NK, head_dim); "swiglu" (and "swiglu_norm") writes n / 2 outputs.

    Outputs are [..., width] like x, except the rope modes' for one token per row (x [B, 1, K]): q, k and v come out
    as [B, heads, 1, head_dim], the attention's layout, which at one token is the same memory (no reshape op after
    the launch: a decode step's host cost grows with its ops, benchmarks/host_profile.py)."""
    threads = warps * 32
    blocks = -(-n // rows)
    base = base_mode(mode)
    if "_norm" in mode:
        if eps is None or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"mode {mode} needs the norm's epsilon (finite, >= 0), got {eps!r}")
        template = template + [("EPS_BITS", float32_bits(eps))]
    shapes = None
    if base == "qkv":
        nq, nk = split[:2]
        if nq + 2 * nk != n:
            raise ValueError(f"qkv split {split} does not add up to the weight's {n} rows")
        template = template + [("NQ", nq), ("NK", nk)]
        outputs = [nq, nk, nk]
        if mode.endswith("_rope"):  # split = (NQ, NK, head_dim); a block takes rows / 2 rotation pairs
            hd = split[2]
            if hd % 2 or nq % hd or nk % hd or rows % 2:
                raise ValueError(f"rope needs an even head_dim dividing q and k ({split}) and even rows, got {rows}")
            template = template + [("HD", hd)]
            blocks = -(-(n // 2) // (rows // 2))
            if len(x_shape) == 3 and x_shape[1] == 1:
                shapes = [(x_shape[0], width // hd, 1, hd) for width in outputs]
    elif base == "swiglu":
        if n % 2 or rows % 2:
            raise ValueError(f"swiglu needs an even number of weight rows and of rows per block, got {n}, {rows}")
        outputs = [n // 2]
        blocks = -(-(n // 2) // (rows // 2))  # a block reads rows / 2 gate/up row pairs
    else:
        outputs = [n]
    blocks = -(-blocks // groups)  # `blocks` counted groups (the kernels' logical blocks); a CUDA block has `groups`
    threads *= groups
    return dict(
        template=template,
        grid=(blocks * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=shapes or [(*x_shape[:-1], width) for width in outputs],
        output_dtypes=[out_dtype] * len(outputs),
    )


@functools.lru_cache(maxsize=4096)
def launch_args(
    x_shape: tuple,
    x_dtype,
    s_dtype,
    n: int,
    group_size: int,
    config: tuple | None = None,
    max_rows: int = MAX_ROWS,
    mode: str = "plain",
    split: tuple[int, ...] | None = None,
    eps: float | None = None,
) -> dict | None:
    """Everything but the inputs of one launch (cached: a decode step makes hundreds of calls with few shapes),
    or None when x does not suit the kernel (more than max_rows rows, none, or not a float type). n is the weight's
    rows; `mode_layout` says what each mode adds."""
    m = rows_of(x_shape)
    if not 1 <= m <= max_rows or x_dtype not in FLOAT_TYPES:
        return None
    rows, warps, unroll, groups = unpack_launch(config or chosen_config(n, x_shape[-1], m, group_size, x_dtype))
    template = [("T", x_dtype), ("S", s_dtype), ("CFG", pack_config(m, group_size, rows, warps, unroll, groups))]
    return mode_layout(mode, n, m, rows, warps, split, x_shape, mx.result_type(x_dtype, s_dtype), template, eps, groups)


def launch(
    args: dict, x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, mode: str = "plain", extra: tuple = ()
):
    """Run the kernel with `launch_args`' result: y for plain, swiglu and residual (`extra` = (residual,)),
    [q, k, v] for qkv; the "_norm" modes take `extra` = (norm weight,) (launch_args took its epsilon)."""
    outputs = _kernel(mode)(inputs=[x, w, scales, biases, *extra], **args)
    return outputs if base_mode(mode) == "qkv" else outputs[0]


def cuda_quantized_matvec(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int = 64,
    config: tuple[int, ...] | None = None,
) -> mx.array:
    """The kernel itself (CUDA only; the caller has checked `supports`). `config` (ROWS, WARPS, UNROLL[, GROUPS])
    overrides `chosen_config`'s."""
    args = launch_args(x.shape, x.dtype, scales.dtype, w.shape[0], group_size, config)
    if args is None:
        raise ValueError(
            f"the 4-bit matvec kernel takes 1..{MAX_ROWS} rows of float16/bfloat16/float32, "
            f"got x of shape {x.shape} and {x.dtype}"
        )
    return launch(args, x, w, scales, biases)


def quantized_matvec(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int = 64, bits: int = 4
) -> mx.array:
    """x @ dequantize(w, scales, biases).T: the CUDA kernel when `supports`, else mx.quantized_matmul."""
    if supports(x, w, scales, biases, group_size, bits):
        return cuda_quantized_matvec(x, w, scales, biases, group_size)
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=bits)
