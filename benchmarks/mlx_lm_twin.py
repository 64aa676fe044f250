"""mlx-lm's model of an mlxcel model, holding mlxcel's own arrays: the peer runtime of the comparison benchmarks.

    theirs = build_twin(ours, config)        # mlx_lm.models.<family>.Model, quantized as ours, our arrays loaded
    agreement = compare_logits(ours, theirs, vocab)
    agreement.check(tolerance_for("bfloat16"))   # TwinMismatch above the tolerance
    print(verify_architecture("glm-4.5-air", bits=4))   # float32, scaled down, random norms and biases

compare_mlx_lm.py and batch_decode.py build mlx-lm's model this way for random-weight shapes and GGUF files (mlx-lm
cannot read GGUF). mlx-lm's parameter names are mlxcel's for every family here (mlxcel's models keep mlx-lm's
layout: MLA's embed_q / unembed_out, gpt-oss's interleaved gate/up and mxfp4 banks, Gemma 4's per-layer embeddings),
so `load_weights(strict=True)` takes our arrays as they are: the twin holds the same buffers, nothing is copied
(mlx-lm's own initial weights are lazy and never computed). What differs is spelled in SPELLINGS: the config keys
mlx-lm's ModelArgs requires, and where mlx-lm nests the tree (Llama 4 lives in mlx-lm's `llama4`, under
`language_model.`). A family mlx-lm has no model for, or computes differently (NOT_COMPARABLE), raises
TwinUnavailable: its comparison would not be fair, and the scripts skip it saying why.

Agreement is the relative RMS difference of the two models' logits on a 12-token prompt, ||a - b|| / ||a||. In
float32 the two agree to rounding (<= ARCH_TOLERANCE). In 16 bits a random-weight model at full depth is chaotic:
rounding, flipped through MoE routers and dozens of layers, takes each runtime's logits far from the float32 ones
(bf16 Q4, hidden 1024, the shapes' full depth: Moonlight 0.71 / 0.71, Gemma 4 0.66 / 0.67, gpt-oss 0.34 / 0.35 for
mlxcel / mlx-lm), and as far from each other; two unrelated logit vectors of one size differ by about 1.4. So at
16 bits HALF_TOLERANCE only refuses a broken or NaN model, and the strict check is verify_architecture's: the same
family scaled down in float32 (benchmarks/scaled_shapes.py), norms and biases random (at init they are ones and
zeros, which hides a norm or bias applied wrongly), both full-prompt logits and mlx-lm's own cached decode steps
against mlxcel's logits.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import mlxcel_core  # noqa: F401  (before mlx: MLX's CPU products on OpenBLAS, cpu_blas.py)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

ARCH_TOLERANCE = 1e-3  # float32: the same computation, rounded differently
HALF_TOLERANCE = 1.5  # 16 bits at full size: beyond two unrelated logit vectors (see above)
CHECK_TOKENS = 12
PREFILL_TOKENS = 8  # verify_architecture: mlx-lm prefills this many, then decodes the rest one token a step


class TwinUnavailable(Exception):
    """mlx-lm cannot build a model that computes what mlxcel's computes (the message says why)."""


class TwinMismatch(Exception):
    """The two models' logits differ beyond the tolerance."""


@dataclass(frozen=True)
class Spelling:
    """How mlx-lm spells a family: its module, its ModelArgs dict from our config, the prefix of our tree in its."""

    module: str
    args: Callable[[dict], dict] = dict
    prefix: str = ""
    # (our parameter path, array) -> the array in mlx-lm's layout, where it differs (a view or a small copy)
    layout: Callable[[str, mx.array], mx.array] | None = None
    # our parameter or module path -> mlx-lm's, where the names differ (after `prefix`)
    names: Callable[[str], str] | None = None
    note: str = ""  # a difference that does not change what is compared, said in the scripts' output


SPELLINGS: dict[str, Spelling] = {
    # mlx-lm's ModelArgs requires rope_scaling (None: GLM-4.5 has none).
    "glm4_moe": Spelling("glm4_moe", lambda c: {"rope_scaling": None, **c}),
    # mlx-lm's `llama4_text` is a dense model without MoE or chunked attention; its `llama4` (the released
    # checkpoints' wrapper) is Scout's text model, under `language_model.`.
    "llama4_text": Spelling(
        "llama4",
        lambda c: {"model_type": "llama4", "text_config": {"attention_bias": False, **c}},
        "language_model.",
        note="mlx-lm's q/k L2 norm takes eps 1e-6 where transformers and mlxcel take rms_norm_eps (1e-5)",
    ),
    # mlx-lm's `qwen3_5` wraps a bare text config as its text_config, under `language_model.`.
    "qwen3_5_text": Spelling("qwen3_5", prefix="language_model.", layout=lambda p, v: _qwen3_next_layout(p, v)),
    # mlx-lm's LFM2 requires block_dim (the residual width: hidden_size) and keeps the checkpoint's names; its short
    # convolutions' weights are MLX Conv1d's [channels, kernel, 1] (mlxcel: transformers' [channels, 1, kernel]).
    "lfm2": Spelling(
        "lfm2",
        lambda c: {"block_dim": c["hidden_size"], **c},
        layout=lambda path, v: v.swapaxes(1, 2) if path.endswith("conv.conv.weight") else v,
        names=lambda path: _lfm2_names(path),
    ),
}


def _qwen3_next_layout(path: str, value: mx.array) -> mx.array:
    """mlx-lm's conversion of a Qwen3-Next / Qwen3.5 checkpoint: depthwise conv weights in MLX Conv1d's
    [channels, kernel, 1] (mlxcel keeps transformers' [channels, 1, kernel]: a view), and the (1 + weight) norms
    stored with the 1 added (mlx-lm computes plain RMSNorms: a copy of those vectors)."""
    from mlxcel_core.models.qwen3_next import SHIFTED_NORMS

    if path.endswith("conv1d.weight"):
        return value.swapaxes(1, 2)
    return value + 1 if path.endswith(SHIFTED_NORMS) else value


def _lfm2_names(path: str) -> str:
    """mlxcel's LFM2 keeps the stock blocks' names (models/lfm2.py NAMES); mlx-lm keeps the checkpoint's."""
    import re

    from mlxcel_core.models.lfm2 import NAMES

    back = {ours: theirs for theirs, ours in NAMES.items()}
    pattern = r"(?<![\w])(" + "|".join(re.escape(k) for k in back) + r")(?=\.|$)"
    return re.sub(pattern, lambda m: back[m.group(1)], path)


# model_type -> why mlx-lm's model of that name computes a different architecture (none among today's shapes).
NOT_COMPARABLE: dict[str, str] = {}


def spelling_for(config: dict[str, Any]) -> Spelling:
    model_type = config.get("model_type")
    if model_type in NOT_COMPARABLE:
        raise TwinUnavailable(f"mlx-lm's '{model_type}' computes a different model: {NOT_COMPARABLE[model_type]}")
    return SPELLINGS.get(model_type, Spelling(model_type))


def mlx_lm_version() -> str:
    try:
        import mlx_lm
    except ImportError as e:
        raise TwinUnavailable("mlx-lm is not installed (pip install mlx-lm, or put it on PYTHONPATH)") from e
    return getattr(mlx_lm, "__version__", "?")


def build_twin(ours: nn.Module, config: dict[str, Any], dtype: str | None = None) -> nn.Module:
    """mlx-lm's Model for `config`, its layers quantized as ours are, holding our arrays (strict: every one).

    `dtype`: the checkpoint's float dtype. Where ours computes in another (a half-precision quantized model on the
    CPU computes in float32: loading/weights.py's float32_on_cpu), the twin holds copies in `dtype`, as mlx-lm
    loading that checkpoint would."""
    version = mlx_lm_version()
    spelling = spelling_for(config)
    try:
        module = importlib.import_module(f"mlx_lm.models.{spelling.module}")
    except ModuleNotFoundError as e:
        raise TwinUnavailable(f"mlx-lm {version} has no model for model_type '{config.get('model_type')}'") from e
    try:
        model = module.Model(module.ModelArgs.from_dict(spelling.args(config)))
    except (TypeError, KeyError, ValueError, AssertionError) as e:
        raise TwinUnavailable(f"mlx-lm {version}'s {spelling.module} cannot build this config: {e}") from e
    layout = spelling.layout or (lambda path, v: v)
    names = spelling.names or (lambda path: path)

    def path_in_twin(path: str) -> str:
        return spelling.prefix + names(path)

    quantized = {path_in_twin(path): m for path, m in ours.named_modules() if _is_quantized(m)}
    if quantized:
        nn.quantize(model, class_predicate=lambda path, m: path in quantized and _quantization(quantized[path]))
    cast = None if dtype is None or activation_dtype(ours) == getattr(mx, dtype) else getattr(mx, dtype)

    def as_loaded(v: mx.array) -> mx.array:
        return v.astype(cast) if cast is not None and mx.issubdtype(v.dtype, mx.floating) else v

    weights = [(path_in_twin(k), layout(k, as_loaded(v))) for k, v in tree_flatten(ours.parameters())]
    model.load_weights(weights, strict=True)
    model.eval()
    mx.eval(model.parameters())  # ours, already computed: nothing new is allocated (unless cast)
    return model


def _is_quantized(module: nn.Module) -> bool:
    return hasattr(module, "bits") and hasattr(module, "group_size") and "scales" in module


def _quantization(module: nn.Module) -> dict:
    return {"group_size": module.group_size, "bits": module.bits, "mode": getattr(module, "mode", "affine")}


def describe_sharing(ours: nn.Module, theirs: nn.Module) -> str:
    """The twin's parameter bytes, how many of them are not the very arrays ours holds (0: nothing copied), and what
    MLX holds now (both models together: one copy of the weights)."""
    mine = {id(v) for _, v in tree_flatten(ours.parameters())}
    arrays = [v for _, v in tree_flatten(theirs.parameters())]
    total = sum(v.nbytes for v in arrays)
    copied = sum(v.nbytes for v in arrays if id(v) not in mine)
    return (
        f"mlx-lm's parameters {_size(total)}, {_size(copied)} of them not mlxcel's own arrays; "
        f"MLX active memory {_size(mx.get_active_memory())}"
    )


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Agreement:
    max_abs: float  # largest |logit difference|
    rel: float  # ||a - b|| / ||a|| over every logit of the check
    top1: float  # share of positions where both pick the same token

    def describe(self) -> str:
        return f"max |logit diff| {self.max_abs:.3g}, relative {self.rel:.2e}, same argmax {self.top1:.0%}"

    def check(self, tolerance: float, what: str = "mlxcel vs mlx-lm") -> None:
        if not self.rel <= tolerance:  # (NaN fails too)
            raise TwinMismatch(
                f"{what}: logits differ beyond tolerance ({self.describe()}; tolerance {tolerance:.2e} relative): "
                "the two runtimes do not compute the same model, so their speeds are not comparable"
            )


def tolerance_for(dtype: str) -> float:
    return ARCH_TOLERANCE if dtype == "float32" else HALF_TOLERANCE


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype a model computes in: its norm weights' (never quantized), e.g. for the KV cache's values."""
    vectors = [
        v.dtype for _, v in tree_flatten(model.parameters()) if v.ndim == 1 and mx.issubdtype(v.dtype, mx.floating)
    ]
    return max(set(vectors), key=vectors.count) if vectors else mx.bfloat16


def agreement_of(a: mx.array, b: mx.array) -> Agreement:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    diff = a - b
    rel = mx.sqrt((diff * diff).sum()) / mx.maximum(mx.sqrt((a * a).sum()), 1e-30)
    same = (mx.argmax(a, axis=-1) == mx.argmax(b, axis=-1)).astype(mx.float32).mean()
    return Agreement(float(mx.abs(diff).max()), float(rel), float(same))


def check_twin(ours: nn.Module, theirs: nn.Module, config: dict, vocab: int, say, tolerance: float | None = None):
    """Say how the twin agrees with ours (logits, a known difference of mlx-lm's), raise TwinMismatch beyond
    `tolerance` (None: tolerance_for the coarser of the two dtypes), then say the memory both hold and each one's KV
    bytes per token."""
    from mlxcel_core.engine.budget import kv_bytes_per_token

    agreement = compare_logits(ours, theirs, vocab)
    say(f"mlxcel vs mlx-lm {mlx_lm_version()} on the same weights: {agreement.describe()}")
    if note := spelling_for(config).note:
        say(f"mlx-lm differs, beyond rounding: {note}")
    dtype = activation_dtype(ours)
    coarser = max((dtype, activation_dtype(theirs)), key=lambda d: tolerance_for(str(d).split(".")[-1]))
    agreement.check(tolerance if tolerance is not None else tolerance_for(str(coarser).split(".")[-1]))
    say(describe_sharing(ours, theirs))
    say(
        f"KV cache bytes per token: mlxcel {kv_bytes_per_token(ours, dtype_bytes=dtype.size)}, "
        f"mlx-lm {mlx_lm_kv_bytes_per_token(theirs)}"
    )
    return agreement


def check_ids(vocab: int, n: int = CHECK_TOKENS) -> mx.array:
    from mlxcel_core.bench import random_prompt

    return mx.array([random_prompt(vocab, n, "twin-check")])


def compare_logits(ours: nn.Module, theirs: nn.Module, vocab: int) -> Agreement:
    ids = check_ids(vocab)
    return agreement_of(ours(ids), theirs(ids))


def decode_logits(theirs: nn.Module, ids: mx.array, prefill: int = PREFILL_TOKENS) -> mx.array:
    """mlx-lm's logits for ids[prefill:], each from its own cache (make_prompt_cache), one token a step."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(theirs)
    theirs(ids[:, :prefill], cache=cache)
    steps = [theirs(ids[:, i : i + 1], cache=cache) for i in range(prefill, ids.shape[1])]
    return mx.concatenate(steps, axis=1)


def mlx_lm_kv_bytes_per_token(theirs: nn.Module) -> int:
    """Bytes a token takes in mlx-lm's cache: after a 1-token forward, each layer cache's keys and values per position
    (they are allocated 256 positions at a time), summed over the caches make_prompt_cache makes."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(theirs)
    theirs(mx.array([[0]]), cache=cache)
    return sum(_per_position(entry) for entry in cache)


def _per_position(entry) -> int:
    if hasattr(entry, "caches"):  # a CacheList
        return sum(_per_position(c) for c in entry.caches)
    total = 0
    for name in ("keys", "values"):
        arrays = getattr(entry, name, None)
        for a in arrays if isinstance(arrays, (list, tuple)) else [arrays]:
            if isinstance(a, mx.array):
                total += a.nbytes // a.shape[-2]
    return total


def batch_generator_refusal(theirs: nn.Module) -> str | None:
    """Why mlx-lm's BatchGenerator cannot run this model, at any batch size (it merges every new row's cache into the
    batch's, and some cache kinds have no merge), or None when it can."""
    from mlx_lm.models.cache import make_prompt_cache

    def leaves(entry):
        return [leaf for c in entry.caches for leaf in leaves(c)] if hasattr(entry, "caches") else [entry]

    kinds = sorted({type(c).__name__ for e in make_prompt_cache(theirs) for c in leaves(e) if not hasattr(c, "merge")})
    if not kinds:
        return None
    return f"mlx-lm {mlx_lm_version()}'s BatchGenerator cannot batch this model: its {', '.join(kinds)} has no merge"


def randomize_vectors(model: nn.Module, seed: int = 1) -> None:
    """Norm weights uniform in [0.5, 1.5], every other 1-D parameter (biases, sinks, router corrections) in
    [-0.3, 0.3]: what random matrices leave at ones and zeros. The backend's preparation is redone around it
    (fused projections hold copies of the biases)."""
    from mlxcel_core import backends

    backends.current().unprepare_model(model)
    key = mx.random.key(seed)
    new = []
    for path, value in tree_flatten(model.parameters()):
        if value.ndim != 1:
            continue
        key, sub = mx.random.split(key)
        low, high = (0.5, 1.5) if path.endswith("norm.weight") else (-0.3, 0.3)
        new.append((path, mx.random.uniform(low, high, value.shape, key=sub).astype(value.dtype)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    backends.current().prepare_model(model)


def verify_architecture(shape: str, bits: int | None = None, seed: int = 0) -> str:
    """Build `shape` scaled down in float32 (with `bits`, as the run quantizes), random 1-D parameters, and its
    twin; TwinMismatch unless mlx-lm's full-prompt logits and its cached decode steps agree with ours within
    ARCH_TOLERANCE. Returns one line saying what agreed."""
    from scaled_shapes import scaled_down

    from mlxcel_core.loading.shapes import build_random_model, shape_config

    config, _ = scaled_down(shape_config(shape))
    ours, config = build_random_model(shape, bits=bits, dtype="float32", seed=seed, config=config)
    randomize_vectors(ours, seed + 1)
    theirs = build_twin(ours, config)
    ids = check_ids(config["vocab_size"])
    reference = ours(ids)
    prefill = agreement_of(reference, theirs(ids))
    prefill.check(ARCH_TOLERANCE, "float32 scaled-down check, full prompt")
    decode = agreement_of(reference[:, PREFILL_TOKENS:], decode_logits(theirs, ids))
    decode.check(ARCH_TOLERANCE, "float32 scaled-down check, mlx-lm's cached decode")
    return (
        f"float32 scaled-down {shape} (random norms and biases) agrees: prompt {prefill.rel:.1e}, "
        f"mlx-lm decode steps {decode.rel:.1e} relative (tolerance {ARCH_TOLERANCE:.0e})"
    )


def add_twin_arguments(parser) -> None:
    """The comparison scripts' shared options: --scale-down, --logit-tolerance, --no-arch-check (argparse)."""
    parser.add_argument(
        "--scale-down", action="store_true", help="the shape at test size (a smoke test, not the shape's speed)"
    )
    parser.add_argument(
        "--logit-tolerance",
        type=float,
        help=f"largest relative logit difference accepted (default {tolerance_for('float32')} for float32, "
        f"{tolerance_for('bfloat16')} for 16-bit)",
    )
    parser.add_argument(
        "--no-arch-check", action="store_true", help="skip the float32 scaled-down agreement check of the family"
    )
