"""Tunable ops of the CUDA decode product kernels, per cell (weight N x K, rows of x M, group size for 4-bit weights,
mode, dtype):
- `qmv-multirow` / `hmv-multirow`: the launch configuration (ROWS, WARPS, UNROLL) of the matvec kernels
  (mlxcel_core/backends/cuda/kernels/qmv.py for 4-bit weights, hmv.py for 16-bit ones), M 1..8;
- `qmm-splits`: GPS, the quantization groups of K a split of the tensor-core batched 4-bit product
  (kernels/qmm.py), M 6..64 (a decode batch of 6 rows or more: kernels/fast_linear.py's DECODE_MATVEC_ROWS), in
  cells of M rounded up to its 8-row tiles.

Modes: the 4-bit kernel's rule is the same in every mode, so its cells are the plain launch's and its winners serve
every mode. The 16-bit kernel's SwiGLU modes (gate and up in one launch) follow a rule of their own, so they have
cells of their own (`swiglu`: the fused gate/up weight); its other modes take the plain cell's winner.

Describing the ops (cells, candidates, the untuned rules: kernels/matvec_config.py) imports no MLX, so
`mlxcel tune --dry-run` stays fast; measuring and the runtime lookup import it.

Runtime: the kernels' launch_args ask `tuned_config` once per launch shape (it is cached there). With MLXCEL_AUTOTUNE
off (the default) the rule decides; with `cache` or `1` a stored winner for the cell does, where there is one (`1`
does not tune these ops on first use, as it does paged-decode-splits: a decode step must not stop to compile and time
a dozen kernel variants; `mlxcel tune --op ...` measures them).

Measuring: random weights (4-bit: quantized at the group size) and M rows of x; each candidate launches CALLS times in
a chain, cycling through enough weight copies that no launch finds its weight in the L2 cache, and the chain is timed
as a replayed CUDA graph, as the engine's decode step runs (autotune/graph_chain.py says why). qmm-splits' chain is
timed through MLX instead (its K splits are summed by an MLX op, which such a graph cannot hold), so MLX's host work per
op is in its figures, the same for every candidate. Each output is checked against the rule's.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from mlxcel_core.backends.cuda.kernels import matvec_config as mc

from . import autotune_dir, autotune_mode

QMV, HMV, QMM = "qmv-multirow", "hmv-multirow", "qmm-splits"
CALLS = 20  # chained launches per timed run: one launch of a small weight is a few microseconds
GROUP_SIZES = (32, 64, 128)
MODES = ("plain", "swiglu")
# Max-abs error against the rule's output, relative to the output's largest magnitude (at least 1): the launches
# differ only in the order of float32 sums, so a few units in the last place of the output dtype.
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Llama-3-8B's decode matvecs (N, K, mode): q/o, k/v, fused q/k/v, fused gate/up, down, LM head.
LLAMA_3_8B_SHAPES = (
    (4096, 4096, "plain"),
    (1024, 4096, "plain"),
    (6144, 4096, "plain"),
    (28672, 4096, "swiglu"),
    (4096, 14336, "plain"),
    (128256, 4096, "plain"),
)
FIELDS = ("rows", "warps", "unroll")  # the matvecs' tactic; qmm-splits' is ("gps",)

# (op, cache dir, mode, runner, device, cell key, dtype) -> (ROWS, WARPS, UNROLL) or None, for the process's life
_RESOLVED: dict[tuple, Optional[tuple[int, ...]]] = {}


def reset() -> None:
    """Forget what this process resolved (tests)."""
    _RESOLVED.clear()


@dataclass(frozen=True)
class Cell:
    n: int
    k: int
    m: int
    group_size: int = 0  # the 4-bit kernel's quantization group; 0 for 16-bit weights
    mode: str = "plain"

    def key(self) -> str:
        group = f"xg{self.group_size}" if self.group_size else ""
        return f"n{self.n}xk{self.k}xm{self.m}{group}" + ("" if self.mode == "plain" else f"x{self.mode}")

    def as_dict(self) -> dict:
        return {"n": self.n, "k": self.k, "m": self.m, "group_size": self.group_size, "mode": self.mode}


@dataclass(frozen=True)
class Spec:
    op: str
    weights: str  # qmv_source's weight kind ("q4" or "half"), or "qmm"
    chunk: int  # K is a multiple of it
    rows: tuple[int, int]  # the rows of x the kernel takes
    fields: tuple[str, ...]
    candidates: Callable[[Cell], list[tuple[int, ...]]]
    rule: Callable[[Cell], tuple[int, ...]]
    modes: tuple[str, ...] = ("plain",)


SPECS = {
    QMV: Spec(
        QMV,
        "q4",
        mc.QMV_CHUNK,
        (1, 8),
        FIELDS,
        lambda c: mc.qmv_candidates(c.k),
        lambda c: mc.qmv_launch_config(c.n, c.k, c.m),
    ),
    HMV: Spec(
        HMV,
        "half",
        mc.HMV_CHUNK,
        (1, 8),
        FIELDS,
        lambda c: mc.hmv_candidates(c.k),
        lambda c: mc.hmv_launch_config(c.n, c.k, c.m, c.mode),
        MODES,
    ),
    QMM: Spec(
        QMM,
        "qmm",
        32,
        (6, 64),
        ("gps",),
        lambda c: [(gps,) for gps in mc.qmm_candidates(c.n, c.k // c.group_size)],
        lambda c: (mc.qmm_split_k(c.n, c.k // c.group_size)[1],),
    ),
}


def cell_of(op: str, n: int, k: int, m: int, group_size: int = 0, mode: str = "plain") -> Cell:
    """The cell a launch of `op` belongs to: qmm-splits' rows rounded up to its 8-row tiles (the kernel compiles per
    tile count), the others' exact."""
    return Cell(n, k, 8 * -(-m // 8) if op == QMM else m, group_size, mode)


def validate(op: str, cell: Cell) -> None:
    spec = SPECS[op]
    lo, hi = spec.rows
    if min(cell.n, cell.k, cell.m) < 1:
        raise ValueError(f"shape {cell.n}x{cell.k} with {cell.m} rows: every size must be positive")
    if not lo <= cell.m <= hi:
        raise ValueError(f"--batch-sizes: {op}'s kernel takes {lo}..{hi} rows of x, got {cell.m}")
    if cell.mode not in spec.modes:
        raise ValueError(f"{op} has no {cell.mode} cells (modes: {', '.join(spec.modes)})")
    if cell.mode == "swiglu" and cell.n % 2:
        raise ValueError(f"shape {cell.n}x{cell.k}: a fused gate/up weight has an even number of rows")
    if spec.weights != "half" and cell.group_size not in GROUP_SIZES:
        raise ValueError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {cell.group_size}")
    if cell.k % spec.chunk or (cell.group_size and cell.k % cell.group_size):
        what = " and of the group size" if cell.group_size else ""
        raise ValueError(f"shape {cell.n}x{cell.k}: K must be a multiple of {spec.chunk}{what}")


def label(config: tuple[int, ...], op: str = QMV) -> str:
    return ",".join(f"{name}={value}" for name, value in zip(SPECS[op].fields, config))


def candidates(op: str, cell: Cell) -> list[tuple[int, ...]]:
    return SPECS[op].candidates(cell)


def default_config(op: str, cell: Cell) -> tuple[int, ...]:
    """The untuned rule (kernels/matvec_config.py); always one of `candidates(op, cell)`."""
    return SPECS[op].rule(cell)


def runner(op: str, mode: str = "plain") -> str:
    """The kernel's name, which carries a hash of its source: winners measured on another build are misses. (The
    tensor-core kernel's source lives beside MLX calls: naming it imports MLX, so a dry run shows `runner_kind`.)"""
    from mlxcel_core.backends.cuda.kernels.qmv_source import kernel_name

    if op == QMM:
        from mlxcel_core.backends.cuda.kernels.qmm import KERNEL_NAME

        return f"cuda-kernel-{KERNEL_NAME}"
    return f"cuda-kernel-{kernel_name(mode, SPECS[op].weights)}"


def runner_kind(op: str) -> str:
    """What a dry run names as the runner (no MLX import)."""
    return "cuda-kernel-mlxcel_qmm_mma (and its build's hash)" if op == QMM else runner(op)


def shapes_from_config(config: dict) -> list[tuple[int, int, str]]:
    """The decode matvecs of a config.json (its text_config first), as (N, K, mode): q, k/v, the fused q/k/v, o, the
    fused gate/up (its SwiGLU launch), down and the LM head, without repeats."""
    text = config.get("text_config")
    cfg = {**config, **text} if isinstance(text, dict) else config
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if not isinstance(hidden, int) or not isinstance(heads, int) or hidden < 1 or heads < 1:
        raise ValueError("config.json needs hidden_size and num_attention_heads for the matvec shapes")
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    inter = cfg.get("intermediate_size")
    shapes = [(heads * head_dim, hidden), (kv * head_dim, hidden), ((heads + 2 * kv) * head_dim, hidden)]
    out = [(n, k, "plain") for n, k in [*shapes, (hidden, heads * head_dim)]]
    if isinstance(inter, int) and inter > 0:
        out += [(2 * inter, hidden, "swiglu"), (hidden, inter, "plain")]
    if isinstance(cfg.get("vocab_size"), int):
        out.append((cfg["vocab_size"], hidden, "plain"))
    return list(dict.fromkeys(out))


# -- runtime (imports MLX through the device identity) -----------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _mode(raw: str):
    return autotune_mode(raw)  # (cached per value: an unknown one warns once, not once per shape)


def tuned_config(op: str, n: int, k: int, m: int, group_size: int, mode: str, x_dtype) -> Optional[tuple[int, ...]]:
    """The stored winner for this launch's cell where MLXCEL_AUTOTUNE reads the cache, else None (the rule
    decides)."""
    from mlxcel_core import settings

    read = _mode(settings.get("MLXCEL_AUTOTUNE"))
    if read == "off":
        return None
    from .ops import device_identity

    cell, device, dtype = cell_of(op, n, k, m, group_size, mode), device_identity(), str(x_dtype).rpartition(".")[2]
    memo = (op, str(autotune_dir()), read, runner(op, mode), device, cell.key(), dtype)
    if memo not in _RESOLVED:
        _RESOLVED[memo] = _lookup(op, cell, device, dtype)
    return _RESOLVED[memo]


def _lookup(op: str, cell: Cell, device: str, dtype: str) -> Optional[tuple[int, ...]]:
    from .store import Key, Store

    fields, labels = SPECS[op].fields, [label(c, op) for c in candidates(op, cell)]
    record = Store().load(Key(op, runner(op, cell.mode), device, cell.key(), dtype), candidates=labels)
    if record is None:
        return None
    config = tuple(record["tactic"]["params"].get(name) for name in fields)
    if config not in candidates(op, cell) or label(config, op) != record["tactic"]["label"]:
        print(
            f"mlxcel: warning: autotune cache: bad tactic {record['tactic']!r} for {op} {cell.key()}; ignoring it",
            file=sys.stderr,
        )
        return None
    return config


# -- measuring (imports MLX; the CUDA kernels only) --------------------------------------------------------------


def _validator(dtype: str):
    import mlx.core as mx

    def check(out, ref):
        a, b = out.astype(mx.float32), ref.astype(mx.float32)
        if not mx.all(mx.isfinite(a)).item():
            return "non-finite output"
        err, scale = mx.max(mx.abs(a - b)).item(), max(1.0, mx.max(mx.abs(b)).item())
        limit = TOLERANCE[dtype] * scale
        return None if err <= limit else f"output differs from the default's: max abs error {err:.3g} > {limit:.3g}"

    return check


def _weight_bytes(op: str, cell: Cell, dtype: str) -> int:
    if op in (QMV, QMM):  # 4-bit values, a scale and a bias per group
        return cell.n * cell.k // 2 + 2 * cell.n * (cell.k // cell.group_size) * DTYPE_BYTES[dtype]
    return cell.n * cell.k * DTYPE_BYTES[dtype]


def _launcher(op: str, cell: Cell, dtype: str, copies: int):
    """(x, launch(x, config, copy)) for the cell's kernel on `copies` random weights."""
    import mlx.core as mx

    from mlxcel_core.backends.cuda.kernels import hmv, qmm, qmv

    dt = getattr(mx, dtype)
    kx, *kws = mx.random.split(mx.random.key(cell.n * 7 + cell.k), copies + 1)
    x = mx.random.normal((cell.m, cell.k), key=kx).astype(dt)
    ws = [(mx.random.normal((cell.n, cell.k), key=kw) * 0.02).astype(dt) for kw in kws]
    if op in (QMV, QMM):
        qs = [mx.quantize(w, group_size=cell.group_size, bits=4) for w in ws]
        mx.eval(qs, x)
        if op == QMM:
            return x, lambda xi, c, i: qmm.quantized_matmul(xi, *qs[i], cell.group_size, gps=c[0])
        return x, lambda xi, c, i: qmv.cuda_quantized_matvec(xi, *qs[i], cell.group_size, config=c)
    mx.eval(ws, x)

    def launch(xi, c, i):
        w = ws[i]
        return hmv.launch(hmv.launch_args(xi.shape, xi.dtype, w.dtype, cell.n, c, mode=cell.mode), xi, w, cell.mode)

    return x, launch


def profile_cell(op: str, cell: Cell, dtype: str, settings, progress=None):
    """Profile every candidate of `cell` on random weights, each as a replayed CUDA graph (autotune/graph_chain.py),
    qmm-splits' through MLX; returns (default config, ProfileResult)."""
    import mlx.core as mx

    from mlxcel_core.backends.cuda.kernels import qmv

    from .graph_chain import GraphChains, weight_copies
    from .profiler import Candidate, profile

    if not qmv.kernel_ready():
        raise RuntimeError(f"{op} measures a CUDA matvec kernel: MLX has no CUDA device here")
    copies = weight_copies(_weight_bytes(op, cell, dtype), CALLS)
    x, launch = _launcher(op, cell, dtype, copies)

    def chain(config):
        def run():
            y = launch(x, config, 0)
            for i in range(1, CALLS):
                y = launch(mx.depends(x, y), config, i % copies)
            return y

        return run

    default = default_config(op, cell)
    fields = SPECS[op].fields
    if op == QMM:  # MLX sums its K splits, an op a graph of our kernels cannot replay: MLX runs (and times) it
        cands = [Candidate(label(c, op), chain(c), dict(zip(fields, c))) for c in candidates(op, cell)]
        check = _validator(dtype)
        return default, profile(cands, label(default, op), settings, validate=check, sync=mx.eval, progress=progress)
    graphs = GraphChains()

    def replayed(config):
        try:
            return graphs.capture(chain(config))
        except Exception as exc:  # noqa: BLE001 - the profiler drops and reports a candidate whose run raises
            reason = exc

            def failed():
                raise reason

            return failed

    try:
        cands = [Candidate(label(c, op), replayed(c), dict(zip(fields, c))) for c in candidates(op, cell)]
        result = profile(
            cands, label(default, op), settings, validate=_validator(dtype), sync=graphs.sync, progress=progress
        )
    finally:
        graphs.close()
    return default, result


def entry_from_result(op: str, cell: Cell, device: str, dtype: str, default: tuple[int, ...], result):
    """A cache Entry for a usable ProfileResult (latencies are per launch: the chain's over CALLS)."""
    from .store import Key, entry_from_profile

    fields = SPECS[op].fields
    params = {name: int(part.split("=")[1]) for name, part in zip(fields, result.best.label.split(","))}
    key = Key(op, runner(op, cell.mode), device, cell.key(), dtype)
    default_tactic = (label(default, op), dict(zip(fields, default)))
    return entry_from_profile(key, result, params, default_tactic, cell.as_dict(), per_run=CALLS)
