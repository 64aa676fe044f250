"""Every environment variable the core, the backends and autotune read, declared once (as vLLM's envs.py).

    from mlxcel_core import settings
    settings.get("MLXCEL_CACHE_DIR")        # the parsed value, or the default

Each `Setting` has a name, a parser, a default and a help line; docs/settings.md is generated from this list
(`python scripts/gen_settings_doc.py`), and tests/mlxcel_core/test_settings.py fails on an `MLXCEL_*` name read
anywhere that is not declared here or on a declared one that nothing reads. Values are read at each call, not at
import, so a test or a caller may set one and see it take effect.

The `mlxcel` commands' own options have mirrors too (`serve --port` has one, ...): those are declared
with their options in mlxcel_cli (typer's `envvar`), and docs/settings.md lists them beside these.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # for the docs: "path", "int", "float", "0/1", or the accepted words
    default: object
    help: str
    parse: Callable[[str], object]


def _path(raw: str) -> str:
    return os.path.expanduser(raw)


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be 0 or more")
    return value


def _mma_depth(raw: str) -> int:
    value = int(raw)
    if not 2 <= value <= 4:
        raise ValueError("must be 2, 3 or 4")
    return value


def _float(raw: str) -> float:
    return float(raw)


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be a number > 0")
    return value


def _switch(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return raw == "1"


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "MLXCEL_CACHE_DIR",
        "path",
        None,
        "Where mlxcel keeps fetched models, compiled kernels and autotune results (default: the platform's user "
        "cache dir, e.g. ~/.cache/mlxcel).",
        _path,
    ),
    Setting(
        "MLXCEL_CUDA",
        "0/1",
        True,
        "0 turns the whole CUDA wing off (our kernels, the decode-step graph): MLX's own ops run, as on any "
        "other backend. The kill switch for a suspected kernel problem.",
        _switch,
    ),
    Setting(
        "MLXCEL_CPU_BLAS",
        "0/1",
        True,
        "0 leaves MLX's float32 products on the CPU to the reference BLAS of MLX's Linux wheel instead of "
        "mlxcel's AVX2 kernel (or, without AVX2, OpenBLAS in fixed row tiles: cpu_blas.py). Read when mlxcel_core is "
        "imported.",
        _switch,
    ),
    Setting(
        "MLXCEL_AUTOTUNE",
        "0, cache, 1",
        "",
        "Tuned kernel parameters (paged-decode splits, the CUDA matvec's launch): 0 (or unset) never reads the "
        "autotune cache, `cache` uses stored results, 1 also tunes a paged-decode shape on its first use "
        "(`mlxcel tune` fills the cache ahead). autotune/__init__.py "
        "parses it (and its synonyms).",
        str,
    ),
    Setting(
        "MLXCEL_PAGED_DECODE_SPLITS",
        "int",
        None,
        "Split-K factor of paged decode attention for every shape, over the autotune cache and the heuristic.",
        _positive_int,
    ),
    Setting(
        "MLXCEL_PDL_PREFETCH",
        "MiB",
        0,
        "Experiment (issue 42): N > 0 has the decode matvec kernels (4-bit and 16-bit) ask L2 for the first part of "
        "their block's weight rows, at most N MiB a launch, and the paged attention kernel for its split's first keys "
        "and values, before they wait for the previous kernel, where kernels chain by programmatic dependent launch "
        "(a replayed decode step on sm_90 or newer), so that read overlaps the previous kernel's end. 0 leaves it "
        "out. Read when a kernel is first built in a process.",
        _non_negative_int,
    ),
    Setting(
        "MLXCEL_PAGED_MMA_DEPTH",
        "int",
        2,
        "Experiment (issue 42): tiles of 8 tokens' keys and values a warp of the paged decode kernel's tensor-core "
        "body keeps in registers: 2 has the next tile's loads in flight while it takes one, 3 and 4 two and three "
        "tiles ahead (more bytes in flight at long contexts; the same results bit for bit). Read when a kernel is "
        "first built in a process.",
        _mma_depth,
    ),
    Setting(
        "MLXCEL_NET_TIMEOUT",
        "float",
        30.0,
        "Seconds one network step of fetching a model may take (connecting, or waiting for the next bytes from the "
        "Hugging Face Hub or the package index) before mlxcel gives up on that source and tries the next.",
        _positive_float,
    ),
    Setting(
        "MLXCEL_TP_BACKEND",
        "ring, nccl, jaccl, mpi",
        None,
        "Tensor parallelism: MLX's distributed backend (default: picked from MLX's launch variables; ranks "
        "started on one host take ring or nccl). distributed/group.py checks it.",
        str,
    ),
    Setting(
        "MLXCEL_TP_JOIN_TIMEOUT",
        "float",
        60.0,
        "Tensor parallelism: seconds a rank waits for the others to join before it fails.",
        _float,
    ),
)

# Other tools' variables that mlxcel reads or sets for them: (name, help).
FOREIGN: tuple[tuple[str, str], ...] = (
    (
        "HF_HUB_OFFLINE",
        "Set to 1 to never download from the Hugging Face Hub; models must already be local or in the "
        "Hugging Face cache.",
    ),
    (
        "MLX_PTX_CACHE_DIR",
        "MLX's own setting: where it keeps the CUDA kernels it compiles. Unless it is set, mlxcel "
        "uses $MLXCEL_CACHE_DIR/kernels/mlx-VERSION/GPU, which outlives /tmp (MLX's default). Each process's "
        "MLX then works in a directory of its own inside it (.proc-HOST-PID) and publishes the modules it compiles "
        "whole, so processes starting together never read one another's half-written kernels.",
    ),
    (
        "CUDA_CACHE_PATH",
        "The CUDA driver's own setting: where it keeps the PTX it compiles for the GPU. Unless it is "
        "set, mlxcel sets it to $MLXCEL_CACHE_DIR/kernels/cuda-driver (the driver's default, ~/.nv, "
        "is lost with a fresh container).",
    ),
    (
        "MLX_ENABLE_TF32",
        "MLX's own switch, which mlxcel sets to 0 unless it is set: float32 matmuls stay float32 on "
        "CUDA instead of TF32 (1 trades that precision for speed; 16-bit and quantized models are "
        "unaffected).",
    ),
)

_BY_NAME = {s.name: s for s in SETTINGS}
_warned: set[tuple[str, str]] = set()


def get(name: str):
    """The setting's value from the environment, or its default when unset, empty or invalid (invalid warns once)."""
    setting = _BY_NAME[name]
    raw = os.environ.get(name, "").strip()
    if not raw:
        return setting.default
    try:
        return setting.parse(raw)
    except ValueError as exc:
        if (name, raw) not in _warned:
            _warned.add((name, raw))
            print(f"mlxcel: warning: {name}={raw!r} ignored ({exc})", file=sys.stderr)
        return setting.default


def raw(name: str) -> str:
    """The setting's text as set ("" when unset), for a reader that parses (and reports) it itself."""
    _BY_NAME[name]  # a KeyError for an undeclared name
    return os.environ.get(name, "").strip()
