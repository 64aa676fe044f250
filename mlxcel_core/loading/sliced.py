"""Tensor-parallel loading: each rank reads only the bytes of its slices from safetensors files.

`open_tensors(path)` returns one `LazyTensor` per tensor: shape and dtype from the file's header, nothing
read. Basic slicing (`t[..., a:b]`, `t.split(n, axis)`), `astype` and stacking (`LazyStack`, what MoE
`stack_experts` builds from per-expert tensors) give further handles, still unread. `build_model` slices them
in `shard_model` and then calls `materialize`:

- a sliced handle reads exactly its bytes: one `pread` per contiguous run (a row slice along axis -2 is one
  run per leading index; a column slice along axis -1 is one run per row);
- an unsliced handle (norms, embeddings, LM head, MoE routers, anything replicated) is the file's lazily
  loaded `mx.load` array, read whole when the model is evaluated, exactly as without tensor parallelism.

Falls back to reading the whole tensor and slicing it in memory (today's `mx.load` path) only where the
bytes cannot be addressed directly: dtypes outside `DTYPES` (e.g. F64, FP8) and indexing other than plain
ranges (integers, steps). Every transform that the TP-supported families' `sanitize` applies (dropping and
renaming keys, stacking per-expert tensors and splitting a fused `gate_up_proj` in models/moe.py) keeps
handles unread; `build_model` refuses unsupported families before their `sanitize` sees a handle.

GGUF files are not read through here: they keep `mx.load` + slicing in memory (each sharded tensor is read
whole once, then `shard._slice` copies the slice out). The reads are exact at the application level; the OS
still reads whole pages (and may read ahead), so a column slice of rows narrower than a page costs about as
much disk traffic as the rows.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from pathlib import Path

import mlx.core as mx

from ..errors import CorruptModelError

# safetensors dtype -> mx dtype. Bytes are read as an unsigned carrier of the same width and bit-cast with
# `.view`: memoryview cannot produce float16/bfloat16 and numpy has no bfloat16 (safetensors' own
# get_slice fails on BF16 for both the "numpy" and "mlx" frameworks).
DTYPES = {
    "F32": mx.float32,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "U16": mx.uint16,
    "I16": mx.int16,
    "U8": mx.uint8,
    "I8": mx.int8,
    "U64": mx.uint64,
    "I64": mx.int64,
}
_CARRIERS = {1: ("B", mx.uint8), 2: ("H", mx.uint16), 4: ("I", mx.uint32), 8: ("Q", mx.uint64)}


class _Source:
    """Where one tensor's bytes live, plus its lazily loaded whole array (for unsliced reads)."""

    def __init__(self, path: Path, name: str, offset: int, dtype_name: str, whole: mx.array):
        self.path, self.name, self.offset, self.whole = path, name, offset, whole
        self.dtype = DTYPES.get(dtype_name)
        if self.dtype != whole.dtype:  # not addressable by us (or a header we misread): whole reads only
            self.dtype = None


def read_arrays(path: Path) -> dict[str, mx.array]:
    """mx.load with a one-line error for unreadable (e.g. truncated) files."""
    try:
        return mx.load(str(path))
    except Exception as exc:  # mx.load raises RuntimeError/ValueError with C++ messages
        raise CorruptModelError(f"cannot read weights file {path}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def open_tensors(path: Path) -> dict[str, LazyTensor]:
    """One unread handle per tensor of the safetensors file `path`."""
    whole = read_arrays(path)  # lazy: parses the header only; also the one-line error for a bad file
    header, data_start = read_header(path)
    out = {}
    for name, array in whole.items():
        entry = header.get(name)
        if not isinstance(entry, dict) or list(entry.get("shape", ())) != list(array.shape):
            raise CorruptModelError(f"cannot read weights file {path}: header entry for {name} does not match")
        begin, end = entry["data_offsets"]
        if end - begin != array.nbytes:
            raise CorruptModelError(
                f"cannot read weights file {path}: {name} has {end - begin} bytes, its shape needs {array.nbytes}"
            )
        source = _Source(Path(path), name, data_start + begin, entry["dtype"], array)
        out[name] = LazyTensor(source, tuple((0, n) for n in array.shape))
    return out


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, offsets; "__metadata__") and where its data starts."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise CorruptModelError(f"cannot read weights file {path}: bad safetensors header ({exc})") from exc
    return header, 8 + length


def materialize(weights: dict) -> dict[str, mx.array]:
    """Replace every handle by its array (sliced ones are read now; whole ones stay lazy mx.load arrays)."""
    scratch = _Scratch()
    return {k: v.read(scratch) if isinstance(v, _Lazy) else v for k, v in weights.items()}


class _Scratch:
    """One read buffer reused for every tensor: a fresh one per tensor costs as much (page faults) as the read."""

    def __init__(self):
        self.buf = bytearray()

    def view(self, n: int) -> memoryview:
        if len(self.buf) < n:
            self.buf = bytearray(n)
        return memoryview(self.buf)[:n]


class _Lazy:
    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @staticmethod
    def stack(parts: list) -> LazyStack | mx.array:
        """mx.stack for handles: nothing is read (mixed with arrays: the handles are read and stacked)."""
        if any(isinstance(p, mx.array) for p in parts):
            return mx.stack([p.read() if isinstance(p, _Lazy) else p for p in parts])
        return LazyStack(parts)

    def split(self, indices_or_sections, axis: int = 0) -> list:
        """mx.split's semantics (equal sections or split points), returning handles."""
        axis %= self.ndim
        n = self.shape[axis]
        if isinstance(indices_or_sections, int):
            if n % indices_or_sections:
                raise ValueError(f"cannot split axis {axis} of size {n} into {indices_or_sections} equal parts")
            step = n // indices_or_sections
            points = list(range(step, n, step))
        else:
            points = list(indices_or_sections)
        bounds = zip([0, *points], [*points, n])
        return [self[(slice(None),) * axis + (slice(a, b),)] for a, b in bounds]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype})"


def _ranges(index, shape: tuple[int, ...]) -> list[tuple[int, int]] | None:
    """Per-axis (start, stop) for an index of plain ranges and Ellipsis; None for anything else."""
    index = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in index) > 1:
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1 :]
    if len(index) > len(shape) or not all(isinstance(i, slice) for i in index):
        return None
    out = []
    for i, n in itertools.zip_longest(index, shape, fillvalue=slice(None)):
        start, stop, step = i.indices(n)
        if step != 1:
            return None
        out.append((start, max(start, stop)))
    return out


class LazyTensor(_Lazy):
    """A box (a range per axis) of one checkpoint tensor, optionally cast; read only on `read()`."""

    def __init__(self, source: _Source, box: tuple[tuple[int, int], ...], cast: mx.Dtype | None = None):
        self.source, self.box, self.cast = source, box, cast
        self.shape = tuple(b - a for a, b in box)
        self.dtype = cast or source.whole.dtype

    def __getitem__(self, index):
        ranges = _ranges(index, self.shape)
        if ranges is None:  # not a box: read this view and index it in memory
            return self.read()[index]
        box = tuple((a0 + a, a0 + b) for (a0, _), (a, b) in zip(self.box, ranges))
        return LazyTensor(self.source, box, self.cast)

    def astype(self, dtype: mx.Dtype) -> LazyTensor:
        return LazyTensor(self.source, self.box, dtype)

    @property
    def is_whole(self) -> bool:
        return self.shape == tuple(self.source.whole.shape)

    def read(self, scratch: _Scratch | None = None) -> mx.array:
        src = self.source
        if self.is_whole or src.dtype is None or 0 in self.shape:
            a = src.whole if self.is_whole else src.whole[tuple(slice(a, b) for a, b in self.box)]
        else:
            a = _read_box(src, self.box, scratch or _Scratch())
        return a.astype(self.cast) if self.cast is not None and self.cast != a.dtype else a


class LazyStack(_Lazy):
    """mx.stack(parts) of handles with the same shape and dtype (stacked MoE experts), unread."""

    def __init__(self, parts: list[_Lazy]):
        if not parts:
            raise ValueError("stack needs at least one tensor")
        if any(p.shape != parts[0].shape or p.dtype != parts[0].dtype for p in parts):
            raise ValueError(f"cannot stack tensors of shapes/dtypes {[(p.shape, p.dtype) for p in parts]}")
        self.parts = list(parts)
        self.shape = (len(parts), *parts[0].shape)
        self.dtype = parts[0].dtype

    def __getitem__(self, index):
        ranges = _ranges(index, self.shape)
        if ranges is None:
            return self.read()[index]
        (a, b), rest = ranges[0], tuple(slice(s, e) for s, e in ranges[1:])
        parts = [p[rest] for p in self.parts[a:b]]
        return LazyStack(parts) if parts else self.read()[index]

    def astype(self, dtype: mx.Dtype) -> LazyStack:
        return LazyStack([p.astype(dtype) for p in self.parts])

    def read(self, scratch: _Scratch | None = None) -> mx.array:
        scratch = scratch or _Scratch()
        return mx.stack([p.read(scratch) for p in self.parts])


def _read_box(src: _Source, box: tuple[tuple[int, int], ...], scratch: _Scratch) -> mx.array:
    """Read exactly the bytes of `box` (row-major) into a new array: one pread per contiguous run."""
    shape = tuple(src.whole.shape)
    itemsize = src.dtype.size
    strides = [itemsize * math.prod(shape[i + 1 :]) for i in range(len(shape))]
    # Innermost axes taken whole extend each run; the first partial axis from the right ends it.
    j = len(shape) - 1
    while j >= 0 and box[j] == (0, shape[j]):
        j -= 1
    run = (box[j][1] - box[j][0]) * strides[j]
    first = src.offset + box[j][0] * strides[j]
    leads = itertools.product(*(range(a, b) for a, b in box[:j]))
    offsets = [first + sum(i * s for i, s in zip(lead, strides)) for lead in leads]
    view = scratch.view(run * len(offsets))
    with open(src.path, "rb", buffering=0) as f:
        fd = f.fileno()
        for k, offset in enumerate(offsets):
            _pread_into(fd, view[k * run : (k + 1) * run], offset, src)
    fmt, carrier = _CARRIERS[itemsize]
    flat = mx.array(view.cast(fmt))  # a copy: the scratch buffer is reused
    out = flat.reshape(tuple(b - a for a, b in box))
    return out if carrier == src.dtype else out.view(src.dtype)


def _pread_into(fd: int, view: memoryview, offset: int, src: _Source) -> None:
    """Fill `view` from the file at `offset` (the one place bytes are read; tests count through it)."""
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            got = os.preadv(fd, [view[done:]], offset + done)
        else:
            chunk = os.pread(fd, len(view) - done, offset + done)
            got = len(chunk)
            view[done : done + got] = chunk
        if got == 0:
            raise CorruptModelError(f"cannot read weights file {src.path}: {src.name} is truncated")
        done += got
