"""A GGUF file's header (key/value metadata and tensor directory) parsed from a memory map, tensors left mapped.

The `gguf` package's GGUFReader builds one numpy view per array element, which takes minutes for a
262k-piece vocabulary (Gemma 3); this reads the same layout (GGUF v2/v3, little-endian: magic "GGUF", uint32
version, uint64 tensor and key/value counts, the key/values, the tensor infos, then the tensor data aligned to
`general.alignment`, default 32) with struct and numpy.frombuffer in well under a second. Metadata values come
back as `GGUFReader`'s users had them in `gguf_tensors._metadata`: scalars and strings as Python values, string
arrays as lists, number arrays as numpy arrays. `read_metadata` reads the key/values alone, for callers that need a
model's hyper-parameters without its tensors (`mlxcel tune -m`); it needs neither MLX nor `gguf`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_FLOAT_ITEMS = {"F32": np.float32, "F16": np.float16}


class Truncated(ValueError):
    """The file ends before the header or the tensor data it declares."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: `shape` in GGUF order (fastest axis first, as GGUFReader gives it); `data` the flat mapped
    values (float32/float16 for F32/F16, raw bytes for every other type)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    data: np.ndarray


class SkippedStrings(int):
    """A string array's length, stood in for the strings themselves (`read_metadata(..., strings=False)`)."""


class _Cursor:
    def __init__(self, buf: memoryview, strings: bool = True):
        self.buf, self.at, self.strings = buf, 0, strings

    def take(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise Truncated("the file ends inside its header")
        out = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return out

    def string(self) -> str:
        (n,) = self.take("<Q")
        if self.at + n > len(self.buf):
            raise Truncated("the file ends inside its header")
        out = bytes(self.buf[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return out

    def _strings(self, n: int) -> list[str]:
        """`n` length-prefixed strings (a vocabulary, merges): one loop with nothing looked up per string, as a
        150k-piece vocabulary and its merges are 300k of them."""
        buf, at, end, length_at = self.buf, self.at, len(self.buf), _U64.unpack_from
        out = []
        append = out.append
        try:
            for _ in range(n):
                (length,) = length_at(buf, at)
                at += 8
                append(str(buf[at : at + length], "utf-8", "replace"))
                at += length
        except struct.error:
            raise Truncated("the file ends inside its header") from None
        if at > end:
            raise Truncated("the file ends inside its header")
        self.at = at
        return out

    def array(self, element: int, n: int):
        if element == _STRING and not self.strings:
            for _ in range(n):
                (length,) = self.take("<Q")
                self.at += length
            if self.at > len(self.buf):
                raise Truncated("the file ends inside its header")
            return SkippedStrings(n)
        if element == _STRING:
            return self._strings(n)
        if element in _NUMPY:
            dtype = np.dtype(_NUMPY[element])
            if self.at + n * dtype.itemsize > len(self.buf):
                raise Truncated("the file ends inside its header")
            out = np.frombuffer(self.buf, dtype, n, self.at).copy()
            self.at += n * dtype.itemsize
            return out
        return [self.value(element) for _ in range(n)]

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            element, n = self.take("<IQ")
            return self.array(element, n)
        raise ValueError(f"unknown metadata value type {kind}")


def read_metadata(path: Path, strings: bool = True) -> dict[str, Any]:
    """The key/value metadata of the GGUF file at `path`, no tensor read; with `strings=False` each string array
    (the vocabulary, most of a header) comes back as its length, a SkippedStrings. Errors as `read_header`."""
    return _read_metadata(path, strings)[0]


def _read_metadata(path: Path, strings: bool) -> tuple[dict[str, Any], _Cursor, np.ndarray, int]:
    """(metadata, the cursor just past it, the mapped file, the tensor count)."""
    data = np.memmap(path, mode="r") if Path(path).stat().st_size else np.zeros(0, np.uint8)
    cur = _Cursor(memoryview(data), strings)
    if len(data) < 4 or bytes(data[:4]) != b"GGUF":
        raise ValueError("no GGUF magic number (not a GGUF file)") if len(data) >= 4 else Truncated("empty file")
    cur.at = 4
    version, tensor_count, kv_count = cur.take("<IQQ")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    meta = {}
    for _ in range(kv_count):
        key = cur.string()
        meta[key] = cur.value(cur.take("<I")[0])
    return meta, cur, data, tensor_count


def read_header(path: Path) -> tuple[dict[str, Any], list[TensorEntry]]:
    """(metadata, tensors) of the GGUF file at `path`. ValueError when it is not GGUF or is malformed (Truncated
    when it ends early); OSError when it cannot be opened."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    meta, cur, data, tensor_count = _read_metadata(path, strings=True)
    infos = []
    for _ in range(tensor_count):
        name = cur.string()
        (n_dims,) = cur.take("<I")
        dims = cur.take(f"<{n_dims}Q")
        kind, offset = cur.take("<IQ")
        infos.append((name, dims, GGMLQuantizationType(kind), offset))
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.at // align) * align
    tensors = []
    for name, dims, kind, offset in infos:
        count = int(np.prod(dims, dtype=np.int64)) if dims else 1
        item = _FLOAT_ITEMS.get(kind.name)
        block, type_size = GGML_QUANT_SIZES[kind]
        nbytes = count * np.dtype(item).itemsize if item else count // block * type_size
        begin = start + offset
        if begin + nbytes > len(data):
            raise Truncated(f"tensor '{name}' ends past the end of the file")
        flat = data[begin : begin + nbytes]
        tensors.append(TensorEntry(name, kind, np.array(dims, np.int64), count, flat.view(item) if item else flat))
    return meta, tensors
