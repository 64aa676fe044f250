"""Where a batch-1 decode token's host time goes: mlxcel's engine beside mlx-lm's generate_step, same random weights.

    python benchmarks/host_profile.py --model-shape llama-3.2-1b --dtype bfloat16
    MLXCEL_CUDA=0 python benchmarks/host_profile.py --model-shape llama-3.2-1b --side mlxcel   # MLX's ops only

When the GPU finishes a token faster than the host can queue the next one (gpu_profile.py: 1B bf16 on the H200 was
1.4 ms of GPU work in 2.3 ms of wall), the host's per-token cost is the decode speed. Per token, for each side:
- build: building the step's lazy graph (mlxcel: ModelRunner.decode, i.e. the step's block tables and the compiled
  step's call, which replays its trace; mlx-lm: the model's __call__ op by op);
- launch: mx.async_eval, which walks the graph and encodes every kernel (on CUDA, into CUDA graphs it launches);
- read: reading the previous token on the host (waits while the GPU is behind);
- other: the rest of the loop (Python: scheduling, block tables, sampling ops, stop checks);
then the graph's size (ops the step hands to MLX, counted from mx.export_to_dot, by primitive) and, where PyTorch
with CUDA is present, the CUDA runtime/driver calls CUPTI saw per token (time the host spent inside them).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import mlxcel_core  # noqa: F401,E402  (before mlx: MLX's CPU products on OpenBLAS, cpu_blas.py)

# isort: split
import mlx.core as mx  # noqa: E402

from mlxcel_core.bench import RandomIdTokenizer, environment, random_prompt  # noqa: E402
from mlxcel_core.engine import Engine, EngineConfig  # noqa: E402
from mlxcel_core.engine import engine as engine_module  # noqa: E402
from mlxcel_core.engine.runner import ModelRunner  # noqa: E402
from mlxcel_core.loading.shapes import add_shape_arguments, build_random_model, describe_shape  # noqa: E402
from mlxcel_core.sampling import SamplingParams  # noqa: E402

sys.path.insert(0, str(HERE))
import compare_mlx_lm as compare  # noqa: E402  (its build_twin)
import gpu_profile as gpu  # noqa: E402  (its token loops)

PARTS = ("build", "launch", "read")


class Clock:
    """Accumulates seconds per part while `on`."""

    def __init__(self):
        self.on = False
        self.spent = collections.Counter()

    @contextmanager
    def part(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.on:
                self.spent[name] += time.perf_counter() - t

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            with self.part(name):
                return fn(*a, **k)

        return timed


def count_ops(*arrays: mx.array, dot_file: str | None = None) -> collections.Counter:
    """The primitives of the graph behind `arrays` (nodes of mx.export_to_dot that are operations, not arrays);
    `dot_file`: also keep the graph there."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(dot_file or f.name, *arrays)
        dot = Path(dot_file or f.name).read_text()
    ops = collections.Counter()
    for attrs in re.findall(r"\[([^\]]*)\]", dot):
        label = re.search(r'label\s*=\s*"([^"]*)"', attrs)
        if label and "shape=rectangle" in attrs.replace(" ", ""):
            ops[label.group(1).split()[0]] += 1
    return ops


def mlx_lm_loop(model, prompt: list[int], tokens: int, clock: Clock):
    """gpu_profile's mlx-lm token loop with the model's calls clocked as "build"."""

    class Timed:  # the model, with its calls clocked as "build"
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, *a, **k):
            with clock.part("build"):
                return self.inner(*a, **k)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    drain(gpu.mlx_lm_tokens(Timed(model), prompt, 0, tokens))


def drain(tokens) -> None:
    """Run a token generator to its end (gpu_profile's loops decode `count` + 1 tokens after `warm`)."""
    for _ in tokens:
        pass


def measure(side: str, loop, tokens: int, warm: int) -> tuple[dict, float]:
    clock = Clock()
    real_async_eval, real_item, real_tolist = mx.async_eval, mx.array.item, mx.array.tolist
    real_decode = ModelRunner.decode
    mx.async_eval = clock.wrap("launch", real_async_eval)
    mx.array.item = clock.wrap("read", real_item)
    mx.array.tolist = clock.wrap("read", real_tolist)
    ModelRunner.decode = clock.wrap("build", real_decode)
    try:
        loop(warm, clock)  # warm-up: traces, kernel JIT
        mx.synchronize()
        clock.on = True
        t = time.perf_counter()
        loop(tokens, clock)
        mx.synchronize()
        wall = time.perf_counter() - t
    finally:
        mx.async_eval, mx.array.item, mx.array.tolist = real_async_eval, real_item, real_tolist
        ModelRunner.decode = real_decode
    return {name: clock.spent[name] / tokens * 1e6 for name in PARTS}, wall / tokens * 1e6


def cuda_api_calls(loop, tokens: int) -> dict[str, tuple[float, float]] | None:
    """Per token: {CUDA runtime/driver call: (calls, us)} as CUPTI saw them, or None without PyTorch + CUDA."""
    try:
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    loop(tokens, Clock())
    mx.synchronize()
    prof.stop()
    calls: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != DeviceType.CUDA and e.name().startswith("cu"):
            row = calls[e.name()]
            row[0] += 1
            row[1] += e.duration_ns() / 1e3
    return {name: (n / tokens, us / tokens) for name, (n, us) in calls.items()}


def report(side: str, parts: dict, wall_us: float, ops: collections.Counter, api, top: int) -> None:
    other = wall_us - sum(parts.values())
    print(
        f"{side}: {wall_us:.0f} us/token wall ({1e6 / wall_us:.1f} tok/s) = "
        + " + ".join(f"{name} {parts[name]:.0f}" for name in PARTS)
        + f" + other {other:.0f}"
    )
    print(f"  graph: {sum(ops.values())} ops/step: " + ", ".join(f"{n} {k}" for k, n in ops.most_common(top)))
    if api:
        total = sum(us for _, us in api.values())
        print(
            f"  CUDA API: {total:.0f} us/token in "
            + ", ".join(
                f"{name} {n:.1f}x {us:.0f} us" for name, (n, us) in sorted(api.items(), key=lambda kv: -kv[1][1])[:top]
            )
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--warm", type=int, default=16, help="decode tokens of the warm-up run")
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens timed")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--storage", default="auto", choices=("auto", "paged", "dense"), help="mlxcel's KV storage")
    parser.add_argument("--dot", help="write the graph of one mlxcel decode step (mx.export_to_dot) to this file")
    parser.add_argument("--side", choices=("both", "mlxcel", "mlx-lm"), default="both")
    args = parser.parse_args(argv)
    ours, config = build_random_model(args.model_shape, bits=args.bits, dtype=args.dtype, seed=0)
    vocab = config["vocab_size"]
    prompt = random_prompt(vocab, args.prompt_tokens, 0, "host-profile")
    print(
        f"{describe_shape(args.model_shape, args.bits, args.dtype)}; {environment()}; prompt {args.prompt_tokens}, "
        f"{args.tokens} tokens timed"
    )
    sides = []
    if args.side in ("both", "mlxcel"):
        sides.append(
            (
                "mlxcel",
                lambda n, clock: drain(gpu.mlxcel_tokens(ours, vocab, prompt, 0, n, args.storage)),
                mlxcel_step_ops(ours, args.storage, args.dot),
            )
        )
    if args.side in ("both", "mlx-lm"):
        theirs = compare.build_twin(ours, config)
        sides.append(("mlx-lm", lambda n, clock: mlx_lm_loop(theirs, prompt, n, clock), mlx_lm_step_ops(theirs)))
    for side, loop, ops in sides:
        parts, wall = measure(side, loop, args.tokens, args.warm)
        report(side, parts, wall, ops, cuda_api_calls(loop, min(args.tokens, 32)), args.top)
    return 0


def mlxcel_step_ops(model, storage: str, dot_file: str | None = None) -> collections.Counter:
    """The ops of one decode step as the engine hands it to MLX (what its async_eval's arrays depend on: the
    sampled token, the NaN flag, the readout, and through attention the step's KV writes)."""
    seen: list[collections.Counter] = []
    calls = [0]
    real = mx.async_eval

    def capture(arrays):
        calls[0] += 1
        if calls[0] == 3:  # not the first decode step: its graph also holds the prompt's KV writes
            seen.append(count_ops(*arrays, dot_file=dot_file))
        return real(arrays)

    engine = Engine(model, RandomIdTokenizer(model.args.vocab_size), EngineConfig(max_batch_size=1, storage=storage))
    seq = engine.open(list(range(1, 17)), SamplingParams(max_tokens=6))
    engine.step()  # the prefill
    engine_module.mx.async_eval = capture
    try:
        while engine.has_work():
            engine.step()
    finally:
        engine_module.mx.async_eval = real
    engine.release(seq)
    return seen[0] if seen else collections.Counter()


def mlx_lm_step_ops(model) -> collections.Counter:
    """The ops of one mlx-lm decode step: the model's call over a 16-token cache, then argmax."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(1, 17))]), cache=cache))
    logits = model(mx.array([[1]]), cache=cache)
    return count_ops(mx.argmax(logits[:, -1, :], axis=-1), *[c.state[0] for c in cache], *[c.state[1] for c in cache])


if __name__ == "__main__":
    sys.exit(main())
