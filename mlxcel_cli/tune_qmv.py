"""`mlxcel tune --op qmv-multirow`: the CUDA 4-bit matvec kernel's launch configuration per weight shape and rows of x
(autotune/qmv_op.py); tune.py parses the shared options and hands them here."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import fail

HEADER = (
    f"{'shape':>13} {'rows':>4} | {'default':>24} {'default_us':>10} {'selected':>24} {'best_us':>8} "
    f"{'spread':>7} {'reps':>5} {'speedup':>8}"
)


@dataclass
class Request:
    shapes: list[tuple[int, int]]
    rows: list[int]
    group_size: int
    dtype: str
    settings: object  # autotune.profiler.ProfileSettings
    directory: Path
    as_json: bool


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """`--shapes 4096x4096,1024x4096`: N x K of each weight."""
    shapes = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        n, _, k = item.lower().partition("x")
        if not (n.isdigit() and k.isdigit() and int(n) > 0 and int(k) > 0):
            raise fail(f"--shapes must be a comma-separated list of NxK (positive integers), got '{text}'")
        shapes.append((int(n), int(k)))
    if not shapes:
        raise fail(f"--shapes must be a comma-separated list of NxK (positive integers), got '{text}'")
    return list(dict.fromkeys(shapes))


def cells(request: Request) -> list:
    from autotune.qmv_op import Cell

    out = [Cell(n, k, m, request.group_size) for n, k in request.shapes for m in request.rows]
    for cell in out:
        try:
            cell.validate()
        except ValueError as exc:
            raise fail(str(exc))
    return out


def dry_run(request: Request) -> None:
    from autotune.qmv_op import OP, candidates, default_config, label, runner

    rows = [
        {
            "n": c.n,
            "k": c.k,
            "rows": c.m,
            "cell": c.key(),
            "default": label(default_config(c)),
            "candidates": [label(x) for x in candidates(c)],
        }
        for c in cells(request)
    ]
    head = {"dry_run": True, "cache_dir": str(request.directory), "op": OP, "runner": runner()}
    if request.as_json:
        body = {**head, "profile": request.settings.__dict__, "dtype": request.dtype, "cells": rows}
        print(json.dumps(body, indent=2))
        return
    print(f"autotune cache: {request.directory}")
    print(f"profile: {request.settings.describe()}")
    print(f"runner: {head['runner']} (the CUDA 4-bit matvec kernel; ROWS, WARPS, UNROLL launch configuration)")
    print(f"{OP}: group_size={request.group_size} dtype={request.dtype}")
    print(f"{'shape':>13} {'rows':>4} | {'default':>24}  candidates (rows,warps)")
    for row in rows:
        pairs = " ".join(c.replace("rows=", "").replace(",warps=", ",").split(",unroll")[0] for c in row["candidates"])
        print(f"{row['n']:>6}x{row['k']:<6} {row['rows']:>4} | {row['default']:>24}  {pairs}  (dry run)")
    print(f"dry run: {len(rows)} cells, nothing measured or written.")


def run(request: Request) -> None:
    from autotune.ops import device_identity
    from autotune.qmv_op import OP, entry_from_result, label, profile_cell, runner
    from autotune.store import Store
    from mlxcel_core.backends import current

    todo = cells(request)
    if not current().name.startswith("cuda"):
        raise fail(f"--op {OP} tunes the CUDA 4-bit matvec kernel: this machine has no MLX CUDA device")
    device, store, out = device_identity(), Store(request.directory), []
    emit = (lambda line: None) if request.as_json else (lambda line: print(line, flush=True))
    emit(f"autotune cache: {request.directory}")
    emit(f"runner: {runner()} device: {device}")
    emit(f"{OP}: group_size={request.group_size} dtype={request.dtype}")
    emit(HEADER)
    for cell in todo:
        print(f"mlxcel: tune: {cell.n}x{cell.k} rows {cell.m}...", file=sys.stderr, flush=True)
        default, result = profile_cell(cell, request.dtype, request.settings)
        row = {"cell": cell.key(), "default": label(default), "candidates": result.candidates, "selected": None}
        row["dropped"] = [{"tactic": t, "reason": r} for t, r in result.dropped]
        if result.usable:
            entry = entry_from_result(cell, device, request.dtype, default, result)
            row.update(selected=result.selected, default_us=entry.default_latency_us, best_us=entry.latency_us)
            row.update(speedup=result.speedup, cache_file=str(store.save(entry)))
            emit(
                f"{cell.n:>6}x{cell.k:<6} {cell.m:>4} | {label(default):>24} {entry.default_latency_us:>10.2f} "
                f"{result.selected:>24} {entry.latency_us:>8.2f} {result.best.spread * 100:>6.1f}% {result.reps:>5} "
                f"{result.speedup:>7.3f}x"
            )
        else:
            emit(f"{cell.n:>6}x{cell.k:<6} {cell.m:>4} | skipped (no usable measurement)")
        for tactic, reason in result.dropped:
            emit(f"{'':>19}   dropped {tactic}: {reason}")
        out.append(row)
    if request.as_json:
        print(json.dumps({"dry_run": False, "op": OP, "runner": runner(), "device": device, "cells": out}, indent=2))
    else:
        print("done. Set MLXCEL_AUTOTUNE=cache (or 1) to use these launch configurations.")
