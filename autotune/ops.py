"""Tunable ops. One so far: `paged-decode-splits`, the split-K factor of paged decode attention.

Everything that only describes the op (buckets, candidates, the default heuristic) imports no MLX, so
`mlxcel tune --dry-run` stays fast; measuring imports it.

Candidates: the powers of two up to the cap, plus the cap, where the cap is
min(32, context bucket / block size) for the MLX-ops path and min(256, ...) for the CUDA kernel: no split gets
less than one block of the context.

Default (the built-in heuristic, what runs when nothing is tuned):
- MLX-ops path (CPU, Metal, CUDA without the kernel): 1 split below 4096 tokens of context, then one
  split per 2048 tokens (4096 -> 2, 8192 -> 4, 16384 -> 8), capped. On CPU the partition barely matters
  below that (measured: within noise at 1024 tokens) and a few splits help a little at 16384 tokens.
- CUDA kernel: enough thread blocks to fill the GPU. One split launches batch x kv heads x query-head
  groups blocks of 128 threads; double the splits until that reaches 512 blocks (about four per SM of
  an H100/H200), while every split keeps at least 64 tokens (of the context bucket), capped. With the
  tensor-core body (head dims of 32..128 in steps of 32, 16-bit q and KV: 167 registers a thread, three
  blocks an SM at head dim 128, where the rule is measured), double them only while the grid stays within 384
  blocks, one wave of an H200's 396, and the splits within 2 x head dim (what its last block merges in one launch):
  one wave beats two at a 32k-token context (benchmarks/RESULTS.md, the kernels-alone table). A float32 model's
  calls run the lane groups and get their rule. (A first H200
  run of `mlxcel tune` with a 256-block target found 2x more splits 14-34% faster at batch 8, context
  4096-16384. Batch 1 at a 528-token context, in a whole decode step on the H200: 16 splits cost 12.5 us a
  layer with the combine step against 22.6 us at 4, the split this rule chose while it asked 256 tokens. At a
  32k-token context the cap of 32 splits this op had left batch 1 at 256 blocks: the kernel took 176 us a layer,
  reading the layer's 134 MB of KV at 0.76 TB/s, three quarters of the decode step.)
"""

from __future__ import annotations

from dataclasses import dataclass

OP = "paged-decode-splits"
MAX_SPLITS = 32  # the MLX-ops path's cap
MAX_CUDA_SPLITS = 256  # the CUDA kernel's cap (its last block merges S splits where 2 S <= warps-or-lane-groups x D)
MIN_CUDA_SPLIT_TOKENS = 64  # the CUDA kernel's default never splits the context bucket finer than this
CUDA_TARGET_BLOCKS = 512  # the lane-group body's grid target (four blocks an SM)
MMA_TARGET_BLOCKS = 384  # the tensor-core body's: one wave of three blocks an SM
RUNNER_OPS = "mlx-ops"
DTYPES = ("float16", "bfloat16", "float32")
# Max-abs tolerance when checking a candidate's output against the default's (both computed in float32
# and rounded to the dtype: a few units in the last place of values below 1).
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


def pow2_ceil(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class Geometry:
    head_dim: int = 128
    q_heads: int = 32
    kv_heads: int = 8
    block_size: int = 32

    def validate(self) -> None:
        for name, value in (
            ("--head-dim", self.head_dim),
            ("--q-heads", self.q_heads),
            ("--kv-heads", self.kv_heads),
            ("--block-size", self.block_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"--q-heads ({self.q_heads}) must be a multiple of --kv-heads ({self.kv_heads})")

    def describe(self) -> str:
        return f"head_dim={self.head_dim} q_heads={self.q_heads} kv_heads={self.kv_heads} block_size={self.block_size}"


@dataclass(frozen=True)
class Bucket:
    """The shape class a tactic is stored under: batch and context rounded up to powers of two."""

    batch: int
    context: int
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int

    @classmethod
    def of(cls, batch: int, context: int, geometry: Geometry) -> "Bucket":
        return cls(
            pow2_ceil(batch),
            pow2_ceil(max(context, geometry.block_size)),
            geometry.q_heads,
            geometry.kv_heads,
            geometry.head_dim,
            geometry.block_size,
        )

    def key(self) -> str:
        return f"b{self.batch}xc{self.context}xhq{self.q_heads}xhkv{self.kv_heads}xd{self.head_dim}xbs{self.block_size}"

    def as_dict(self) -> dict[str, int]:
        return {
            "batch": self.batch,
            "context": self.context,
            "q_heads": self.q_heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
        }


def label(num_splits: int) -> str:
    return f"num_splits={num_splits}"


def split_cap(bucket: Bucket, runner: str) -> int:
    most = MAX_CUDA_SPLITS if runner.startswith("cuda-kernel") else MAX_SPLITS
    return max(1, min(most, bucket.context // bucket.block_size))


def candidates(bucket: Bucket, runner: str) -> list[int]:
    """Powers of two up to the runner's cap, plus the cap."""
    cap = split_cap(bucket, runner)
    out, s = [], 1
    while s <= cap:
        out.append(s)
        s *= 2
    if out[-1] != cap:
        out.append(cap)
    return out


def query_groups(q_heads: int, kv_heads: int, head_dim: int, mma: bool) -> int:
    """Thread blocks per kv head in the CUDA kernel, of the tensor-core body or the lane groups (see
    backends/cuda/paged_attention.launch_geometry)."""
    # (imported here: a machine without the CUDA kernel never loads the CUDA wing; the module imports no MLX)
    from mlxcel_core.backends.cuda.paged_attention_source import geometry

    n_rep = q_heads // kv_heads
    return n_rep // geometry(head_dim, n_rep, mma)["G"]


def default_splits(bucket: Bucket, runner: str, dtype: str) -> int:
    """The built-in heuristic (module docstring) for q and pools of `dtype` (a name, one of DTYPES); always one of
    `candidates(bucket, runner)`."""
    cap = split_cap(bucket, runner)
    if runner.startswith("cuda-kernel"):
        from mlxcel_core.backends.cuda.paged_attention_source import body_is_mma  # (as in query_groups)

        mma = body_is_mma(dtype, bucket.head_dim)
        blocks = bucket.batch * bucket.kv_heads * query_groups(bucket.q_heads, bucket.kv_heads, bucket.head_dim, mma)
        if mma:  # (the grid after doubling stays within one wave)
            grows = lambda s: blocks * s * 2 <= MMA_TARGET_BLOCKS and s * 2 <= 2 * bucket.head_dim  # noqa: E731
        else:  # (doubling until the grid reaches the target)
            grows = lambda s: blocks * s < CUDA_TARGET_BLOCKS  # noqa: E731
        s = 1
        while s * 2 <= cap and grows(s) and bucket.context // (s * 2) >= MIN_CUDA_SPLIT_TOKENS:
            s *= 2
        return s
    s = 1
    while s * 2 <= cap and bucket.context // (s * 2) >= 2048:
        s *= 2
    return s


def predicted_runner() -> str:
    """The runner a real run would use, guessed without importing MLX (for --dry-run): the CUDA kernel
    when an mlx-cuda backend is installed, else the MLX-ops path."""
    from importlib.metadata import distributions

    for dist in distributions():
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
        if name.startswith("mlx-cuda"):
            from mlxcel_core.backends.cuda.paged_attention_source import RUNNER_CUDA  # (imports no MLX)

            return RUNNER_CUDA
    return RUNNER_OPS


def describe_runner(runner: str) -> str:
    if runner.startswith("cuda-kernel"):
        return f"{runner} (paged-decode CUDA kernel, split-K launch parameter)"
    return f"{runner} (MLX ops: split, reduce, merge; no custom kernel on this backend)"


# -- measuring (imports MLX) ------------------------------------------------------------------------


def device_identity() -> str:
    """A short stable name of the device tactics were measured on: backend, name, arch, memory, cores."""
    import os

    import mlx.core as mx

    info = {}
    try:
        info = dict(mx.device_info())
    except Exception:
        pass
    gpu = mx.default_device().type == mx.DeviceType.gpu
    parts = [
        "gpu" if gpu else "cpu",
        str(info.get("device_name") or info.get("name") or "unknown"),
        str(info.get("architecture") or ""),
    ]
    mem = info.get("memory_size") or info.get("total_memory")
    if isinstance(mem, (int, float)) and mem > 0:
        parts.append(f"{round(mem / 2**30)}gb")
    if not gpu:
        parts.append(f"{os.cpu_count()}c")
    text = "-".join(p for p in parts if p)
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in text.lower().replace(" ", "-"))


def current_runner(head_dim: int) -> str:
    from mlxcel_core import backends

    return backends.current().paged_runner(head_dim)


def mlx_dtype(name: str):
    import mlx.core as mx

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(mx, name)


def workload(batch: int, context: int, geometry: Geometry, dtype: str, seed: int = 0):
    """Synthetic inputs, no weights: random pools with twice the blocks needed, every row at `context`
    tokens, block tables in reversed order over every other block (no two logical neighbours adjacent)."""
    import mlx.core as mx

    dt = mlx_dtype(dtype)
    per_row = -(-context // geometry.block_size)
    needed = batch * per_row
    total = 2 * needed
    key = mx.random.key(seed)
    kq, kk, kv = mx.random.split(key, 3)
    shape = (total, geometry.block_size, geometry.kv_heads, geometry.head_dim)
    k_pool = mx.random.uniform(-1, 1, shape, key=kk).astype(dt)
    v_pool = mx.random.uniform(-1, 1, shape, key=kv).astype(dt)
    tables = (total - 1 - 2 * mx.arange(needed, dtype=mx.int32)).reshape(batch, per_row)
    lens = mx.full((batch,), context, dtype=mx.int32)
    q = mx.random.uniform(-1, 1, (batch, geometry.q_heads, geometry.head_dim), key=kq).astype(dt)
    mx.eval(q, k_pool, v_pool, tables, lens)
    return q, k_pool, v_pool, tables, lens


def decode_step_inputs(q, k_pool, tables, context: int) -> dict:
    """What a decode step hands the backend's kernel besides the workload, so the tuner times the launch decode runs:
    the step's own keys and values (written in place at each row's last position, the same values every call) where
    the kernel writes them, and the combine counters where it keeps them."""
    import mlx.core as mx

    from mlxcel_core import backends

    backend = backends.current()
    inputs = {}
    if backend.kv_written_in_kernel:
        batch, (_, block_size, kv_heads, head_dim) = q.shape[0], k_pool.shape
        last = context - 1
        k_new = mx.random.uniform(-1, 1, (batch, kv_heads, head_dim), key=mx.random.key(7)).astype(k_pool.dtype)
        inputs["new_kv"] = (
            k_new,
            -k_new,
            tables[:, last // block_size],
            mx.full((batch,), last % block_size, dtype=mx.int32),
        )
    counters = backend.combine_counters(1)[0]
    if counters is not None:
        inputs["counters"] = counters
    mx.eval(inputs)
    return inputs


def _validator(dtype: str):
    import mlx.core as mx

    tol = TOLERANCE[dtype]

    def validate(out, ref):
        a, b = out.astype(mx.float32), ref.astype(mx.float32)
        if a.shape != b.shape:
            return f"output shape {a.shape} != {b.shape}"
        if not mx.all(mx.isfinite(a)).item():
            return "non-finite output"
        err = mx.max(mx.abs(a - b)).item()
        return None if err <= tol else f"output differs from the default's: max abs error {err:.3g} > {tol:g}"

    return validate


def profile_cell(
    batch: int, context: int, geometry: Geometry, dtype: str, settings, runner: str | None = None, progress=None
):
    """Profile every candidate of the cell's bucket on a synthetic workload of exactly (batch, context).

    Returns (bucket, runner, default num_splits, ProfileResult)."""
    import mlx.core as mx

    from mlxcel_core import backends

    from .profiler import Candidate, profile

    runner = runner or current_runner(geometry.head_dim)
    bucket = Bucket.of(batch, context, geometry)
    splits = candidates(bucket, runner)
    default = default_splits(bucket, runner, dtype)
    attention = backends.current().paged_attention(runner)
    q, k_pool, v_pool, tables, lens = workload(batch, context, geometry, dtype)
    decode_inputs = decode_step_inputs(q, k_pool, tables, context) if runner.startswith("cuda-kernel") else {}

    def runner_of(s):
        return lambda: attention(q, k_pool, v_pool, tables, lens, num_splits=s, **decode_inputs)

    cands = [Candidate(label(s), runner_of(s), {"num_splits": s}) for s in splits]
    result = profile(cands, label(default), settings, validate=_validator(dtype), sync=mx.eval, progress=progress)
    return bucket, runner, default, result
