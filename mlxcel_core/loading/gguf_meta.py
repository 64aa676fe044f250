"""A GGUF file's metadata (its key/value header) read with the standard library: no tensor is read, no MLX imported.

For callers that need a model's hyper-parameters without loading it (`mlxcel tune -m model.gguf`). Layout (GGUF
v2/v3, little-endian): magic "GGUF", uint32 version, uint64 tensor count, uint64 key/value count, then each key
(uint64 length + UTF-8) with a uint32 value type and the value; arrays are uint32 element type + uint64 count +
elements. Arrays come back as lists, except string arrays (the vocabulary), which are skipped and come back as
their length only: reading them is most of the header's size and no caller here needs them.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import CorruptModelError, UnsupportedModelError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class SkippedStrings(int):
    """A string array's length, stood in for the strings themselves."""


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Every key/value of the header; CorruptModelError when the file is not GGUF or ends early."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CorruptModelError(f"{path} is not a GGUF file (no GGUF magic)")
            version, _tensors, count = _unpack(f, "<IQQ")
            if version not in (2, 3):
                raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            return {_string(f): _value(f, _unpack(f, "<I")[0]) for _ in range(count)}
    except OSError as exc:
        raise CorruptModelError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise CorruptModelError(f"{path}: malformed GGUF metadata ({exc})") from None


def _unpack(f: BinaryIO, fmt: str) -> tuple:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("the file ends inside its metadata")
    return struct.unpack(fmt, data)


def _string(f: BinaryIO) -> str:
    (n,) = _unpack(f, "<Q")
    data = f.read(n)
    if len(data) != n:
        raise ValueError("the file ends inside a string")
    return data.decode("utf-8")


def _value(f: BinaryIO, kind: int):
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])[0]
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        element, n = _unpack(f, "<IQ")
        if element == _STRING:
            for _ in range(n):
                (length,) = _unpack(f, "<Q")
                f.seek(length, 1)
            return SkippedStrings(n)
        if element in _SCALARS:
            fmt = _SCALARS[element]
            return list(_unpack(f, "<" + fmt[1] * n)) if n else []
        return [_value(f, element) for _ in range(n)]
    raise ValueError(f"unknown value type {kind}")


def attention_geometry(meta: dict[str, Any]) -> dict[str, int]:
    """head_dim / q_heads / kv_heads from `<arch>.attention.*` (head_dim: key_length, else embedding / heads).
    ValueError naming what is missing or what varies by layer."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError("the GGUF metadata has no general.architecture")

    def one(key: str):
        value = meta.get(f"{arch}.{key}")
        if isinstance(value, list):  # per-layer values: one geometry only when they agree
            if len(set(value)) != 1:
                raise ValueError(f"{arch}.{key} differs between layers ({sorted(set(value))}); pass the geometry flags")
            value = value[0]
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    q_heads = one("attention.head_count")
    if q_heads is None:
        raise ValueError(f"the GGUF metadata has no {arch}.attention.head_count")
    kv_heads = one("attention.head_count_kv") or q_heads
    head_dim = one("attention.key_length")
    if head_dim is None:
        hidden = one("embedding_length")
        if hidden is None:
            raise ValueError(f"the GGUF metadata has neither {arch}.attention.key_length nor {arch}.embedding_length")
        head_dim = hidden // q_heads
    return {"head_dim": head_dim, "q_heads": q_heads, "kv_heads": kv_heads}
