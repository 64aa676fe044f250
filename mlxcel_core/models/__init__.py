"""Model registry keyed by config.json's `model_type`; one module per family."""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import UnsupportedModelError

# model_type -> module under mlxcel_core.models
REGISTRY: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "smollm2": "llama",
    "smollm3": "smollm3",
    "granite": "granite",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
    "olmo3": "olmo3",
    "ministral3": "ministral3",
    "llama4": "llama4",
    "llama4_text": "llama4",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_next": "qwen3_next",
    "lfm2": "lfm2",
    "nemotron_h": "nemotron_h",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "mixtral": "mixtral",
    "gpt_oss": "gpt_oss",
    "glm4_moe": "glm4_moe",
    "deepseek_v3": "deepseek_v3",
}


def supported_model_types() -> list[str]:
    return sorted(REGISTRY)


def model_class_for(config: dict[str, Any]):
    """Return (Model, ModelArgs) for a config dict; raise a clear error for unknown families."""
    model_type = config.get("model_type")
    if model_type is None:
        raise UnsupportedModelError("config.json has no 'model_type'")
    module_name = REGISTRY.get(model_type)
    if module_name is None:
        raise UnsupportedModelError(
            f"model_type '{model_type}' is not supported (supported: {', '.join(supported_model_types())})"
        )
    module = importlib.import_module(f"{__name__}.{module_name}")
    return module.Model, module.ModelArgs
