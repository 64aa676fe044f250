"""GGUF hyper-parameters: `<arch>.<key>` metadata lookups and the config helpers several architectures share.

MLX-free (like gguf_arch.py), so `mlxcel tune -m FILE.gguf --dry-run` reads a file's geometry without MLX; the
per-architecture modules (gguf_gemma4.py, gguf_hybrid.py, gguf_mla.py) import these instead of gguf_arch.py,
which imports them.
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptModelError

GEMMA_SLIDING, GEMMA_FULL = "sliding_attention", "full_attention"


class Meta:
    """`<arch>.<key>` metadata lookups with one error for a missing hyper-parameter."""

    def __init__(self, meta: dict[str, Any], arch: str, tensor_names: set[str]):
        self.meta, self.arch, self.names = meta, arch, tensor_names

    def has(self, key: str) -> bool:
        return self.meta.get(f"{self.arch}.{key}") is not None

    def get(self, key: str, default=None):
        value = self.meta.get(f"{self.arch}.{key}")
        if value is None:
            return default
        return as_scalar(value)

    def array(self, key: str):
        value = self.meta.get(f"{self.arch}.{key}")
        return None if value is None else as_list(value)

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise CorruptModelError(f"GGUF metadata has no '{self.arch}.{key}' (a {self.arch} hyper-parameter)")
        return value


def as_scalar(value):
    """A metadata scalar as a Python value (mx.load gives 0-d arrays, the gguf package numpy scalars)."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist") and getattr(value, "size", 2) == 1:
        return value.tolist()[0]
    return value


def as_list(value) -> list:
    if hasattr(value, "tolist"):
        out = value.tolist()
        return out if isinstance(out, list) else [out]
    return list(value)


def sliding_layer_types(config: dict, m: Meta, period: int | None) -> None:
    """`layer_types` from `attention.sliding_window_pattern` (one flag per layer, or a period), else from llama.cpp's
    fixed period for the architecture (every `period`-th layer global; None: all global)."""
    n = config["num_hidden_layers"]
    value = m.meta.get(f"{m.arch}.attention.sliding_window_pattern")
    if value is not None and not isinstance(as_scalar(value), int | float):
        flags = [bool(f) for f in as_list(value)]
        if len(flags) != n:
            raise CorruptModelError(
                f"GGUF {m.arch}.attention.sliding_window_pattern has {len(flags)} flags for {n} layers"
            )
        config["layer_types"] = [GEMMA_SLIDING if f else GEMMA_FULL for f in flags]
        return
    if value is not None:
        period = int(as_scalar(value))
    if period is None:
        config["layer_types"] = [GEMMA_FULL] * n
    else:
        config["layer_types"] = [GEMMA_SLIDING if (i + 1) % period else GEMMA_FULL for i in range(n)]
