"""mlxcel's engine: models, weights, tokenizer, cache, sampling, engine.

Public API (imported lazily so `mlxcel_core.errors` stays cheap to import)::

    from mlxcel_core import load_model, generate, stream_generate, prepare_prompt, SamplingParams
    lm = load_model()                       # default model; or a path, .gguf, or Hub repo id
    print(generate(lm, "What is the capital of France?").text)
"""

import os
from importlib import import_module

from . import cpu_blas, paths

# float32 means float32: MLX's CUDA backend otherwise runs float32 matmuls as TF32 (about 1e-3 relative error;
# transformers parity and greedy tokens on float32 models drift). 16-bit and quantized models are unaffected.
# MLX reads the variable when it initializes, so this must run before mlx is first imported; set
# MLX_ENABLE_TF32=1 to trade that precision for speed.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
paths.keep_driver_cache()  # (also read when CUDA initializes)
cpu_blas.install()  # (MLX binds its BLAS symbols when it loads: before mlx is first imported)

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "mlxcel_core.loading",
    "LoadedModel": "mlxcel_core.loading",
    "generate": "mlxcel_core.api",
    "stream_generate": "mlxcel_core.api",
    "prepare_prompt": "mlxcel_core.api",
    "GenerationResult": "mlxcel_core.api",
    "GenerationChunk": "mlxcel_core.api",
    "GenerationStats": "mlxcel_core.api",
    "SamplingParams": "mlxcel_core.sampling",
    "Constraint": "mlxcel_core.constraints",
    "Engine": "mlxcel_core.engine",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mlxcel_core' has no attribute {name!r}")
