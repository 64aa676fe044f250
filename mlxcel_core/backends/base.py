"""The backend seam: what the engine, the paged KV storage and the loaders ask of the machine they run on.

`Backend` itself is the portable backend: MLX's own ops on whatever device MLX computes on (CPU, Metal, CUDA with the
CUDA wing off). A backend with kernels of its own (backends/cuda/) subclasses it and overrides what it does
differently; nothing outside backends/ imports such a subclass (backends.current() picks it).

What differs by backend:
- `prepare_model` / `unprepare_model`: swap kernel modules into a built model (fused projections, matvec kernels)
  and back;
- the decode attention over the paged pools (`paged_runner`, `paged_attention`, `kv_written_in_kernel`,
  `combine_counters`; `paged_runner_for` keeps latent-attention calls on the portable path);
- the greedy readout of a decode step (`greedy_tokens`, and `masked_greedy_tokens` for constrained rows);
- a decode-step replayer (`graph_decoder`: a lone greedy row's steps as one recorded graph);
- the step inputs' placement (`own_step_inputs`) and per-backend defaults (`compile_by_default`,
  `prefill_batch`, `prefill_chunk`, `prefill_grant_interval`, `dense_mask_is_slow`, `warmup_rows`).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from ..kv.paged_attention import RUNNER_OPS, paged_decode_attention

GPU_PREFILL_BATCH = 8  # waiting prompts one prefill forward takes on a GPU (bandwidth-bound: one pass of the weights)
# Prompt tokens one prefill forward computes while other rows decode (engine/scheduler.py), so that a long prompt
# holds the running rows for about a second at most (benchmarks/archive/RESULTS-history.md, "The prefill chunk
# beside running rows").
# On CPU (cpu_blas.py's float32 products) a chunk of a few dozen rows keeps the running rows' wait near a decode
# step's while the prompt's tokens share each pass over the weights. On a GPU one
# forward takes a whole prompt of up to 2048 tokens.
GPU_PREFILL_CHUNK = 2048
CPU_PREFILL_CHUNK = 32
# Decode-only steps between two chunks of a prompt already started while rows decode (engine/scheduler.py). A GPU
# chunk holds the running rows for a long step, so they get 16 steps of their own between chunks; a CPU chunk costs
# about two decode steps: one step of their own between chunks keeps the running rows at half their pace or more,
# where 16 made every prompt over one chunk wait seconds a chunk for its first token under load.
GPU_PREFILL_GRANT_INTERVAL = 16
CPU_PREFILL_GRANT_INTERVAL = 1


def on_gpu() -> bool:
    """Whether MLX computes on a GPU by default (asked at each call: a caller may change the default device)."""
    return mx.default_device().type == mx.DeviceType.gpu


class Backend:
    name = "mlx"

    # -- models ------------------------------------------------------------------------------------
    def prepare_model(self, model) -> None:
        """What load_model and build_random_model do to every built model: on the CPU with cpu_blas.py, quantized layers
        compute float32 products of their dequantized weights (cpu_float32.py), q/k/v and gate/up as one product each
        where blas_rows.c computes them (cpu_fused.py); on the CPU, rotary embeddings share
        their angles across layers (cpu_rope.py) and RMS norms run compiled (cpu_norm.py); otherwise nothing."""
        from . import cpu_float32, cpu_fused, cpu_norm, cpu_rope

        if cpu_float32.applies():
            cpu_float32.prepare(model)
            if cpu_fused.applies():
                cpu_fused.prepare(model)
        if cpu_rope.applies():
            cpu_rope.prepare(model)
        if cpu_norm.applies():
            cpu_norm.prepare(model)

    def unprepare_model(self, model) -> None:
        """Undo prepare_model where it changed layers' classes or layout (before a model is requantized)."""
        from . import cpu_float32, cpu_norm, cpu_rope

        cpu_float32.unprepare(model)  # (the stacks of cpu_fused.py first)
        cpu_rope.unprepare(model)
        cpu_norm.unprepare(model)

    # -- a decode step -----------------------------------------------------------------------------
    def greedy_tokens(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """(tokens [N], readout int32 [N]) of logits [N, V]: each row's argmax (the first of equal maxima), and it
        again or -1 where the row holds a NaN (the engine ends that row)."""
        tokens = mx.argmax(logits, axis=-1)
        return tokens, readout_of(tokens, logits)

    def masked_greedy_tokens(self, logits: mx.array, bitmask: mx.array) -> tuple[mx.array, mx.array]:
        """greedy_tokens of the logits with -inf for every token a row's packed bitmask [N, words] leaves out
        (engine/constrained.py's `apply_bitmask`)."""
        from ..engine.constrained import apply_bitmask

        return self.greedy_tokens(apply_bitmask(logits, bitmask))

    def own_step_inputs(self, packed: mx.array) -> mx.array:
        """A step's packed integer inputs (engine/step_inputs.py) as the step's kernels read them."""
        return packed

    def paged_runner(self, head_dim: int) -> str:
        """Which paged decode attention runs for this head size (autotune keys its results on it)."""
        return RUNNER_OPS

    def paged_runner_for(self, head_dim: int, values_in_keys: bool = False) -> str:
        """The runner of one decode attention call: `paged_runner`'s, except that a call whose values are its keys'
        prefix (`values_in_keys`, DeepSeek-V3's latent attention: one pool, of another head size than the output's)
        runs the portable MLX-ops path (`paged_decode_attention(values_in_keys=)`): the kernels read separate K and V
        pools of one head size. Sliding windows, Llama 4's chunks and attention sinks (`window=`, `chunk=`, `sinks=`)
        the kernels take."""
        return RUNNER_OPS if values_in_keys else self.paged_runner(head_dim)

    def paged_attention(self, runner: str) -> Callable:
        """The attention function of `runner`: paged_decode_attention's contract (kv/paged_attention.py), plus
        `counters` and `new_kv` keywords where the runner is a kernel of a backend's."""
        return paged_decode_attention

    @property
    def kv_written_in_kernel(self) -> bool:
        """Whether the decode attention kernel writes a step's keys and values into the pools itself."""
        return False

    def combine_counters(self, num_layers: int) -> list[mx.array | None]:
        """Per layer, the scratch a kernel that combines its splits in one launch keeps (None: none)."""
        return [None] * num_layers

    def graph_decoder(self, model, storage, open_rows: Callable[[int], bool]):
        """A replayer of a lone greedy row's decode steps (backends/cuda/graph_decode.py's contract), or None."""
        return None

    # -- defaults ----------------------------------------------------------------------------------
    def compile_by_default(self) -> bool:
        """Decode steps as one compiled MLX graph: on a GPU, where building a step's graph in Python costs as much
        as the step; not on CPU, where it gains nothing (compute-bound) and a first run JIT-compiles."""
        return on_gpu()

    def kernel_compiles(self) -> tuple[int, float]:
        """(variants, seconds) of this process's compiles of the backend's own kernels so far: none here."""
        return 0, 0.0

    def compile_ahead(self, model=None):
        """A context for a dry run of what a process will launch (serve's warm-up) on `model`, within which the
        backend's own kernels give zeros and compile side by side, all ended on exit (cuda/kernels/compile_ahead.py);
        None where the backend compiles nothing of its own, so there is nothing to run ahead."""
        return None

    def mlx_modules_ahead(self, model):
        """MLX's own JIT modules the model's steps need, set compiling side by side before serve's warm-up (its
        `wait()` moves them into MLX's cache: cuda/mlx_jit_ahead.py); None where MLX compiles nothing at run time."""
        return None

    def mlx_modules_early(self, checkpoint) -> int:
        """`mlx_modules_ahead` from a checkpoint directory's files, before its load (serve's, warm-up on), so that the
        compiles overlap the load; the warm-up's `mlx_modules_ahead` adopts them. How many helpers began."""
        return 0

    def in_dry_run(self) -> bool:
        """Whether a `compile_ahead` dry run is going on (its kernels give zeros: autotuning measures nothing then)."""
        return False

    def masks_on_worker(self) -> bool:
        """Whether a constrained step's host work (reading the previous step, the grammars' masks) runs on a worker
        thread beside its forward's submission (engine/mask_worker.py): on a GPU, where a batch's step is host-bound;
        not on CPU, where the forward's compute bounds the step and hides that work after the submission."""
        return on_gpu()

    def dense_mask_is_slow(self) -> bool:
        """Whether attention over a dense cache with an array mask leaves MLX's fused kernel (CUDA does)."""
        return False

    def prefill_batch(self) -> int:
        """Waiting prompts one prefill forward takes: on a GPU several (one pass of the weights for all); on CPU,
        compute-bound, one (each prompt would wait for the whole forward)."""
        return GPU_PREFILL_BATCH if on_gpu() else 1

    def prefill_chunk(self) -> int:
        """Prompt tokens one prefill forward computes when batching (a running row waits for one chunk at most)."""
        return GPU_PREFILL_CHUNK if on_gpu() else CPU_PREFILL_CHUNK

    def prefill_grant_interval(self) -> int:
        """Decode-only steps between two chunks of a started prompt while rows decode."""
        return GPU_PREFILL_GRANT_INTERVAL if on_gpu() else CPU_PREFILL_GRANT_INTERVAL

    def warmup_rows(self) -> int:
        """Rows up to which decode steps compile one kernel variant a row count (serve's warm-up runs each)."""
        return GPU_PREFILL_BATCH

    def describe(self) -> str:
        """For benchmark headers: what this backend runs (on the CPU, also where its float32 products go)."""
        from .. import cpu_blas

        return "MLX ops (the portable backend)" + ("" if on_gpu() else f"; CPU float32 products: {cpu_blas.status()}")


def readout_of(tokens: mx.array, logits: mx.array) -> mx.array:
    """int32 tokens [N], -1 in rows whose logits [N, V] hold a NaN (MLX ops)."""
    return mx.where(mx.isnan(logits).any(axis=-1), -1, tokens.astype(mx.int32))
