"""Which CUDA kernels one batch-1 decode token runs, and for how long: mlxcel's engine beside mlx-lm's generate_step,
on a random model shape, under torch.profiler (CUPTI records every kernel of the process, MLX's included).

    python benchmarks/gpu_profile.py --model-shape llama-3-8b --dtype bfloat16
    MLXCEL_CUDA=0 python benchmarks/gpu_profile.py --model-shape llama-3-8b --top 25   # MLX's kernels only
    python benchmarks/gpu_profile.py --model-shape llama-3.2-1b --prefill   # a prompt's prefill (TTFT) instead
    python benchmarks/gpu_profile.py --model-shape llama-3-8b --bits 4 --side mlxcel --batch 32   # 32-row steps

With --prefill the unit is one request's time to its first token (a new random prompt each, on one engine /
through generate_step), not one decode token.

Needs PyTorch built with CUDA next to MLX's CUDA backend (the H200 image has it). Per side: wall ms per token, GPU
busy ms per token (the union of kernel intervals: wall minus busy is time the GPU waited for the host), launches per
token, and the kernels that took the most GPU time per token, each with its own time: the part of its interval that
no kernel started before it covers (the kernels' own times add up to the busy time). A kernel launched with
programmatic dependent launch starts while the one before it runs and waits inside for it to end, so its duration
counts that wait; its own time does not. Both sides decode the same prompt for the same number of
tokens after the same warm-up; it is one measurement, not a speed claim (use compare_mlx_lm.py for those).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import mlxcel_core  # noqa: F401,E402  (before mlx: MLX's CPU products on OpenBLAS, cpu_blas.py)

# isort: split
import mlx.core as mx  # noqa: E402

from mlxcel_core.bench import RandomIdTokenizer, environment, random_prompt  # noqa: E402
from mlxcel_core.engine import Engine, EngineConfig  # noqa: E402
from mlxcel_core.loading.shapes import add_shape_arguments, build_random_model, describe_shape  # noqa: E402
from mlxcel_core.sampling import SamplingParams  # noqa: E402

sys.path.insert(0, str(HERE))
import compare_mlx_lm as compare  # noqa: E402  (its build_twin)


def mlxcel_tokens(model, vocab: int, prompt: list[int], warm: int, count: int, storage: str = "auto"):
    """A generator over the engine's greedy tokens (decode as generate/serve run it)."""
    engine = Engine(model, RandomIdTokenizer(vocab), EngineConfig(max_batch_size=1, storage=storage))
    seq = engine.open(prompt, SamplingParams(max_tokens=warm + count + 1))
    while engine.has_work():
        for out in engine.step():
            if out.finish_reason == "error":
                raise RuntimeError(f"mlxcel: {out.error}")
            if out.token is not None:
                yield out.token
    engine.release(seq)


def mlxcel_steps(model, vocab: int, batch: int, prompt_tokens: int, warm: int, count: int):
    """A generator over the engine's decode steps of `batch` rows (one item a step in which every row got a token):
    `batch` random prompts opened at once and prefilled in one forward, so that every row decodes from the second
    step on (the serving defaults grant a prompt's chunks a few decode steps apart, and bound the KV pool by memory:
    the last rows would start after the first had ended)."""
    steps = warm + count + 16
    config = EngineConfig(
        max_batch_size=batch,
        prefill_chunk_size=batch * prompt_tokens,
        prefill_batch_size=batch,
        prefill_grant_interval=1,
        kv_budget_tokens=batch * (prompt_tokens + steps + 64),
    )
    engine = Engine(model, RandomIdTokenizer(vocab), config)
    prompts = [random_prompt(vocab, prompt_tokens, 0, "gpu-profile", i) for i in range(batch)]
    seqs = [engine.open(p, SamplingParams(max_tokens=steps)) for p in prompts]
    full = 0
    try:
        while engine.has_work() and full < warm + count:
            outs = [out for out in engine.step() if out.token is not None or out.finish_reason == "error"]
            if any(out.finish_reason == "error" for out in outs):
                raise RuntimeError(f"mlxcel: {next(o.error for o in outs if o.finish_reason == 'error')}")
            if len(outs) == batch:
                full += 1
                yield outs
    finally:
        for seq in seqs:
            engine.release(seq)
    if full < warm + count:
        raise RuntimeError(f"only {full} of {warm + count} steps ran all {batch} rows")


def mlx_lm_tokens(model, prompt: list[int], warm: int, count: int):
    from mlx_lm.generate import generate_step

    for token, _ in generate_step(mx.array(prompt), model, max_tokens=warm + count + 1):
        yield int(token)


def first_tokens(tokens_of, vocab: int, prompt_tokens: int):
    """A generator: each item is the first token of a new random prompt, from `tokens_of(prompt, warm, count)` (a
    new engine each for mlxcel, as compare_mlx_lm.py measures TTFT and `mlxcel generate` pays it)."""
    for i in itertools.count():
        yield next(tokens_of(random_prompt(vocab, prompt_tokens, 0, "gpu-profile-prefill", i), 0, 0))


def short_name(name: str) -> str:
    """A kernel's name without its arguments and template parameters, so instances group together."""
    name = re.sub(r"\(.*", "", name)
    depth, out = 0, []
    for ch in name:  # drop <...> however nested
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">" and depth > 0
    return "".join(out).replace("void ", "").strip()[:70]


def own_us(kernels: list[tuple[str, int, int]]) -> dict[str, float]:
    """name -> microseconds of its kernels' intervals that no kernel started before them covers (in start order, each
    kernel's share of the union of intervals: their sum is the GPU's busy time). `kernels`: (name, start ns,
    duration ns)."""
    own: dict[str, float] = defaultdict(float)
    end = None
    for name, start, dur in sorted(kernels, key=lambda k: k[1]):
        stop = start + dur
        if end is None or start >= end:
            own[name] += dur / 1e3
            end = stop
        elif stop > end:
            own[name] += (stop - end) / 1e3
            end = stop
        else:
            own.setdefault(name, 0.0)  # (wholly inside an earlier kernel's interval)
    return dict(own)


def launch_shapes(prof) -> dict:
    """(kernel, grid, block) -> [calls, us, registers, achieved occupancy %] from the profile's trace: which launch
    shape of a kernel takes the time (one kernel name serves several weights and configurations)."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    shapes: dict[tuple, list] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") != "kernel":
            continue
        a = ev.get("args", {})
        key = (short_name(ev["name"]), tuple(a.get("grid", ())), tuple(a.get("block", ())))
        row = shapes.setdefault(key, [0, 0.0, a.get("registers per thread"), a.get("est. achieved occupancy %")])
        row[0] += 1
        row[1] += float(ev.get("dur", 0.0))
    return shapes


def profile_tokens(tokens, warm: int, count: int, detail: bool = False) -> dict:
    """Consume `warm` tokens, then profile the next `count` (CUDA activity only)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warm):
        next(tokens)
    mx.synchronize()
    prof = profile(activities=[ProfilerActivity.CUDA])
    prof.start()
    t0 = time.perf_counter()
    for _ in range(count):
        next(tokens)
    mx.synchronize()
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    prof.stop()
    tokens.close()  # ends the generator (its finally blocks and the engine go with it)
    kernels = [
        (e.name(), e.start_ns(), e.duration_ns())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == DeviceType.CUDA
    ]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for name, _, dur in kernels:
        row = by_name[short_name(name)]
        row[0] += 1
        row[1] += dur / 1e3
    own = own_us([(short_name(n), s, d) for n, s, d in kernels])
    for name, us in own.items():
        by_name[name][2] += us
    return {
        "wall_ms": wall * 1e3 / count,
        "busy_ms": sum(own.values()) / 1e3 / count,
        "launches": len(kernels) / count,
        "by_name": dict(by_name),
        "by_shape": launch_shapes(prof) if detail else {},
    }


def report(side: str, r: dict, count: int, top: int, unit: str = "token") -> None:
    print(
        f"{side}: wall {r['wall_ms']:.3f} ms/{unit}, GPU busy {r['busy_ms']:.3f} ms/{unit} "
        f"({100 * r['busy_ms'] / r['wall_ms']:.0f}%), {r['launches']:.0f} kernel launches/{unit}"
    )
    ranked = sorted(r["by_name"].items(), key=lambda kv: -kv[1][1])
    for name, (n, us, own) in ranked[:top]:
        print(
            f"  {us / count:9.1f} us/{unit} (own {own / count:7.1f}) {n / count:6.1f} calls/{unit} {us / n:8.2f} "
            f"us/call  {name}"
        )
    if r["by_shape"]:
        print("  by launch shape (grid, block; registers a thread, achieved occupancy %):")
        ranked = sorted(r["by_shape"].items(), key=lambda kv: -kv[1][1])
        for (name, grid, block), (n, us, regs, occ) in ranked[:top]:
            print(
                f"  {us / count:9.1f} us/{unit} {n / count:6.1f} calls/{unit} {us / n:8.2f} us/call  grid {grid} "
                f"block {block} regs {regs} occ {occ}  {name[:48]}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser, "llama-3-8b")
    parser.add_argument("--warm", type=int, default=16, help="decode tokens before profiling (kernels compile)")
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens profiled")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--side", choices=("both", "mlxcel", "mlx-lm"), default="both")
    parser.add_argument("--shapes", action="store_true", help="also rank launches by (kernel, grid, block)")
    parser.add_argument(
        "--batch", type=int, default=1, help="mlxcel's decode steps of this many rows (the unit is a step; mlxcel only)"
    )
    parser.add_argument(
        "--prefill",
        action="store_true",
        help="profile prompts' prefills (time to first token), --warm and --tokens of them",
    )
    args = parser.parse_args(argv)
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError("torch.cuda.is_available() is False")
    except ImportError as e:
        print(f"gpu_profile.py needs PyTorch with CUDA: {e}", file=sys.stderr)
        return 1
    ours, config = build_random_model(args.model_shape, bits=args.bits, dtype=args.dtype, seed=0)
    vocab = config["vocab_size"]
    prompt = random_prompt(vocab, args.prompt_tokens, 0, "gpu-profile")
    unit = "prefill" if args.prefill else "token"
    if args.batch > 1:
        if args.prefill or args.side != "mlxcel":
            print("--batch profiles mlxcel's decode steps only: give --side mlxcel, no --prefill", file=sys.stderr)
            return 2
        unit = f"step(b={args.batch})"
    print(
        f"{describe_shape(args.model_shape, args.bits, args.dtype)}; {environment()}; prompt {args.prompt_tokens}, "
        f"{args.warm} warm-up {unit}s, {args.tokens} profiled"
    )
    if args.batch > 1:
        steps = mlxcel_steps(ours, vocab, args.batch, args.prompt_tokens, args.warm, args.tokens)
        report("mlxcel", profile_tokens(steps, args.warm, args.tokens, args.shapes), args.tokens, args.top, unit)
    elif args.side in ("both", "mlxcel"):
        tokens_of = functools.partial(mlxcel_tokens, ours, vocab)
        tokens = (
            first_tokens(tokens_of, vocab, args.prompt_tokens)
            if args.prefill
            else tokens_of(prompt, args.warm, args.tokens)
        )
        report("mlxcel", profile_tokens(tokens, args.warm, args.tokens, args.shapes), args.tokens, args.top, unit)
    if args.side in ("both", "mlx-lm"):
        theirs = compare.build_twin(ours, config)
        tokens_of = functools.partial(mlx_lm_tokens, theirs)
        tokens = (
            first_tokens(tokens_of, vocab, args.prompt_tokens)
            if args.prefill
            else tokens_of(prompt, args.warm, args.tokens)
        )
        report("mlx-lm", profile_tokens(tokens, args.warm, args.tokens, args.shapes), args.tokens, args.top, unit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
