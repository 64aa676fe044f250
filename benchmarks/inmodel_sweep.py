"""Launch configurations of the decode matvec kernels measured inside a model's decode, not alone (CUDA only).

    python benchmarks/inmodel_sweep.py --model-shape llama-3-8b --dtype bfloat16 --kind hmv
    python benchmarks/inmodel_sweep.py --model-shape llama-3-8b --bits 4 --configs 4,2,1 8,2,1 4,4,2

benchmarks/hmv.py and qmv.py time one launch shape alone; in a model the same launch ran 10-25% slower than alone
(tenth session: the fused gate/up + SwiGLU launch 68.5 us in an 8B decode, 62.3 us timed alone, where MLX's GEMV
took 55.2 us in the model), so which (ROWS, WARPS, UNROLL) is best is a question for the model itself. This builds
the model once, then for each configuration (ROWS, WARPS, UNROLL[, GROUPS]) makes the kernel's `launch_config` return
it (every mode and weight of
the kernel), drops the compiled steps traced with the old one, and decodes `--tokens` tokens under torch.profiler
(gpu_profile.py's loop) after `--warm` ones: the GPU-busy and wall time a token, and the GPU time of each of the
kernel's modes per call. Then, per mode, the configuration with the lowest time. The default candidates are the
current rule's and its neighbours; `--configs R,W,U ...` names others. One measurement per configuration: repeat the
best few before changing the rule.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import gpu_profile as gpu  # noqa: E402  (its token loop and profiler; imports mlx)

from mlxcel_core.backends.cuda.kernels import hmv, qmv  # noqa: E402
from mlxcel_core.bench import environment, random_prompt  # noqa: E402
from mlxcel_core.engine.compiled_decode import forget_traces  # noqa: E402
from mlxcel_core.loading.shapes import DTYPES, build_random_model, describe_shape, shape_config, shape_names  # noqa: E402

CANDIDATES = [
    (2, 8, 2),
    (2, 4, 2),
    (2, 2, 2),
    (2, 2, 4),
    (2, 4, 4),
    (4, 2, 2),
    (4, 4, 2),
    (4, 4, 4),
    (4, 8, 1),
    (4, 8, 2),
    (8, 2, 1),
    (8, 4, 1),
    (4, 1, 1),
    (4, 2, 1),
    # (ROWS, WARPS, UNROLL, GROUPS): several independent groups to a CUDA block; one-warp groups stream
    # whole rows as MLX's GEMV does, without the 32-blocks-a-SM cap of one-warp blocks
    (2, 1, 2, 8),
    (2, 1, 4, 8),
    (2, 1, 1, 8),
    (4, 1, 1, 8),
    (2, 2, 2, 4),
    (4, 1, 2, 4),
]
_MODE = re.compile(r"mlxcel_(hmv|qmv)_(?:([a-z_]+)_)?[0-9a-f]{8}")


def kernel_mode(name: str) -> str | None:
    """ "hmv swiglu_norm" for a launch of that kernel and mode ("plain" when the name has no mode), else None."""
    found = _MODE.search(name)
    return f"{found.group(1)} {found.group(2) or 'plain'}" if found else None


def parse_config(text: str) -> tuple[int, ...]:
    """ "R,W,U" or "R,W,U,G" (GROUPS)."""
    try:
        config = tuple(int(v) for v in text.split(","))
        if len(config) not in (3, 4) or config[0] not in (2, 4, 8):  # even rows: the pair modes need them
            raise ValueError("ROWS 2/4/8")
        qmv.unpack_launch(config)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text}: R,W,U[,G] ({e})") from None
    return config


def use_config(module, model, config: tuple[int, ...] | None, rule) -> None:
    """Every launch of `module`'s kernel takes `config` (None: the module's own rule) from the next trace on."""
    module.launch_config = rule if config is None else (lambda n, k, m, *mode: config)
    module.launch_args.cache_clear()
    forget_traces(model)


def per_mode(r: dict) -> dict[str, float]:
    """us per call of each of the kernel's modes (all weights of a mode together)."""
    calls: dict[str, list[float]] = {}
    for name, (n, us, *_) in r["by_name"].items():
        mode = kernel_mode(name)
        if mode:
            row = calls.setdefault(mode, [0, 0.0])
            row[0] += n
            row[1] += us
    return {mode: us / n for mode, (n, us) in calls.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", choices=shape_names(), default="llama-3-8b")
    parser.add_argument("--bits", type=int, choices=(4, 8))
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--kind", choices=("hmv", "qmv"), help="default: qmv with --bits, else hmv")
    parser.add_argument("--configs", type=parse_config, nargs="+", help="R,W,U ... (default: CANDIDATES)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--warm", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args(argv)
    kind = args.kind or ("qmv" if args.bits else "hmv")
    if not qmv.kernel_ready():
        print("inmodel_sweep.py needs MLX's CUDA backend (the kernels exist only there)", file=sys.stderr)
        return 1
    hidden = shape_config(args.model_shape)["hidden_size"]
    if kind == "hmv" and not hmv.enabled(hidden):
        print(
            f"inmodel_sweep.py: a 16-bit model {hidden} wide keeps MLX's GEMV (the kernel serves models up to "
            f"{hmv.DEFAULT_MAX_HIDDEN} wide): nothing to sweep",
            file=sys.stderr,
        )
        return 1
    module = hmv if kind == "hmv" else qmv
    rule = module.launch_config
    model, config = build_random_model(args.model_shape, bits=args.bits, dtype=args.dtype, seed=0)
    vocab = config["vocab_size"]
    prompt = random_prompt(vocab, args.prompt_tokens, 0, "inmodel-sweep")
    print(
        f"{describe_shape(args.model_shape, args.bits, args.dtype)}; {environment()}; {kind}; prompt "
        f"{args.prompt_tokens}, {args.warm} warm-up tokens, {args.tokens} profiled per configuration"
    )
    results: dict[str, dict] = {}
    for config in [None] + (args.configs or CANDIDATES):
        label = "rule" if config is None else ",".join(map(str, config))
        use_config(module, model, config, rule)
        try:
            r = gpu.profile_tokens(
                gpu.mlxcel_tokens(model, vocab, prompt, args.warm, args.tokens), args.warm, args.tokens
            )
        except Exception as e:  # noqa: BLE001 - a configuration the kernel cannot build (registers, limits): next
            print(f"{label:>7}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        modes = per_mode(r)
        results[label] = modes
        print(
            f"{label:>7}: wall {r['wall_ms']:.3f} ms/token, GPU busy {r['busy_ms']:.3f} ms/token | "
            + " | ".join(f"{m} {us:.2f} us" for m, us in sorted(modes.items())),
            flush=True,
        )
    use_config(module, model, None, rule)
    print("best per mode (us per call; the rule's in brackets):")
    for mode in sorted({m for modes in results.values() for m in modes}):
        timed = sorted((modes[mode], label) for label, modes in results.items() if mode in modes)
        rule_us = results["rule"].get(mode, float("nan"))
        print(
            f"  {mode:<22} {timed[0][1]:>7} {timed[0][0]:8.2f} us  [rule {rule_us:.2f}]  then "
            + ", ".join(f"{label} {us:.2f}" for us, label in timed[1:4])
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
