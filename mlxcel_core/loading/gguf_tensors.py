"""GGUF tensors onto MLX: float tensors as arrays, quantized blocks as MLX quantized layouts.

Read memory-mapped (the header by gguf_header.py) and converted block-wise by MLX ops on the default device (the
GPU's where there is one), a slab of rows at a time, so loading never holds the model in fp32. Each GGUF type maps
onto MLX quantization (groups of 32 along the last axis, w = scale * q + bias, q packed as a little-endian bit stream
into uint32 words) by `_LAYOUTS`:

- exact, same bits: Q4_0/Q4_1/Q4_K (4-bit), Q5_0/Q5_1/Q5_K (5-bit), Q8_0 (8-bit), MXFP4 (MLX's mxfp4 mode);
- exact, more bits: Q3_K, IQ4_NL and IQ4_XS hold integers times one scale per 32 values (Q3_K's
  (sc-32)*(q-4) lies in [-124, 128], IQ4's table values in [-127, 113]), which 8-bit groups of 32 store exactly;
- requantized: Q6_K (16-wide sub-blocks with their own scales) to 8 bits and Q2_K (16-wide sub-blocks with their
  own mins) to 4 bits, from ggml's reference dequantization (gguf.quants' arithmetic, in MLX ops); no MLX layout
  holds them exactly.

Scales and biases are computed in fp32, where every product d*sc above is exact; `scale_dtype` may narrow them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from ..errors import CorruptModelError, UnsupportedModelError

GROUP = 32
_SLAB_VALUES = 1 << 20  # values converted per slab: bounds the temporaries to a few tens of MB
_FLOAT_TYPES = ("F32", "F16", "BF16")
_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """One GGUF tensor in an MLX quantized layout, quantized along its last axis.

    `biases` is None in mxfp4 mode. `exact`: whether MLX's dequantization reproduces ggml's values exactly
    (False where the tensor was requantized)."""

    weight: mx.array
    scales: mx.array
    biases: mx.array | None
    bits: int
    group_size: int
    source_type: str
    mode: str = "affine"
    exact: bool = True

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 32 // self.bits)

    def apply(self, fn: Callable[[mx.array], mx.array]) -> QuantizedTensor:
        """`fn` (a reshape, slice or take over the leading axes) applied alike to weight, scales and biases."""
        biases = None if self.biases is None else fn(self.biases)
        return replace(self, weight=fn(self.weight), scales=fn(self.scales), biases=biases)

    def permute_rows(self, index: mx.array | np.ndarray) -> QuantizedTensor:
        """Rows (the second-to-last axis: output features) reordered by `index`."""
        index = mx.array(index)
        return self.apply(lambda a: mx.take(a, index, axis=-2))

    def dequantize(self, dtype: mx.Dtype = mx.float32) -> mx.array:
        return mx.dequantize(
            self.weight,
            self.scales,
            self.biases,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            dtype=dtype,
        )

    def arrays(self, stem: str) -> dict[str, mx.array]:
        """The `stem.weight` / `.scales` / `.biases` entries MLX's quantized layers load."""
        out = {f"{stem}.weight": self.weight, f"{stem}.scales": self.scales}
        if self.biases is not None:
            out[f"{stem}.biases"] = self.biases
        return out


def _f16(blocks: mx.array, start: int) -> mx.array:
    return blocks[:, start : start + 2].view(mx.float16).astype(mx.float32)  # (n, 1)


def _nibbles(qs: mx.array) -> mx.array:
    """(..., k) bytes -> (..., 2k): the low nibbles, then the high nibbles (ggml's order within a block)."""
    return mx.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _packed_nibbles(qs: mx.array) -> mx.array:
    """(..., k) bytes holding 2k values as ggml orders them (the first k in the low nibbles, the next k in the high
    ones) -> the same 2k values as MLX packs them, value j in byte j // 2, low nibble first: bytes 2i, 2i+1 read as
    one little-endian uint16 give MLX's byte i from their low nibbles and byte i + k/2 from their high ones."""
    u = qs.view(mx.uint16)
    low = (u & 0x0F) | ((u >> 4) & 0xF0)
    high = ((u >> 4) & 0x0F) | ((u >> 8) & 0xF0)
    return mx.concatenate([low, high], axis=-1).astype(mx.uint8)


def _bits(packed: mx.array, count: int, width: int = 1) -> mx.array:
    """(..., k) unsigned -> (..., count, k): field i of `width` bits from every element."""
    shifts = (mx.arange(count, dtype=packed.dtype) * width).reshape(count, 1)
    return (packed[..., None, :] >> shifts) & ((1 << width) - 1)


def _q4_0(b):
    d = _f16(b, 0)
    return _packed_nibbles(b[:, 2:]), d, -8 * d


def _q4_1(b):
    return _packed_nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2)


def _q5(b, start):
    qh = b[:, start : start + 4]  # bit j of the little-endian uint32: the 5th bit of value j
    high = ((qh[..., None] >> mx.arange(8, dtype=mx.uint8)) & 1).reshape(-1, 32)
    return _nibbles(b[:, start + 4 :]) | (high << 4)


def _q5_0(b):
    d = _f16(b, 0)
    return _q5(b, 2), d, -16 * d


def _q5_1(b):
    return _q5(b, 4), _f16(b, 0), _f16(b, 2)


def _q8_0(b):
    d = _f16(b, 0)
    return (b[:, 2:] ^ 0x80), d, -128 * d  # int8 + 128, as the byte with its top bit flipped


def _k_scales(packed: mx.array) -> tuple[mx.array, mx.array]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit sub-block scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = mx.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = mx.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(mx.float32), mins.astype(mx.float32)


def _q4_k(b):
    sc, mins = _k_scales(b[:, 4:16])
    q = _packed_nibbles(b[:, 16:144].reshape(-1, 4, 32))  # per 64 values: 32 low nibbles, then 32 high
    return q.reshape(-1, 128), _f16(b, 0) * sc, -(_f16(b, 2) * mins)


def _q5_k(b):
    sc, mins = _k_scales(b[:, 4:16])
    low = _nibbles(b[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = _bits(b[:, 16:48], 8)  # bit j of qh[l]: the 5th bit of value l of sub-block j
    return (low | (high << 4)).reshape(-1, 256), _f16(b, 0) * sc, -(_f16(b, 2) * mins)


def _q3_k(b):
    """Exact at 8 bits: value = d * (sc-32) * (q-4) with (sc-32)*(q-4) an integer in [-124, 128]."""
    low = _bits(b[:, 32:96].reshape(-1, 2, 32), 4, 2).reshape(-1, 16, 16)
    high = _bits(b[:, 0:32], 8).reshape(-1, 16, 16)
    packed = b[:, 96:108]
    lo = _nibbles(packed[:, 0:8])  # scales 0-7 from the low nibbles of bytes 0-7, 8-15 from the high ones
    hi = _bits(packed[:, 8:12], 4, 2).reshape(-1, 16)
    sc = ((lo | (hi << 4)).astype(mx.int16) - 32)[..., None]
    q = sc * ((low | (high << 2)).astype(mx.int16) - 4) + 124
    d = _f16(b, 108)
    return q.astype(mx.uint8).reshape(-1, 256), d, -124 * d


def _iq4(idx: mx.array) -> mx.array:
    """IQ4 codes -> their table values + 128, as bytes."""
    return mx.take(mx.array([v + 128 for v in _IQ4_VALUES], mx.uint8), idx.astype(mx.uint32))


def _iq4_nl(b):
    d = _f16(b, 0)
    return _iq4(_nibbles(b[:, 2:])), d, -128 * d


def _iq4_xs(b):
    scales_h = b[:, 2:4].view(mx.uint16)
    low = _nibbles(b[:, 4:8].reshape(-1, 4, 1)).reshape(-1, 8)  # sub-block j: byte j//2, nibble j%2
    high = _bits(scales_h, 8, 2).reshape(-1, 8).astype(mx.uint8)
    dl = _f16(b, 0) * ((low | (high << 4)).astype(mx.float32) - 32)
    idx = _nibbles(b[:, 8:136].reshape(-1, 8, 16)).reshape(-1, 256)
    return _iq4(idx), dl, -128 * dl


def _mxfp4(b):
    """ggml stores E2M1 codes with a doubled-value table and 2^(e-128): MLX's codes and E8M0 exponent, as is."""
    return _packed_nibbles(b[:, 1:17]), b[:, 0:1], None


def _q2_k_values(b):
    """ggml's reference dequantization of Q2_K blocks (gguf.quants), (n, 256) float32."""
    n = b.shape[0]
    d, dmin = _f16(b, 80), _f16(b, 82)
    scales = b[:, 0:16]
    dl = (d * (scales & 0xF).astype(mx.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).astype(mx.float32)).reshape(n, 16, 1)
    q = _bits(b[:, 16:80].reshape(n, 2, 32), 4, 2).reshape(n, 16, 16).astype(mx.float32)
    return (dl * q - ml).reshape(n, 256)


def _q6_k_values(b):
    """ggml's reference dequantization of Q6_K blocks (gguf.quants), (n, 256) float32."""
    n = b.shape[0]
    d = _f16(b, 208) * b[:, 192:208].view(mx.int8).astype(mx.float32)
    ql = _bits(b[:, 0:128].reshape(n, 2, 64), 2, 4).reshape(n, 8, 32)  # per 128 values: low nibbles, high nibbles
    qh = _bits(b[:, 128:192].reshape(n, 2, 32), 4, 2).reshape(n, 8, 32)
    q = (ql | (qh << 4)).astype(mx.int16) - 32
    return (d.reshape(n, 16, 1) * q.reshape(n, 16, 16).astype(mx.float32)).reshape(n, 256)


@dataclass(frozen=True)
class _Layout:
    decode: Callable | None  # blocks -> (q, scales, biases) per block; None: requantize `values`
    bits: int
    mode: str = "affine"
    exact: bool = True
    values: Callable | None = None  # blocks -> ggml's float values, for the requantized types
    packed: bool = False  # `decode` gives q already packed as MLX's bytes (else one value a byte)


_LAYOUTS = {
    "Q4_0": _Layout(_q4_0, 4, packed=True),
    "Q4_1": _Layout(_q4_1, 4, packed=True),
    "Q5_0": _Layout(_q5_0, 5),
    "Q5_1": _Layout(_q5_1, 5),
    "Q8_0": _Layout(_q8_0, 8),
    "Q2_K": _Layout(None, 4, exact=False, values=_q2_k_values),
    "Q3_K": _Layout(_q3_k, 8),
    "Q4_K": _Layout(_q4_k, 4, packed=True),
    "Q5_K": _Layout(_q5_k, 5),
    "Q6_K": _Layout(None, 8, exact=False, values=_q6_k_values),
    "IQ4_NL": _Layout(_iq4_nl, 8),
    "IQ4_XS": _Layout(_iq4_xs, 8),
    "MXFP4": _Layout(_mxfp4, 4, mode="mxfp4", packed=True),
}
SUPPORTED_TYPES = (*_FLOAT_TYPES, *_LAYOUTS)
# Source bits per weight of each quantized type, to tell layouts that widen a tensor from those that keep its bits.
_SOURCE_BITS = {"Q2_K": 2, "Q3_K": 3, "Q6_K": 6, "IQ4_NL": 4, "IQ4_XS": 4}


def _pack(q: mx.array, bits: int) -> mx.array:
    """(rows, n) values < 2**bits -> (rows, n*bits/32) uint32: MLX's layout, value j at bits [j*bits, (j+1)*bits)."""
    rows, n = q.shape
    if bits == 8:
        return mx.contiguous(q.astype(mx.uint8)).view(mx.uint32)
    if bits == 4:
        pairs = q.astype(mx.uint8).reshape(rows, n // 2, 2)
        return mx.contiguous(pairs[..., 0] | (pairs[..., 1] << 4)).view(mx.uint32)
    eights = q.reshape(rows, n // 8, 8).astype(mx.uint16)
    stream = []  # 8 values fill `bits` bytes; byte k holds the bits [8k, 8k+8) of the 8 values' bit stream
    for k in range(bits):
        byte = None
        for j in range(8):
            shift = bits * j - 8 * k  # where value j's lowest bit falls in byte k
            if -bits < shift < 8:
                v = eights[..., j]
                part = ((v << shift) & 0xFF) if shift >= 0 else v >> -shift
                byte = part if byte is None else byte | part
        stream.append(byte.astype(mx.uint8))
    return mx.stack(stream, axis=-1).reshape(rows, -1).view(mx.uint32)


def _requantize(values: mx.array, rows: int, bits: int):
    """ggml's reference values, min-max affine per group of 32 with round-to-nearest: error at most half a step.
    (mx.quantize keeps zero exact instead, at up to a whole step.)"""
    groups = values.reshape(rows, -1, GROUP)
    low = groups.min(axis=-1, keepdims=True)
    scale = (groups.max(axis=-1, keepdims=True) - low) / (2**bits - 1)
    q = mx.round((groups - low) / mx.where(scale > 0, scale, 1.0)).astype(mx.uint8)
    return _pack(q.reshape(rows, -1), bits), scale[..., 0], low[..., 0]


def _slab(blocks: mx.array, layout: _Layout, rows: int, cols: int, block: int):
    """One slab of rows: (packed weight, scales, biases), scales and biases one per group of 32."""
    if layout.decode is None:
        return _requantize(layout.values(blocks), rows, layout.bits)
    q, s, b = layout.decode(blocks)
    per_block = block // GROUP
    s = mx.broadcast_to(s, (s.shape[0], per_block)).reshape(rows, -1)
    b = None if b is None else mx.broadcast_to(b, (b.shape[0], per_block)).reshape(rows, -1)
    if layout.packed:
        return mx.contiguous(q.reshape(rows, -1)).view(mx.uint32), s, b
    return _pack(q.reshape(rows, cols), layout.bits), s, b


def _quantized(t, type_name: str, layout: _Layout, scale_dtype: mx.Dtype) -> QuantizedTensor:
    """Slab by slab into preallocated MLX arrays (updated in place): no second copy of the tensor at any time.
    The blocks are decoded by MLX ops on the default device (the GPU's where there is one)."""
    from gguf import GGML_QUANT_SIZES

    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    block, type_size = GGML_QUANT_SIZES[t.tensor_type]
    cols = shape[-1]
    rows = int(t.n_elements) // cols
    raw = t.data.reshape(rows, -1)
    affine = layout.mode == "affine"
    weight = mx.zeros((rows, cols * layout.bits // 32), mx.uint32)
    scales = mx.zeros((rows, cols // GROUP), scale_dtype if affine else mx.uint8)
    biases = mx.zeros((rows, cols // GROUP), scale_dtype) if affine else None
    outputs = [a for a in (weight, scales, biases) if a is not None]
    mx.eval(outputs)
    step = max(1, _SLAB_VALUES // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        blocks = mx.array(np.asarray(raw[r : r + n])).reshape(-1, type_size)
        parts = _slab(blocks, layout, n, cols, block)
        for out, part in zip(outputs, parts):
            out[r : r + n] = part.astype(out.dtype)
        mx.eval(outputs)

    def final(a: mx.array | None) -> mx.array | None:
        return None if a is None else a.reshape(*shape[:-1], a.shape[-1])

    return QuantizedTensor(
        weight=final(weight),
        scales=final(scales),
        biases=final(biases),
        bits=layout.bits,
        group_size=GROUP,
        source_type=type_name,
        mode=layout.mode,
        exact=layout.exact,
    )


def _float(t, type_name: str) -> mx.array:
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    data = np.asarray(t.data)
    if type_name == "BF16":
        return mx.array(data.view(np.uint16).reshape(shape)).view(mx.bfloat16)
    return mx.array(data.reshape(shape))


def _open(path: Path) -> SimpleNamespace:
    """The file's header (gguf_header.py): `.meta` and `.tensors`, whose data stays memory-mapped."""
    from .gguf_header import Truncated, read_header

    size = path.stat().st_size if path.exists() else 0
    try:
        meta, tensors = read_header(path)
    except Truncated as exc:
        raise CorruptModelError(
            f"cannot read GGUF file {path}: the file is truncated "
            f"(its {size} bytes end before the header and tensor data it declares: {exc})"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptModelError(f"cannot read GGUF file {path}: {str(exc).splitlines()[0]}") from None
    except OSError as exc:
        raise CorruptModelError(f"cannot read GGUF file {path}: {exc.strerror or exc}") from None
    return SimpleNamespace(meta={k: v for k, v in meta.items() if not k.startswith("GGUF.")}, tensors=tensors)


def _check_types(reader, path: Path) -> None:
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"GGUF tensor '{t.name}' in {path.name} has type {t.tensor_type.name}, which mlxcel does not read "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )


def read_gguf_tensors(
    path: Path | str, scale_dtype: mx.Dtype | Callable[[dict, set[str]], mx.Dtype] = mx.float32, cast_floats=False
) -> tuple[dict[str, mx.array | QuantizedTensor], dict[str, Any]]:
    """Every tensor of the GGUF file at `path`, by its GGUF name, and the file's metadata.

    Quantized tensors come back as QuantizedTensor whose float scales and biases are `scale_dtype` (fp32 keeps every
    ggml scale exact), or what `scale_dtype(metadata, the file's tensor type names)` picks. Float tensors come back
    in their own dtype, or in that one too with `cast_floats`."""
    path = Path(path)
    reader = _open(path)
    _check_types(reader, path)
    if callable(scale_dtype):
        scale_dtype = scale_dtype(reader.meta, {t.tensor_type.name for t in reader.tensors})
    tensors: dict[str, mx.array | QuantizedTensor] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in _FLOAT_TYPES:
            tensors[t.name] = _float(t, kind).astype(scale_dtype) if cast_floats else _float(t, kind)
        else:
            tensors[t.name] = _quantized(t, kind, _LAYOUTS[kind], scale_dtype)
    return tensors, reader.meta


def conversion_notice(tensors: dict[str, Any]) -> str | None:
    """One line naming the tensors stored with more bits than the file gives them, or requantized; None if none."""
    widened: dict[tuple[str, int, bool], int] = {}
    for value in tensors.values():
        if isinstance(value, QuantizedTensor) and value.source_type in _SOURCE_BITS:
            key = (value.source_type, value.bits, value.exact)
            widened[key] = widened.get(key, 0) + 1
    if not widened:
        return None
    parts = [
        f"{count} {kind} -> {bits}-bit groups of {GROUP} ({'exact' if exact else 'requantized'})"
        for (kind, bits, exact), count in sorted(widened.items())
    ]
    return "GGUF tensors without an MLX layout of their own: " + "; ".join(parts)
