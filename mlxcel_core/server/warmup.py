"""The server's warm-up: short requests on a throwaway engine before /health turns 200, so that no client waits for
what a process (or, on a fresh machine, the GPU's kernel compiler) does once: about 60-70 s on a fresh H200, well under
a second once mlxcel's kernel cache holds the kernels.

What needs it on a GPU is built per shape: the decode kernels per row count (a decode batch's sequences, or a short
prompt's tokens: a prefill of up to 8 tokens runs the same matvec kernels), the compiled decode step per batch size,
the CUDA graph a lone greedy request's steps are replayed as (its recording's own small kernels), and a constrained
request's masked greedy kernel and two-part graph (engine/constrained.py), where the tokenizer takes grammars.
Where the backend compiles kernels of its own, the plan first runs dry (`warm_up_ahead`) so that they compile side by
side rather than one launch at a time."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from .. import paths
from ..constraints import Constraint
from ..engine import Engine, EngineConfig
from ..sampling import SamplingParams

WARMUP_PROMPT = list(range(3, 19))  # 16 ids every vocabulary has; past the decode kernels' rows (a prefill)
WARMUP_TOKENS = 4  # a lone greedy request: prefill, an MLX step, then one step recorded as a graph and one replayed
WARMUP_GRAMMAR = Constraint.regex("[0-9]{12}")  # every tokenizer spells digits; longer than the request's tokens
log = logging.getLogger("mlxcel.server")


@dataclass(frozen=True)
class WarmupPlan:
    lone_tokens: int = WARMUP_TOKENS  # the lone greedy request's
    rows: int = 1  # decode batches of 1..rows sequences
    prompt_lengths: tuple[int, ...] = ()  # short prompts prefilled one at a time (one kernel variant a length)
    constrained: bool = False  # a lone constrained request of WARMUP_TOKENS, where the tokenizer takes grammars
    burst: int = 0  # requests opened at once, as a burst of clients arrives: batches grow a prefill batch a step

    def describe(self) -> str:
        parts = [f"a lone reply of {self.lone_tokens} tokens"]
        if self.rows > 1:
            parts.append(f"decode batches of 1 to {self.rows}")
        if self.burst:
            parts.append(f"a burst of {self.burst} requests")
        if self.prompt_lengths:
            parts.append(f"prompts of {self.prompt_lengths[0]} to {self.prompt_lengths[-1]} tokens")
        if self.constrained:
            parts.append("a constrained reply")
        return ", ".join(parts)


def warmup_plan(config: EngineConfig) -> WarmupPlan:
    """On a GPU: a lone request long enough for the attention kernel's split form (its one-split form runs before),
    every batch size up to the batch limit and 8, and every prompt length up to 8 (the decode kernels' rows); with a
    batch limit above 8, a burst of that many requests (its batches grow by a prefill batch a step, as a burst of
    clients' do: the tensor-core kernel's variants, one per 8 rows, and the compiled steps of those sizes). Else a
    machine's first longer reply, first batch of a size, first burst, or first chat turn with a few uncached tokens,
    stalls every client while they compile. On CPU nothing is compiled: one short request."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return WarmupPlan()
    from autotune.ops import MIN_CUDA_SPLIT_TOKENS  # past 2x this, the attention kernel splits the context

    from .. import backends

    rows = backends.current().warmup_rows()  # the decode kernels' rows: one compiled variant per row count up to it
    return WarmupPlan(
        lone_tokens=2 * MIN_CUDA_SPLIT_TOKENS + 1 - len(WARMUP_PROMPT),
        rows=max(1, min(config.max_batch_size, rows)),
        prompt_lengths=tuple(range(1, rows + 1)),
        constrained=True,
        burst=config.max_batch_size if config.max_batch_size > rows else 0,
    )


def compiled() -> str:
    """What the warm-up log adds about the backend's own kernels compiled in this process (on a fresh machine, the part
    of the warm-up that is mlxcel's compiles; MLX's of its own kernels are the rest of the compile time)."""
    from .. import backends

    variants, seconds = backends.current().kernel_compiles()
    return f"; mlxcel's kernels: {variants} compiled in {seconds:.1f} s" if variants else ""


def dry_run_config(config: EngineConfig) -> EngineConfig:
    """The dry run's engine: the serving one's storage, no compiled steps, no recorded graph (either would keep the
    dry run's zeros: an mx.compile trace as constants, a recording as launches to replay)."""
    return dataclasses.replace(config, storage=config.resolved_storage, compile_decode=False, decode_graph=False)


def modules_early(source) -> None:
    """Serve's load (warm-up on), once the model's files are found and before they are read: MLX's own JIT modules
    its steps will need start compiling side by side from a checkpoint directory's files (Backend.mlx_modules_early),
    overlapping the load; the warm-up's own start adopts them. A GGUF file's dtype is the loader's choice: its
    modules start with the warm-up. Never fails the load."""
    from .. import backends

    if source.kind == "gguf" or not source.path.is_dir():
        return
    try:
        started = backends.current().mlx_modules_early(source.path)
    except Exception as exc:  # noqa: BLE001 - the warm-up starts what is still missing
        log.debug("MLX's modules from the checkpoint's files: %s: %s", type(exc).__name__, exc)
        return
    if started:
        log.info("warm-up: %d of MLX's own kernel modules compiling side by side while the model loads", started)


def warm_up_ahead(new_engine: Callable[..., Engine], plan: WarmupPlan, model=None) -> float:
    """`warm_up(new_engine(), plan)`, first run dry where the backend compiles kernels of its own
    (Backend.compile_ahead): the same plan on a throwaway engine whose kernel launches give zeros while every variant
    they need compiles side by side, so the warm-up proper finds them all compiled. Its engine neither compiles its
    steps nor records a graph (either would keep the zeros: an mx.compile trace as constants); it keeps the real
    one's storage. `new_engine(dry=True)`: an engine of `dry_run_config`'s. A dry run whose lone
    reply compiled nothing stops there (a restart: the kernel cache holds the model's kernels). A dry run that fails
    only costs its time (a warning): the warm-up proper compiles what it still needs. `model` (the engines'): MLX's
    own JIT modules its steps need compile side by side first (Backend.mlx_modules_ahead), which the dry run would
    otherwise compile one at a time. Returns the wall time."""
    from .. import backends

    start = time.perf_counter()
    backend = backends.current()
    ahead = backend.compile_ahead(model)
    if ahead is not None:
        try:
            mlx_modules = backend.mlx_modules_ahead(model) if model is not None else None
            if mlx_modules is not None:
                moved, seconds = mlx_modules.wait()
                log.info("warm-up: %d of MLX's own kernel modules compiled side by side in %.1f s", moved, seconds)
            with ahead as compiles:
                dry = new_engine(dry=True)
                warm_up(dry, plan, dry_run=True, compiling=lambda: compiles is None or bool(compiles.submitted))
                del dry
        except Exception as exc:  # noqa: BLE001 - only the compiles ahead are lost
            log.warning(
                "mlxcel: the warm-up's dry run failed (%s: %s); it compiles as it goes", type(exc).__name__, exc
            )
    warm_up(new_engine(), plan)
    published = paths.publish_kernels()  # (for the next process even where this one is killed, not ended)
    if published:
        log.info("warm-up: %d of MLX's kernel modules compiled here kept in the kernel cache", published)
    return time.perf_counter() - start


class WithoutEos:
    """A tokenizer whose tokens end no sequence, the rest its wrapped one's: the dry run's (`warm_up`)."""

    eos_token_ids: frozenset = frozenset()

    def __init__(self, tokenizer):
        self._wrapped = tokenizer

    def __getattr__(self, name: str):
        return getattr(self._wrapped, name)


def _step(engine: Engine) -> None:
    for out in engine.step():
        if out.error is not None:
            raise RuntimeError(f"the warm-up request failed: {out.error}")


def _finish(engine: Engine) -> None:
    while engine.has_work():
        _step(engine)


def warm_up(
    engine: Engine, plan: WarmupPlan = WarmupPlan(), dry_run: bool = False, compiling: Callable[[], bool] | None = None
) -> float:
    """Run `plan` through `engine`, which is then dropped; returns its wall time in seconds.

    First one greedy request alone (its steps after the second are the CUDA graph's: recorded, then replayed).
    Then, with `plan.rows` > 1, requests that join one a step (a new one's prefill is granted at once), so the
    decode batch runs at every size from 1 to `rows`. Then `plan.burst` requests opened at once. Then each short
    prompt alone; each starts with its own token, so none is a cached prefix of another. `dry_run` (warm_up_ahead):
    the logits are zeros, whose greedy token may be an end-of-sequence one, so the engine is given a tokenizer that
    ends no sequence (`WithoutEos`) and every request runs its length with the same sampling as the warm-up proper
    (suppressing those tokens instead would sample through logits processors, other kernels than the real run's); no
    constrained request (its grammar is built on the real end-of-sequence tokens). `compiling`: asked after the lone
    reply; False ends the run there."""
    start = time.perf_counter()
    room = max(1, min(len(WARMUP_PROMPT), engine.max_context - WARMUP_TOKENS))  # (a model with a tiny context)
    if dry_run:
        engine.tokenizer = WithoutEos(engine.tokenizer)

    def open_request(prompt: list[int], tokens: int) -> None:
        limit = max(1, min(tokens, engine.max_context - len(prompt)))
        engine.open(prompt, SamplingParams(max_tokens=limit))

    part = _Parts("warm-up dry run parts" if dry_run else "warm-up parts")
    open_request(WARMUP_PROMPT[:room], plan.lone_tokens)
    _finish(engine)
    part("lone reply")
    if compiling is not None and not compiling():
        part.log(" (nothing left to compile)")
        return time.perf_counter() - start
    if plan.rows > 1:
        tokens = WARMUP_TOKENS + plan.rows - 1  # the first still decodes in the step where the last one first does
        prompt = WARMUP_PROMPT[-room:][::-1]  # (not the lone request's, whose blocks are cached: a whole prefill)
        for _ in range(plan.rows):
            open_request(prompt, tokens)
            _step(engine)
        _finish(engine)
        part("batches")
    if plan.burst > 1:
        # every row still decodes in the step where the last one's prefill batch joins them
        ramp = -(-plan.burst // engine.config.resolved_prefill_batch) + 1
        for i in range(plan.burst):
            open_request([WARMUP_PROMPT[(i + j) % len(WARMUP_PROMPT)] for j in range(room)], WARMUP_TOKENS + ramp)
        _finish(engine)
        part("burst")
    for length in plan.prompt_lengths:
        if length < engine.max_context:
            open_request([WARMUP_PROMPT[(length + i) % len(WARMUP_PROMPT)] for i in range(length)], 1)
            _finish(engine)
    if plan.prompt_lengths:
        part("short prompts")
    if plan.constrained and not dry_run and getattr(engine.tokenizer, "backend", None) is not None:
        _constrained(engine, (WARMUP_PROMPT[9:] + WARMUP_PROMPT[:9])[:room])  # (its own first token: no cached prefix)
        part("constrained reply")
    part.log()
    return time.perf_counter() - start


class _Parts:
    """The warm-up's parts and their times, for its log line: on a fresh machine, where the compile time goes."""

    def __init__(self, title: str):
        self.title, self.done, self.mark = title, [], time.perf_counter()

    def __call__(self, name: str) -> None:
        self.done.append(f"{name} {time.perf_counter() - self.mark:.1f} s")
        self.mark = time.perf_counter()

    def log(self, note: str = "") -> None:
        log.info("%s: %s%s", self.title, ", ".join(self.done), note)


def _constrained(engine: Engine, prompt: list[int]) -> None:
    """A lone constrained greedy request: its steps are MLX's, then a two-part graph's, recorded and replayed. Where
    it fails (a tokenizer llguidance cannot read) free requests are still served: a warning, not a failed load."""
    tokens = max(1, min(WARMUP_TOKENS, engine.max_context - len(prompt)))
    engine.open(prompt, SamplingParams(max_tokens=tokens, constraint=WARMUP_GRAMMAR))
    errors = []
    while engine.has_work():
        errors += [out.error for out in engine.step() if out.error is not None]
    if errors:
        log.warning("mlxcel: the warm-up's constrained request failed (%s); the first one served compiles", errors[0])
