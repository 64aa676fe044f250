"""Where each request's time to first token goes, request after request on one Engine (as `mlxcel serve` keeps one).

    python benchmarks/request_phases.py --model-shape llama-3.2-1b --dtype bfloat16 --prompt-tokens 512 --requests 4
    python benchmarks/request_phases.py --model-shape llama-3.2-1b --dtype bfloat16 --no-graph   # MLX's decode steps

It sends the same prompt --requests times (the prefix cache emptied before each, as compare_mlx_lm does;
--mlx-lm-between runs mlx-lm on it between requests, as compare's other turn) and prints, per request: TTFT, each of
its first engine steps (what it did: prefill tokens, MLX decode, graph recordings / adoptions / replays) and the time
spent inside the pieces most likely to stall once (kernel compiles, the graph's settle / pool check / adoption /
recording, the runner's prefill and decode), and the kernel cache files it added: a first request that is slower than
the later ones shows which piece stalled (benchmarks/RESULTS.md, "Serving: cold start and the first request").
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlxcel_core  # noqa: F401,E402  (before mlx: MLX's CPU products on OpenBLAS, cpu_blas.py)

# isort: split
import mlx.core as mx  # noqa: E402
from compare_mlx_lm import build_twin, mlxcel_engine  # noqa: E402

from mlxcel_core import backends  # noqa: E402
from mlxcel_core.bench import forget_cached_prefixes, random_prompt  # noqa: E402
from mlxcel_core.engine import Engine, EngineConfig  # noqa: E402
from mlxcel_core.loading.shapes import DTYPES, build_random_model, shape_names  # noqa: E402
from mlxcel_core.paths import use_kernel_cache  # noqa: E402
from mlxcel_core.sampling import SamplingParams  # noqa: E402

SPENT: dict[str, float] = defaultdict(float)  # piece -> seconds, this request
CALLS: dict[str, int] = defaultdict(int)


def timed_piece(owner, attr: str, label: str) -> None:
    """Wrap owner.attr so its time and calls add up under `label` (nested pieces are counted in both)."""
    inner = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - t
            CALLS[label] += 1

    setattr(owner, attr, wrapper)


def counters(engine: Engine) -> tuple[int, int, int, int]:
    """(prompt tokens computed, graph recordings, adoptions, replays) so far. Engine.stats() has the first and the
    last; recordings and adoptions are the CUDA replayer's own counters (this script times its parts anyway)."""
    stats, graph = engine.stats(), engine.graph
    recorded, adopted = (graph.recorded, graph.adopted) if graph is not None else (0, 0)
    return (stats.prefill_tokens, recorded, adopted, stats.graph_replayed or 0)


def describe(before: tuple, after: tuple) -> str:
    names = ("prefill", "recorded", "adopted", "replayed")
    done = [f"{n} +{b - a}" for n, a, b in zip(names, before, after) if b != a]
    return ", ".join(done) or "MLX decode / read"


def kernel_files(directory: Path | None) -> set[str]:
    """The files of MLX's kernel cache (its own JIT kernels and our cubins live there; None off CUDA)."""
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()} if directory else set()


def one_request(engine: Engine, prompt: list[int], gen: int, show_steps: int, kernels: Path | None) -> None:
    forget_cached_prefixes(engine)
    files = kernel_files(kernels)
    SPENT.clear()
    CALLS.clear()
    steps = []
    first = None
    t0 = time.perf_counter()
    seq = engine.open(prompt, SamplingParams(max_tokens=gen + 1))
    while engine.has_work():
        before, t = counters(engine), time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps.append((now - t, describe(before, counters(engine))))
        for out in outputs:
            if out.finish_reason == "error":
                raise RuntimeError(out.error)
            if out.token is not None and first is None:
                first = now
    end = time.perf_counter()
    engine.release(seq)
    print(f"  TTFT {1000 * (first - t0):.1f} ms, whole request {1000 * (end - t0):.0f} ms, {len(steps)} steps")
    for i, (dt, what) in enumerate(steps[:show_steps]):
        print(f"    step {i + 1}: {1000 * dt:8.2f} ms  {what}")
    for label in sorted(SPENT, key=SPENT.get, reverse=True):
        print(f"    in {label}: {1000 * SPENT[label]:.2f} ms over {CALLS[label]} calls")
    new = sorted(kernel_files(kernels) - files)  # a kernel MLX (or we) compiled during this request
    if new:
        print(f"    {len(new)} new kernel cache files: {', '.join(name[:90] for name in new[:12])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", choices=shape_names(), default="tiny")
    parser.add_argument("--bits", type=int, choices=(4, 8))
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="engine steps shown per request")
    parser.add_argument(
        "--mlx-lm-between",
        action="store_true",
        help="mlx-lm's generate_step on the same prompt and length between requests (compare_mlx_lm's "
        "other turn; its first run in the process comes right before request 2, as there)",
    )
    parser.add_argument("--storage", default="auto", choices=("auto", "dense", "paged"))
    parser.add_argument(
        "--no-graph",
        action="store_true",
        help="EngineConfig(decode_graph=False): MLX runs every decode step, none is replayed",
    )
    parser.add_argument("--no-clear", action="store_true", help="skip gc.collect + mx.clear_cache between requests")
    parser.add_argument("--max-batch", type=int, default=1, help="the engines' batch limit (compare_mlx_lm: 1)")
    parser.add_argument(
        "--serve-warmup",
        action="store_true",
        help="as `mlxcel serve` starts: its warm-up (server/warmup.py) on a throwaway engine, then "
        "every request timed on a new one, the first included",
    )
    args = parser.parse_args(argv)

    model, config = build_random_model(args.model_shape, bits=args.bits, dtype=args.dtype, seed=0)
    vocab = config["vocab_size"]

    def new_engine() -> Engine:  # as compare_mlx_lm makes it
        return mlxcel_engine(model, vocab, args.storage, args.max_batch, decode_graph=not args.no_graph)

    if args.serve_warmup:
        from mlxcel_core.server.warmup import dry_run_config, warm_up_ahead, warmup_plan

        def warmup_engine(dry: bool = False) -> Engine:  # (as serve's EngineLoop makes them)
            engine = new_engine()
            return Engine(model, engine.tokenizer, dry_run_config(engine.config)) if dry else engine

        plan = warmup_plan(EngineConfig(max_batch_size=args.max_batch))
        seconds = warm_up_ahead(warmup_engine, plan, model)
        print(f"serve's warm-up on a throwaway engine: {seconds:.2f} s ({plan.describe()})")
        gc.collect()
    engine = new_engine()
    backend = backends.current()
    pdl = "n/a"
    if backend.name == "cuda":  # the CUDA wing's kernel cache: its compiles, and whether launches chain (PDL)
        from mlxcel_core.backends.cuda.kernels import cubin_cache

        timed_piece(cubin_cache, "compile_cubin", "cubin compile (NVRTC)")
        pdl = cubin_cache.pdl_enabled()
    timed_piece(engine.runner, "prefill", "runner.prefill")
    timed_piece(engine.runner, "decode", "runner.decode (MLX step)")
    if engine.graph is not None:
        for attr in ("settle", "_check_pools", "_adopt", "_record", "_launch"):
            timed_piece(engine.graph, attr, f"graph.{attr}")
    print(
        f"{args.model_shape} {args.bits or args.dtype}, prompt {args.prompt_tokens}, {args.gen_tokens} new tokens; "
        f"device {'gpu' if mx.default_device() == mx.gpu else 'cpu'}, backend {backend.name}; graph "
        f"{'off' if engine.stats().graph_replayed is None else 'on'}, PDL {pdl}, "
        f"KV {args.storage} ({EngineConfig(storage=args.storage).resolved_storage})"
    )
    twin = None
    if args.mlx_lm_between:
        from mlx_lm.generate import generate_step

        twin = build_twin(model, config)
    prompt = random_prompt(vocab, args.prompt_tokens, 0, "compare")
    kernels = use_kernel_cache()
    print(f"kernel cache: {kernels} ({len(kernel_files(kernels))} files)")
    for r in range(args.requests):
        if twin is not None and r:
            t = time.perf_counter()
            for _ in generate_step(mx.array(prompt), twin, max_tokens=args.gen_tokens + 1):
                pass
            print(f"mlx-lm run before request {r + 1}: {1000 * (time.perf_counter() - t):.0f} ms")
        if not args.no_clear:  # as compare_mlx_lm before each run
            gc.collect()
            mx.clear_cache()
        print(f"request {r + 1}{' (warm-up)' if r == 0 and not args.serve_warmup else ''}:")
        one_request(engine, prompt, args.gen_tokens, args.steps, kernels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
