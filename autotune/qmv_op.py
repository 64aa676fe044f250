"""Tunable op `qmv-multirow`: the launch configuration (ROWS, WARPS, UNROLL) of the CUDA 4-bit matrix-vector kernel
(mlxcel_core/backends/cuda/kernels/qmv.py) per cell: weight N x K, rows of x M (1..8, the decode batch), group size
and dtype.

Describing the op (cells, candidates, the untuned rule: kernels/qmv_config.py) imports no MLX, so
`mlxcel tune --op qmv-multirow --dry-run` stays fast; measuring and the runtime lookup import it.

Runtime: qmv.launch_args asks `tuned_config` once per launch shape (it is cached there). With MLXCEL_AUTOTUNE off (the
default) the rule decides; with `cache` or `1` a stored winner for the cell does, where there is one (`1` does not tune
this op on first use, as it does paged-decode-splits: a decode step must not stop to compile and time a dozen kernel
variants; `mlxcel tune --op qmv-multirow` measures them).

Measuring: random 4-bit weights (N x K at the group size) and M rows of x; each candidate launches CALLS times in a
chain (each launch's x depends on the previous launch's output through mx.depends, so they run one after another as a
model's projections do, not side by side in MLX's CUDA graph), and its output is checked against the rule's.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Optional

from mlxcel_core.backends.cuda.kernels import qmv_config

from . import autotune_dir, autotune_mode

OP = "qmv-multirow"
CALLS = 20  # chained launches per timed run: one launch of a small weight is a few microseconds
MAX_ROWS = 8  # qmv.MAX_ROWS: more rows of x go to MLX's quantized matmul, not this kernel
GROUP_SIZES = (32, 64, 128)
DTYPES = ("float16", "bfloat16", "float32")
# Max-abs error against the rule's output, relative to the output's largest magnitude (at least 1): the launches
# differ only in the order of float32 sums, so a few units in the last place of the output dtype.
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}
LLAMA_3_8B_SHAPES = ((4096, 4096), (1024, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096))

# (cache dir, mode, runner, device, cell key, dtype) -> (ROWS, WARPS, UNROLL) or None, for the life of the process
_RESOLVED: dict[tuple, Optional[tuple[int, int, int]]] = {}


def reset() -> None:
    """Forget what this process resolved (tests)."""
    _RESOLVED.clear()


@dataclass(frozen=True)
class Cell:
    n: int
    k: int
    m: int
    group_size: int = 64

    def validate(self) -> None:
        if min(self.n, self.k, self.m) < 1:
            raise ValueError(f"shape {self.n}x{self.k} with {self.m} rows: every size must be positive")
        if self.m > MAX_ROWS:
            raise ValueError(f"--batch-sizes: the kernel takes 1..{MAX_ROWS} rows of x, got {self.m}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {self.group_size}")
        if self.k % qmv_config.CHUNK or self.k % self.group_size:
            raise ValueError(
                f"shape {self.n}x{self.k}: K must be a multiple of {qmv_config.CHUNK} and of the group size"
            )

    def key(self) -> str:
        return f"n{self.n}xk{self.k}xm{self.m}xg{self.group_size}"

    def as_dict(self) -> dict[str, int]:
        return {"n": self.n, "k": self.k, "m": self.m, "group_size": self.group_size}


def label(config: tuple[int, int, int]) -> str:
    rows, warps, unroll = config
    return f"rows={rows},warps={warps},unroll={unroll}"


def candidates(cell: Cell) -> list[tuple[int, int, int]]:
    return qmv_config.candidates(cell.k)


def default_config(cell: Cell) -> tuple[int, int, int]:
    """The untuned rule (qmv_config.launch_config); always one of `candidates(cell)`."""
    return qmv_config.launch_config(cell.n, cell.k, cell.m)


def runner() -> str:
    """The kernel's name, which carries a hash of its source: winners measured on another build are misses."""
    from mlxcel_core.backends.cuda.kernels.qmv_source import kernel_name

    return f"cuda-kernel-{kernel_name('plain')}"


def shapes_from_config(config: dict) -> list[tuple[int, int]]:
    """The decode matvecs' N x K of a config.json (its text_config first): q, k/v, the fused q/k/v, o, the fused
    gate/up, down and the LM head, without repeats."""
    text = config.get("text_config")
    cfg = {**config, **text} if isinstance(text, dict) else config
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if not isinstance(hidden, int) or not isinstance(heads, int) or hidden < 1 or heads < 1:
        raise ValueError("config.json needs hidden_size and num_attention_heads for the matvec shapes")
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    inter = cfg.get("intermediate_size")
    shapes = [(heads * head_dim, hidden), (kv * head_dim, hidden), ((heads + 2 * kv) * head_dim, hidden)]
    shapes.append((hidden, heads * head_dim))
    if isinstance(inter, int) and inter > 0:
        shapes += [(2 * inter, hidden), (hidden, inter)]
    if isinstance(cfg.get("vocab_size"), int):
        shapes.append((cfg["vocab_size"], hidden))
    return list(dict.fromkeys(shapes))


# -- runtime (imports MLX through the store's device identity) ---------------------------------------------------


@functools.lru_cache(maxsize=16)
def _mode(raw: str):
    return autotune_mode(raw)  # (cached per value: an unknown one warns once, not once per shape)


def tuned_config(n: int, k: int, m: int, group_size: int, dtype: str) -> Optional[tuple[int, int, int]]:
    """The stored winner for this cell where MLXCEL_AUTOTUNE reads the cache, else None (the rule decides)."""
    from mlxcel_core import settings

    mode = _mode(settings.get("MLXCEL_AUTOTUNE"))
    if mode == "off":
        return None
    from .ops import device_identity

    cell, device = Cell(n, k, m, group_size), device_identity()
    memo = (str(autotune_dir()), mode, runner(), device, cell.key(), dtype)
    if memo not in _RESOLVED:
        _RESOLVED[memo] = _lookup(cell, device, dtype)
    return _RESOLVED[memo]


def _lookup(cell: Cell, device: str, dtype: str) -> Optional[tuple[int, int, int]]:
    from .store import Key, Store

    labels = [label(c) for c in candidates(cell)]
    record = Store().load(Key(OP, runner(), device, cell.key(), dtype), candidates=labels)
    if record is None:
        return None
    params = record["tactic"]["params"]
    config = tuple(params.get(name) for name in ("rows", "warps", "unroll"))
    if config not in candidates(cell) or label(config) != record["tactic"]["label"]:
        print(
            f"mlxcel: warning: autotune cache: bad tactic {record['tactic']!r} for {OP} {cell.key()}; ignoring it",
            file=sys.stderr,
        )
        return None
    return config


# -- measuring (imports MLX; the CUDA kernel only) ---------------------------------------------------------------


def _validator(dtype: str):
    import mlx.core as mx

    def validate(out, ref):
        a, b = out.astype(mx.float32), ref.astype(mx.float32)
        if not mx.all(mx.isfinite(a)).item():
            return "non-finite output"
        err, scale = mx.max(mx.abs(a - b)).item(), max(1.0, mx.max(mx.abs(b)).item())
        limit = TOLERANCE[dtype] * scale
        return None if err <= limit else f"output differs from the default's: max abs error {err:.3g} > {limit:.3g}"

    return validate


def profile_cell(cell: Cell, dtype: str, settings, progress=None):
    """Profile every candidate of `cell` on random weights; returns (default config, ProfileResult)."""
    import mlx.core as mx

    from mlxcel_core.backends.cuda.kernels import qmv

    from .profiler import Candidate, profile

    if not qmv.kernel_ready():
        raise RuntimeError(f"{OP} measures the CUDA 4-bit matvec kernel: MLX has no CUDA device here")
    dt = getattr(mx, dtype)
    kw, kx = mx.random.split(mx.random.key(cell.n * 7 + cell.k))
    w = (mx.random.normal((cell.n, cell.k), key=kw) * 0.02).astype(dt)
    wq, scales, biases = mx.quantize(w, group_size=cell.group_size, bits=4)
    x = mx.random.normal((cell.m, cell.k), key=kx).astype(dt)
    mx.eval(wq, scales, biases, x)

    def chain(config):
        def run():
            y = qmv.cuda_quantized_matvec(x, wq, scales, biases, cell.group_size, config=config)
            for _ in range(CALLS - 1):
                y = qmv.cuda_quantized_matvec(mx.depends(x, y), wq, scales, biases, cell.group_size, config=config)
            return y

        return run

    default = default_config(cell)
    cands = [Candidate(label(c), chain(c), dict(zip(("rows", "warps", "unroll"), c))) for c in candidates(cell)]
    result = profile(cands, label(default), settings, validate=_validator(dtype), sync=mx.eval, progress=progress)
    return default, result


def entry_from_result(cell: Cell, device: str, dtype: str, default: tuple[int, int, int], result):
    """A cache Entry for a usable ProfileResult of this op (latencies are per launch: the chain's over CALLS)."""
    from .store import Entry, Key

    best, ref = result.best, result.default_measurement
    params = dict(zip(("rows", "warps", "unroll"), (int(v) for v in best.label.replace(",", "=").split("=")[1::2])))
    return Entry(
        key=Key(OP, runner(), device, cell.key(), dtype),
        tactic={"label": best.label, "params": params},
        latency_us=best.median_us / CALLS,
        default_tactic={"label": label(default), "params": dict(zip(("rows", "warps", "unroll"), default))},
        default_latency_us=ref.median_us / CALLS,
        candidates=list(result.candidates),
        reps=result.reps,
        spread=best.spread,
        default_spread=ref.spread,
        required_improvement=result.required_improvement,
        bucket_fields=cell.as_dict(),
    )
