"""The model a benchmark measures: loaded from a path or built from a random-weight shape (`load_bench_model`),
with the tokenizer the bench engine uses (random ids, no EOS, no text) and the header line that names the model,
its weights and the backend's settings (`bench_header`, `environment`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from . import __version__
from .errors import InputError


def environment() -> dict[str, str]:
    """mlxcel and mlx versions, the backend ("mlx-cpu", "mlx-metal", "mlx-cuda") and the device in words."""
    import mlx.core as mx

    device = mx.default_device()
    cuda = mx.cuda.is_available() if hasattr(mx, "cuda") else None
    metal = mx.metal.is_available() if hasattr(mx, "metal") else None
    if device.type == mx.DeviceType.gpu:
        kind = "cuda" if cuda else "metal" if metal else "gpu"
    else:
        kind = "cpu"
    words = (
        f"{device}"
        + (f", cuda available: {cuda}" if cuda is not None else "")
        + (f", metal available: {metal}" if metal is not None else "")
    )
    return {"mlxcel_version": __version__, "mlx_version": mx.__version__, "backend": f"mlx-{kind}", "device": words}


@dataclass
class BenchModel:
    model: Any  # the CausalLM
    vocab_size: int
    description: str
    filename: str
    n_params: int
    size_bytes: int


class RandomIdTokenizer:
    """What the engine needs from a tokenizer when prompts are random ids: no EOS, no text."""

    eos_token_ids: frozenset[int] = frozenset()
    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def decode(self, ids: list[int]) -> str:
        return ""


def load_bench_model(
    model: str | None = None,
    shape: str | None = None,
    bits: int | None = None,
    dtype: str | None = None,
    seed: int = 0,
    log: Callable[[str], None] = lambda m: None,
    group=None,
    adapter_path: str | None = None,
) -> BenchModel:
    """A checkpoint (`model`, as for generate; None = the default model) or a random-weight `shape`.

    `group` (size > 1): this rank's tensor-parallel shard (a shape is drawn layer by layer with the same seed on every
    rank, each layer sliced before the next; parameter counts and sizes are then this rank's)."""
    from .loading.shapes import (
        build_random_model,
        check_shape_options,
        count_parameters,
        describe_shape,
    )

    if model is not None and shape is not None:
        raise InputError("give either -m/--model or --model-shape, not both")
    if adapter_path is not None and shape is not None:
        raise InputError("--adapter-path applies to a checkpoint (-m), not to --model-shape")
    if shape is None:
        if bits is not None or dtype is not None:
            raise InputError("--bits and --dtype apply to --model-shape only (a checkpoint keeps its own)")
        from .loading import load_model

        loaded = load_model(model, log=log, group=group, adapter_path=adapter_path)
        n_params, size = count_parameters(loaded.model)
        config = loaded.config
        vocab = (
            config.get("vocab_size")
            or (config.get("text_config") or {}).get("vocab_size")
            or loaded.tokenizer.vocab_size
        )
        description = f"{config.get('model_type', 'model')} {human_count(n_params)} {_weights_kind(loaded.model)}"
        return BenchModel(loaded.model, int(vocab), description, str(loaded.source.path), n_params, size)
    dtype = dtype or "bfloat16"
    check_shape_options(shape, bits, dtype)
    log(f"building {shape} with random weights ({describe_shape(shape, bits, dtype)})")
    built, config = build_random_model(shape, bits=bits, dtype=dtype, seed=seed, group=group)
    n_params, size = count_parameters(built)
    return BenchModel(built, config["vocab_size"], describe_shape(shape, bits, dtype), shape, n_params, size)


def _weights_kind(model) -> str:
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    bits = {m.bits for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    if bits:
        return "Q" + "/".join(str(b) for b in sorted(bits))
    dtypes = {str(v.dtype).replace("mlx.core.", "") for _, v in tree_flatten(model.parameters())}
    return "/".join(sorted(dtypes))


def human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def bench_header(bench_model: BenchModel, env: dict[str, str] | None = None) -> str:
    """Versions, device, model, and the backend's settings that apply here: the decode-step compilation and the
    batched prefill are named only where the backend turns them on (a GPU), not on CPU, where steps run op by op
    and waiting prompts prefill one at a time."""
    from . import backends
    from .engine.compiled_decode import compile_enabled, describe_decode_steps

    env = env or environment()
    backend = backends.current()
    settings = [backend.describe()]
    if compile_enabled():
        settings.insert(0, f"decode steps {describe_decode_steps()}")
    if backend.prefill_batch() > 1:
        settings.append(f"waiting prompts prefilled together: up to {backend.prefill_batch()}")
    return (
        f"mlxcel {env['mlxcel_version']}, mlx {env['mlx_version']}, backend {env['backend']} ({env['device']}); "
        f"model: {bench_model.description}, {human_count(bench_model.n_params)} params, "
        f"{bench_model.size_bytes / 2**30:.2f} GiB ({bench_model.filename}); " + "; ".join(settings)
    )


# -- timing (the engine runs themselves: bench_runs.py) -----------------------------------------------------
