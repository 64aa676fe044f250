"""GGUF Q4_K against MLX 4-bit (group 32) on the same weights: decode tok/s of both through mlxcel, interleaved.

    python benchmarks/gguf_speed.py --model-shape llama-3.2-1b                            # the full shape
    python benchmarks/gguf_speed.py --model-shape llama-3.2-1b --layers 4 --vocab 32768   # a quick CPU run
    python benchmarks/gguf_speed.py --model-shape llama-3.2-1b --scaled --gen-tokens 8    # test size

A llama-family shape (mlxcel_core/loading/shape_table.py; `--layers`/`--vocab` shrink it, `--scaled` takes its
test-size copy from scaled_shapes.py) gets random weights
(normal * 0.02, norms ones), written as a GGUF whose every 2-D weight, embedding included, is Q4_K as encoded by
ggml's own quantize_row_q4_K (the `libgguf` package, run on all cores); mlxcel loads each as 4-bit affine groups of
32 (scale d*sc, bias -dmin*m: exact). `mlxcel convert` turns that file into an MLX 4-bit group-32 safetensors
checkpoint: the same packed weights, with scales, biases and norms in `--dtype` (auto: the dtype the GGUF path
keeps scales in on this device, fp32 on the CPU and fp16 on a GPU, so both read the same bytes). A llama3 rope
scaling is left out of both (it changes rope frequencies, not the work).

Both models load as `mlxcel bench -m` loads a checkpoint (load_bench_model) and run bench's tg test (a 1-token
prompt, then `--gen-tokens` decode steps): one untimed run each, then `--reps` rounds alternating which goes first.
Printed: each side's median decode tok/s, the ratio GGUF / MLX, and the weight bytes each reads per decode step
(every parameter, less the embedding table where a separate lm_head reads it a row at a time). Needs no network;
the `gguf` package is a core dependency and `libgguf` the test extra's: without it this says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

QK_K = 256  # Q4_K's super-block: every row length must be a multiple of it


def parse_args(argv=None) -> argparse.Namespace:
    from mlxcel_core.loading.shapes import shape_names

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", choices=shape_names(), default="llama-3.2-1b")
    p.add_argument("--layers", type=int, help="keep this many layers of the shape")
    p.add_argument("--vocab", type=int, help="use this vocabulary size instead of the shape's")
    p.add_argument("--scaled", action="store_true", help="the shape's test-size copy (benchmarks/scaled_shapes.py)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, help="keep the GGUF file and the MLX checkpoint here (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line as well")
    return p.parse_args(argv)


def refuse(message: str):
    """One line on stderr and exit status 2."""
    print(f"gguf_speed: {message}", file=sys.stderr)
    raise SystemExit(2)


def benchmark_config(args: argparse.Namespace) -> dict:
    """The shape's config with the requested cuts; refused for a shape Q4_K cannot hold."""
    from mlxcel_core.loading.shapes import shape_config

    config = shape_config(args.model_shape)
    if config.get("model_type") != "llama":
        refuse(f"--model-shape must be a llama-family shape, got {args.model_shape}")
    config.pop("rope_scaling", None)
    if args.scaled:
        from scaled_shapes import scaled_down

        config = scaled_down(config)[0]
    if args.layers:
        config["num_hidden_layers"] = args.layers
    if args.vocab:
        config["vocab_size"] = args.vocab
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rows = {"hidden_size": config["hidden_size"], "intermediate_size": config["intermediate_size"]}
    rows["attention output"] = heads * head_dim
    bad = [f"{k} {v}" for k, v in rows.items() if v % QK_K]
    if bad:
        refuse(f"Q4_K needs row lengths that are multiples of {QK_K}: {', '.join(bad)}")
    return config


def _q4_k(x: np.ndarray, workers: int) -> np.ndarray:
    """ggml's Q4_K bytes of the rows of `x` (float32), rows split over `workers` threads."""
    import libgguf

    qtype = libgguf.GGMLQuantizationType.Q4_K
    slabs = np.array_split(x, max(1, min(workers, x.shape[0] // 64)))
    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(lambda s: np.asarray(libgguf.quantize_rows(np.ascontiguousarray(s), qtype)), slabs))
    return np.concatenate(parts)


def _tensors(config: dict):
    """(GGUF name, shape, is a norm) of a llama model, in llama.cpp's names and [out, in] shapes."""
    h, ffn, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    yield "token_embd.weight", (v, h), False
    for i in range(config["num_hidden_layers"]):
        b = f"blk.{i}"
        yield f"{b}.attn_norm.weight", (h,), True
        yield f"{b}.attn_q.weight", (heads * hd, h), False
        yield f"{b}.attn_k.weight", (kv * hd, h), False
        yield f"{b}.attn_v.weight", (kv * hd, h), False
        yield f"{b}.attn_output.weight", (h, heads * hd), False
        yield f"{b}.ffn_norm.weight", (h,), True
        yield f"{b}.ffn_gate.weight", (ffn, h), False
        yield f"{b}.ffn_up.weight", (ffn, h), False
        yield f"{b}.ffn_down.weight", (h, ffn), False
    yield "output_norm.weight", (h,), True
    if not config.get("tie_word_embeddings", False):
        yield "output.weight", (v, h), False


def llama_writer(config: dict, path: Path, name: str, file_type):
    """A GGUFWriter of a llama file with the shape's hyperparameters and a placeholder vocabulary: pieces of the
    shape's count and one merge (llama.cpp wants merges with a gpt2 vocabulary); benchmarks feed token ids, never
    text. The tensors are the caller's."""
    import gguf

    heads = config["num_attention_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(config.get("num_key_value_heads") or heads)
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_file_type(file_type)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["a", "b", "ab"] + [f"<t{i}>" for i in range(3, config["vocab_size"])])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    return w


def write_gguf(config: dict, path: Path, seed: int, log) -> None:
    """The shape as a llama GGUF: random weights, every matrix Q4_K (ggml's quantizer), norms F32 ones."""
    import gguf

    w = llama_writer(config, path, "gguf_speed random weights", gguf.LlamaFileType.MOSTLY_Q4_K_S)
    rng = np.random.default_rng(seed)
    workers = os.cpu_count() or 1
    start = time.perf_counter()
    for name, shape, norm in _tensors(config):
        if norm:
            w.add_tensor(name, np.ones(shape, np.float32))
            continue
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        w.add_tensor(name, _q4_k(x, workers), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    log(
        f"wrote {path.name} ({path.stat().st_size / 1e6:.0f} MB, Q4_K by libgguf on {workers} threads) "
        f"in {time.perf_counter() - start:.0f} s"
    )


def gguf_scale_dtype() -> str:
    """The dtype the GGUF load path computes this file in on this device (loading/gguf.py: float32 on the CPU, the
    file's half dtype elsewhere: float16 for this Q4_K llama)."""
    import mlx.core as mx

    return "float32" if mx.default_device() == mx.cpu else "float16"


def write_mlx(gguf_path: Path, out: Path, dtype: str, log) -> None:
    """`mlxcel convert GGUF OUT --dtype DTYPE`: the same packed 4-bit weights as an MLX checkpoint."""
    from mlxcel_core.convert import ConvertOptions, convert

    start = time.perf_counter()
    result = convert(str(gguf_path), out, ConvertOptions(dtype=dtype, force=True))
    log(f"converted to MLX {result.quantization} in {dtype} in {time.perf_counter() - start:.0f} s")


def step_bytes(model) -> int:
    """Weight bytes one decode step reads: every parameter, less the embedding table where a separate lm_head
    exists (the step gathers one row of it)."""
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    untied = any(k.startswith("lm_head") for k in params)
    return sum(v.nbytes for k, v in params.items() if not (untied and "embed_tokens" in k))


def dtypes(model) -> str:
    """The float dtypes of the model's parameters (scales, biases, norms), for the report."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    found = {str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())}
    return "/".join(sorted(d for d in found if mx.issubdtype(getattr(mx, d), mx.floating)))


def time_decode(models: dict, n_gen: int, reps: int, seed: int, log) -> dict[str, list[float]]:
    """tok/s of each model's tg test, one untimed run each, then `reps` rounds alternating the order."""
    from mlxcel_core.bench import BenchConfig, BenchTest, bench_prompts, engine_for, measure_test

    test, config = BenchTest(n_prompt=0, n_gen=n_gen), BenchConfig()
    engines = {k: engine_for(m, test, config) for k, m in models.items()}
    prompts = {k: bench_prompts(m, test, seed)[0] for k, m in models.items()}
    for k in models:
        measure_test(engines[k], test, prompts[k], None)
    rates: dict[str, list[float]] = {k: [] for k in models}
    order = list(models)
    for r in range(reps):
        for k in order if r % 2 == 0 else order[::-1]:
            seconds = measure_test(engines[k], test, prompts[k], None).seconds
            rates[k].append(n_gen / seconds)
        log(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items()))
    return rates


def run(args: argparse.Namespace, log=print) -> dict:
    try:
        import libgguf  # noqa: F401
    except ImportError:
        refuse("the libgguf package (ggml's Q4_K quantizer) is not installed: pip install libgguf")
    from mlxcel_core.bench import load_bench_model

    config = benchmark_config(args)
    dtype = gguf_scale_dtype() if args.dtype == "auto" else args.dtype
    cuts = (("scaled", args.scaled), ("layers", args.layers), ("vocab", args.vocab))
    shape = args.model_shape + "".join(f" {k}={v}" for k, v in cuts if v)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        gguf_path, mlx_dir = work / "model-q4_k.gguf", work / f"model-mlx-q4-g32-{dtype}"
        if not gguf_path.is_file():
            write_gguf(config, gguf_path, args.seed, log)
        if not (mlx_dir / "config.json").is_file():
            write_mlx(gguf_path, mlx_dir, dtype, log)
        models = {
            "gguf": load_bench_model(model=str(gguf_path), log=log),
            "mlx": load_bench_model(model=str(mlx_dir), log=log),
        }
        rates = time_decode(models, args.gen_tokens, args.reps, args.seed, log)
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "shape": shape,
        "gen_tokens": args.gen_tokens,
        "reps": args.reps,
        "gguf_tok_s": round(med["gguf"], 2),
        "mlx_tok_s": round(med["mlx"], 2),
        "ratio": round(med["gguf"] / med["mlx"], 3),
        "gguf_step_bytes": step_bytes(models["gguf"].model),
        "mlx_step_bytes": step_bytes(models["mlx"].model),
        "gguf_dtypes": dtypes(models["gguf"].model),
        "mlx_dtypes": dtypes(models["mlx"].model),
        "gguf_model": models["gguf"].description,
        "mlx_model": models["mlx"].description,
    }
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    from mlxcel_core.bench import environment

    env = environment()
    print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    r = run(args)
    print(f"shape: {r['shape']}, tg{r['gen_tokens']} after a 1-token prompt, median of {r['reps']} interleaved rounds")
    print(
        f"GGUF Q4_K   ({r['gguf_model']}, {r['gguf_dtypes']}): {r['gguf_tok_s']:.2f} tok/s, "
        f"{r['gguf_step_bytes'] / 1e6:.1f} MB of weights a step"
    )
    print(
        f"MLX 4b g32  ({r['mlx_model']}, {r['mlx_dtypes']}): {r['mlx_tok_s']:.2f} tok/s, "
        f"{r['mlx_step_bytes'] / 1e6:.1f} MB of weights a step"
    )
    print(f"ratio GGUF / MLX: {r['ratio']:.3f}")
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
