"""Where a process's first request goes: import, the GPU's first op, model load, then each engine step of the
server's warm-up request (engine_loop.warm_up: a 16-token prefill, then decode steps), timed one by one.

    python benchmarks/startup_phases.py MODEL_DIR [--profile 20]

Run it twice on one MLXCEL_CACHE_DIR: the first process compiles the GPU kernels, the second should find them in
the kernel cache (paths.use_kernel_cache); what the second still spends is what a restart costs. `--profile N`
prints the N functions with the most cumulative time over the warm-up steps (cProfile: Python frames only, so MLX's
own work shows as the mx.eval / async_eval / item calls that wait for it).
"""

from __future__ import annotations

import argparse
import time

began = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args()

    def mark(what: str, since: float) -> float:
        now = time.perf_counter()
        print(f"{what:34s} {(now - since) * 1e3:9.1f} ms", flush=True)
        return now

    t = time.perf_counter()
    import mlx.core as mx

    t = mark("import mlx", t)
    mx.eval(mx.ones(4) + 1)
    t = mark("first GPU op (context)", t)
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.loading import load_model
    from mlxcel_core.paths import use_kernel_cache
    from mlxcel_core.sampling import SamplingParams
    from mlxcel_core.server.warmup import WARMUP_PROMPT, WARMUP_TOKENS

    t = mark("import mlxcel_core", t)
    loaded = load_model(args.model, log=lambda m: None)
    t = mark("load_model", t)
    print(f"kernel cache: {use_kernel_cache()}")
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=4))
    t = mark("Engine()", t)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    engine.open(WARMUP_PROMPT, SamplingParams(max_tokens=WARMUP_TOKENS))
    step = 0
    while engine.has_work():
        engine.step()
        step += 1
        t = mark(f"warm-up step {step}", t)
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
    engine.open(WARMUP_PROMPT, SamplingParams(max_tokens=WARMUP_TOKENS))
    step = 0
    while engine.has_work():
        engine.step()
        step += 1
    mark(f"a second request ({step} steps)", t)
    print(f"process total {(time.perf_counter() - began):.1f} s")


if __name__ == "__main__":
    main()
