"""The bytes one batch-1 decode step reads, and the tok/s the memory's bandwidth allows: how benchmarks/RESULTS.md
counts issue 42's "share of the bandwidth limit".

    python benchmarks/decode_bytes.py --model-shape llama-3-8b --bits 4 --gen-tokens 128 --tok-s 388.9
    python benchmarks/decode_bytes.py --model-shape llama-3.1-8b --bits 4 --prompt-tokens 32768 --gen-tokens 128

The count: every parameter of the model as it sits in memory (packed 4-bit words with their scales and biases, or
16-bit weights; norms included) except the input-embedding table, of which a step reads one row (a model that ties
its LM head to that table reads it whole, and it counts); plus the keys and values attended over, 2 x kv heads x head
dim x context x the model dtype's bytes a layer, the context being the timed steps' mean (the prompt and half the
generated tokens, as compare_mlx_lm.py times them). The model is built from the shape's config without evaluating any
array (sizes only: no memory, no GPU). Only plain dense decoders are counted: a family whose step reads something
else (mixture-of-experts layers read only the routed experts; sliding windows, latent or linear attention read other
KV) is refused, naming why.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlxcel_core.loading.shapes import QUANT_GROUP_SIZE, add_shape_arguments, check_shape_options, shape_config  # noqa: E402
from mlxcel_core.models import model_class_for  # noqa: E402

H200_BYTES_PER_S = 4.3e12


# Dense decoders whose every layer attends over the whole context with plain keys and values (olmo3 and
# ministral3's sliding windows aside: refused_feature checks those).
COUNTED = ("llama", "mistral", "ministral3", "qwen2", "qwen3", "granite", "smollm3", "phi3", "olmo3")


def refused_feature(config: dict) -> str | None:
    """Why this count does not cover the shape's model (what its step reads besides), or None."""
    kind = config.get("model_type")
    if kind not in COUNTED:
        return f"model type {kind!r}: only plain dense decoders are counted ({', '.join(COUNTED)})"
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        return "sliding-window attention (a layer reads only its window of the KV)"
    return None


def lazy_model(config: dict, bits: int | None, dtype: str):
    """The shape's model with parameters of the right shapes and dtypes, never evaluated."""
    model_cls, args_cls = model_class_for(config)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    if bits:  # (as loading.shapes.build_random_model quantizes a shape)
        nn.quantize(
            model,
            group_size=QUANT_GROUP_SIZE,
            bits=bits,
            class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % QUANT_GROUP_SIZE == 0,
        )
    return model


def step_bytes(model, config: dict, context: int, dtype: str) -> dict[str, int]:
    """{"weights", "embedding_left_out", "kv"}: bytes a batch-1 decode step at `context` tokens reads."""
    tied = not hasattr(model, "lm_head")  # (the LM head is the embedding table itself)
    embeddings = {name for name, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))}
    weights = left_out = 0
    for path, value in tree_flatten(model.parameters()):
        if not tied and path.rsplit(".", 1)[0] in embeddings:
            left_out += value.nbytes
        else:
            weights += value.nbytes
    args = model.args
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    kv_heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    kv = args.num_hidden_layers * 2 * kv_heads * head_dim * context * mx.zeros((), getattr(mx, dtype)).itemsize
    return {"weights": weights, "embedding_left_out": left_out, "kv": kv}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser, default_shape="llama-3-8b")
    parser.add_argument("--gen-tokens", type=int, default=0, help="decode steps timed after the prompt")
    parser.add_argument("--bandwidth", type=float, default=H200_BYTES_PER_S, help="bytes a second (H200: 4.3e12)")
    parser.add_argument("--tok-s", type=float, help="a measured decode speed, to put against the limit")
    a = parser.parse_args(argv)
    check_shape_options(a.model_shape, a.bits, a.dtype)
    config = shape_config(a.model_shape)
    refused = refused_feature(config)
    if refused:
        print(f"decode_bytes.py: {a.model_shape}: {refused}", file=sys.stderr)
        return 2
    context = a.prompt_tokens + a.gen_tokens // 2
    counted = step_bytes(lazy_model(config, a.bits, a.dtype), config, context, a.dtype)
    total = counted["weights"] + counted["kv"]
    fmt = f"{a.bits}-bit (group {QUANT_GROUP_SIZE}, {a.dtype} scales)" if a.bits else a.dtype
    print(f"{a.model_shape} {fmt}, batch 1, mean context {context} tokens")
    print(f"  weights a step reads: {counted['weights'] / 1e9:.3f} GB", end="")
    if counted["embedding_left_out"]:
        print(f" (the input embedding's {counted['embedding_left_out'] / 1e6:.1f} MB left out: one row is read)")
    else:
        print(" (the embedding table counted: the LM head reads it)")
    print(f"  KV attended over: {counted['kv'] / 1e6:.1f} MB")
    limit = a.bandwidth / total
    print(f"  total {total / 1e9:.3f} GB a token: at {a.bandwidth / 1e12:.2f} TB/s the limit is {limit:.1f} tok/s")
    if a.tok_s:
        print(f"  {a.tok_s} tok/s reads {a.tok_s * total / 1e12:.3f} TB/s: {100 * a.tok_s / limit:.1f}% of the limit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
