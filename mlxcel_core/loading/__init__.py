"""Turn a model spec (path, .gguf, Hub id, or nothing for the default) into a ready model + tokenizer.

`load_model` and `LoadedModel` are imported on first use: the package's MLX-free parts (resolve.py, gguf_header.py)
stay importable without MLX (`mlxcel tune --dry-run -m model.gguf` reads a GGUF header and nothing else).
"""

from .resolve import DEFAULT_MODEL_NAME, ModelSource, resolve_model

__all__ = ["LoadedModel", "load_model", "ModelSource", "resolve_model", "DEFAULT_MODEL_NAME"]


def __getattr__(name: str):
    if name in ("LoadedModel", "load_model"):
        from . import load

        return getattr(load, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
