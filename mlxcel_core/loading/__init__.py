"""Turn a model spec (path, .gguf, Hub id, or nothing for the default) into a ready model + tokenizer."""

from .load import LoadedModel, load_model
from .resolve import DEFAULT_MODEL_NAME, ModelSource, resolve_model

__all__ = ["LoadedModel", "load_model", "ModelSource", "resolve_model", "DEFAULT_MODEL_NAME"]
