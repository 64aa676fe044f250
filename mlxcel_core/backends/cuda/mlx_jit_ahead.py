"""MLX's own JIT modules that a model's steps need, compiled side by side in helper processes before the warm-up.

    ahead = start(directory, modules_for(mx.bfloat16))   # one helper process a module missing from the cache
    ...                                                   # (anything else meanwhile)
    ahead.wait()                                          # each module's files are in MLX's cache directory now

    start_early(directory, checkpoint_modules(path))      # serve: from the checkpoint's files, before its load;
    ahead = start(directory, modules_of(model))           # the next `start` adopts those helpers

Why: MLX 0.32 compiles some of its CUDA kernels with NVRTC the first time a process runs them: its gathers and
scatters (mlx/backend/cuda/indexing.cpp), one module per (dtype, index dtype, index count) that instantiates every
rank, about 3-5 s each on an H200's host core. It compiles them inside mx.eval on the thread that evaluates, so a
fresh machine's warm-up waits for them one after another. A module's name says everything its source depends on, so
a helper process can make MLX compile it by running one small op of those dtypes: the helpers run side by side, each
into a directory of its own, and `wait` moves their files into the directory this process's MLX reads (paths.py
`mlx_kernel_dir`), the cubin last and every file by rename, so MLX reads either no module or a whole one (MLX itself
writes its files in place); paths.py publishes them into the shared cache.

Which modules: the gathers and scatters the engine's steps run for a model of that dtype (the embedding's row
gather, the paged prefill's block gathers and KV writes, the logits processors'), the fused SwiGLU and, for a
quantized model, its packed embedding rows and its prefill's quantized matmuls; tests/mlxcel_core/backends/cuda/
test_mlx_jit_ahead.py checks on a CUDA machine that a warm-up on an empty cache compiles none of its own. A module
that a helper fails to make is compiled by MLX where it is first run, as without this. Serve starts the helpers from
the checkpoint's files (`checkpoint_modules`: config.json and a weights file's header) before it reads the weights,
so the compiles overlap the load; a helper's scratch directory left by a process that died is swept at the next start.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ...paths import AHEAD_PREFIX, MODULE_SUFFIXES, ended

log = logging.getLogger("mlxcel")

# silu(gate) * up (models/activations.py's swiglu) as MLX names its fused graph ({kind}: the dtype's code in such a
# name, which spells out the graph: mlx/compile.cpp, Compiled::Compiled): compiled shapeless, as a prefill runs it, and
# inside a compiled decode step (the constants' hash of a graph without constants ends each name)
SWIGLU = (
    "C{kind}ISigmoidAD{kind}IBroadcastACE{kind}IBroadcastCAF{kind}IMultiplyDEG{kind}IBroadcastFBH{kind}IBroadcastBFI"
    "{kind}OMultiplyGH_VV_{kind}{kind}_6142509188972423790"
)
SWIGLU_STEP = "C{kind}ISigmoidAD{kind}IMultiplyACE{kind}OMultiplyDB_VV_{kind}{kind}_6142509188972423790"
# The modules of a model's steps that depend on its dtype only ({dtype}: MLX's name of the dtype).
MODULES = (
    "gather_{dtype}_uint32_1",  # the embedding's rows of the step's token ids
    "gather_{dtype}_int32_1",
    "gather_float32_uint32_1",
    "scatter_{dtype}_int32_Assign_2",
    # the logits processors' columns (processors.py: logits[:, ids], float32 whatever the model's dtype; the slice's
    # uint32 positions and the ids' int32 promote to int64): the warm-up's dry run suppresses end-of-sequence tokens
    "gather_float32_int64_2",
    "scatter_float32_int64_Assign_2",
    SWIGLU,
    SWIGLU_STEP,
)
QUANTIZED_MODULES = (  # a model with quantized weights (bits, group size, mode as MLX names them) adds these
    "gather_uint32_uint32_1",  # the quantized embedding's packed rows
    "gather_uint32_int32_1",
    # MLX's quantized matmul of a prefill (mlx/backend/cuda/quantized/qmm/qmm_sm80.cu), one module per row tile: 16
    # rows up to 16 tokens, 32 up to 32, 64 past that, so a first long prompt finds its module too
    "qmm_sm80_tn_{dtype}_m16_b{bits}_g{group}_{mode}",
    "qmm_sm80_tn_{dtype}_m32_b{bits}_g{group}_{mode}",
    "qmm_sm80_tn_{dtype}_m64_b{bits}_g{group}_{mode}",
)
_FUSED = {SWIGLU: "swiglu", SWIGLU_STEP: "swiglu_step"}
_QMM = re.compile(r"qmm_sm80_tn_([a-z]+[0-9]+)_m([0-9]+)_b([0-9]+)_g([0-9]+)_([a-z0-9]+)")
_KINDS = {"bfloat16": "V2", "float16": "f2", "float32": "f4"}
_GATHER = re.compile(r"gather_([a-z]+[0-9]+)_([a-z]+[0-9]+)_([0-9]+)")
_SCATTER = re.compile(r"scatter_([a-z]+[0-9]+)_([a-z]+[0-9]+)_(Assign|Sum|Prod|Max|Min)_([0-9]+)")
_SCATTER_METHODS = {"Sum": "add", "Prod": "multiply", "Max": "maximum", "Min": "minimum"}
WAIT_SECONDS = 120.0  # a helper still compiling after this is left to finish alone; MLX compiles what is missing


# helpers started before the model was loaded (start_early), adopted by the next `start`: name -> (scratch, process)
_EARLY: dict[str, tuple[Path, subprocess.Popen]] = {}


def mlx_name(dtype) -> str:
    """MLX's name of a dtype in its module names (mx.bfloat16 -> "bfloat16")."""
    return str(dtype).rsplit(".", 1)[-1]


def activation_dtype(model):
    """The floating dtype most of the model's parameters hold (quantized weights' scales, norms, 16-bit weights)."""
    from collections import Counter

    import mlx.core as mx
    from mlx.utils import tree_flatten

    floating = (mx.bfloat16, mx.float16, mx.float32)
    counts = Counter(a.dtype for _, a in tree_flatten(model.parameters()) if a.dtype in floating)
    return counts.most_common(1)[0][0] if counts else mx.float32


def quantizations(model) -> list[tuple[int, int, str]]:
    """The (bits, group size, mode) of the model's quantized layers, each once (convert_recipes.quantization_entry:
    the most common setting, and every layer's where they differ)."""
    from mlxcel_core.convert_recipes import quantization_entry

    entry = quantization_entry(model)
    if entry is None:
        return []
    settings = [entry] + [v for v in entry.values() if isinstance(v, dict)]
    return list(dict.fromkeys((s["bits"], s["group_size"], s["mode"]) for s in settings))


def modules_of(model) -> list[str]:
    """MODULES for the model's dtype, and QUANTIZED_MODULES for each quantization its layers use."""
    return modules_for(activation_dtype(model), quantizations(model))


def modules_for(dtype, quantized: list[tuple[int, int, str]] = ()) -> list[str]:
    name = mlx_name(dtype)
    names = [m.format(dtype=name, kind=_KINDS.get(name, "")) for m in MODULES]
    for bits, group, mode in quantized:
        names += [m.format(dtype=name, bits=bits, group=group, mode=mode) for m in QUANTIZED_MODULES]
    return list(dict.fromkeys(names))


def checkpoint_modules(directory: Path) -> list[str]:
    """`modules_for` a checkpoint directory before it is loaded: the dtype most of its first weights file's floating
    tensors hold (the loader keeps a directory's dtypes; `activation_dtype` counts arrays alike), else config.json's;
    the quantizations config.json's "quantization" names. [] where no dtype is found."""
    import mlx.core as mx

    from mlxcel_core.convert import config_dtype
    from mlxcel_core.loading.sliced import DTYPES, read_header

    config = json.loads((directory / "config.json").read_text())
    dtype = None
    files = sorted(directory.glob("*.safetensors"))
    if files:
        from collections import Counter

        header, _ = read_header(files[0])
        kinds = Counter(DTYPES.get(e.get("dtype")) for k, e in header.items() if k != "__metadata__")
        floats = [d for d, _ in kinds.most_common() if d is not None and mx.issubdtype(d, mx.floating)]
        dtype = floats[0] if floats else None
    if dtype is None and config_dtype(config):
        dtype = getattr(mx, config_dtype(config))
    return modules_for(dtype, config_quantizations(config)) if dtype is not None else []


def config_quantizations(config: dict) -> list[tuple[int, int, str]]:
    """The (bits, group size, mode) of an MLX checkpoint's config.json "quantization" (and each layer's own entry)."""
    entry = config.get("quantization") or config.get("quantization_config")
    if not isinstance(entry, dict) or "bits" not in entry:
        return []  # (unquantized, or another quantizer's format)
    entries = [entry] + [v for v in entry.values() if isinstance(v, dict) and "bits" in v]
    return list(dict.fromkeys((e["bits"], e.get("group_size", 64), e.get("mode", "affine")) for e in entries))


def _fused(name: str) -> tuple[str, str] | None:
    """(recipe, dtype name) of a fused module of MODULES, else None."""
    for template, recipe in _FUSED.items():
        for dtype, kind in _KINDS.items():
            if name == template.format(kind=kind):
                return recipe, dtype
    return None


def runs(name: str) -> bool:
    """Whether `trigger` knows the op of this module."""
    return bool(_GATHER.fullmatch(name) or _SCATTER.fullmatch(name) or _QMM.fullmatch(name) or _fused(name))


def trigger(name: str):
    """The small MLX op whose kernel is module `name` (unevaluated); ValueError for a name of no known form."""
    import mlx.core as mx

    gather, scatter = _GATHER.fullmatch(name), _SCATTER.fullmatch(name)
    if gather:
        dtype, index_dtype, count = getattr(mx, gather[1]), getattr(mx, gather[2]), int(gather[3])
        source = mx.zeros((2,) * (count + 1), dtype)
        return source[tuple(mx.array([1], index_dtype) for _ in range(count))]
    if scatter:
        dtype, index_dtype, op, count = getattr(mx, scatter[1]), getattr(mx, scatter[2]), scatter[3], int(scatter[4])
        target = mx.zeros((2,) * (count + 1), dtype)
        where = tuple(mx.array([1], index_dtype) for _ in range(count))
        update = mx.ones((1, 2), dtype)
        if op == "Assign":
            target[where] = update
            return target
        return getattr(target.at[where], _SCATTER_METHODS[op])(update)
    qmm = _QMM.fullmatch(name)
    if qmm:  # [rows, K] @ [128, K].T: N a multiple of 128 and K of max(64, group), two groups (not MLX's sm90 form)
        dtype, rows, bits, group, mode = getattr(mx, qmm[1]), int(qmm[2]), int(qmm[3]), int(qmm[4]), qmm[5]
        k = 2 * max(64, group)
        weight, scales, *biases = mx.quantize(mx.ones((128, k), dtype), group, bits, mode=mode)
        x = mx.ones((rows, k), dtype)
        return mx.quantized_matmul(x, weight, scales, *biases[:1], True, group, bits, mode=mode)
    fused = _fused(name)
    if fused:
        from mlxcel_core.models.activations import swiglu, swiglu_eager

        recipe, dtype = fused
        gate, up = mx.ones((1, 2, 8), getattr(mx, dtype)), mx.ones((1, 2, 8), getattr(mx, dtype))
        return (swiglu if recipe == "swiglu" else mx.compile(swiglu_eager))(gate, up)
    raise ValueError(f"no op known for MLX's module {name!r}")


class Ahead:
    """Helper processes compiling modules, each into a directory of its own under the cache directory."""

    def __init__(self, directory: Path, jobs: list[tuple[str, Path, subprocess.Popen]]):
        self.directory, self.jobs, self.began = directory, jobs, time.perf_counter()

    def wait(self, timeout: float = WAIT_SECONDS) -> tuple[int, float]:
        """Waits for the helpers and moves their modules in; (modules moved in, seconds since the start)."""
        moved = 0
        for name, scratch, process in self.jobs:
            try:
                process.wait(timeout=max(0.0, timeout - (time.perf_counter() - self.began)))
                if process.returncode == 0:
                    moved += _move_in(scratch, self.directory)
                else:
                    log.debug("MLX's module %s ahead: its helper exited with %s", name, process.returncode)
            except subprocess.TimeoutExpired:
                log.debug("MLX's module %s ahead: still compiling after %.0f s; left to MLX", name, timeout)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        return moved, time.perf_counter() - self.began


def start(directory: Path, names: list[str]) -> Ahead:
    """One helper process for each module of `names` that `directory` (MLX's cache directory) lacks, and every helper
    `start_early` left running (their modules may be others: a guess from the checkpoint's files, kept all the same)."""
    _sweep(directory)
    jobs = [(name, *_EARLY.pop(name)) for name in list(_EARLY)]
    running = {name for name, _, _ in jobs}
    for name in names:
        if name in running or (directory / f"{name}.ptx").exists() or not runs(name):
            continue
        scratch = directory / f"{AHEAD_PREFIX}{os.getpid()}-{name}"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        env = dict(os.environ, MLX_PTX_CACHE_DIR=str(scratch))
        command = [sys.executable, "-m", __name__, name]
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        jobs.append((name, scratch, process))
    return Ahead(directory, jobs)


def start_early(directory: Path, names: list[str]) -> int:
    """`start`, its helpers left running for the next `start` to adopt; how many began."""
    ahead = start(directory, names)
    for name, scratch, process in ahead.jobs:
        _EARLY[name] = (scratch, process)
    return len(ahead.jobs)


def _sweep(directory: Path) -> None:
    """Removes the helpers' scratch directories of processes that have ended (one killed while its helpers ran)."""
    for scratch in directory.glob(f"{AHEAD_PREFIX}*-*"):
        if ended(scratch.name.split("-")[1]):
            shutil.rmtree(scratch, ignore_errors=True)


def _move_in(scratch: Path, directory: Path) -> int:
    """Moves a helper's modules into `directory` by rename: each module's .cu and .txt, then its cubin (.ptx)."""
    cubins = sorted(scratch.glob("*.ptx"))
    for cubin in cubins:
        for part in (cubin.with_suffix(suffix) for suffix in MODULE_SUFFIXES):
            if part.exists():
                os.replace(part, directory / part.name)
    return len(cubins)


def main(names: list[str]) -> None:
    import mlx.core as mx

    for name in names:
        mx.eval(trigger(name))


if __name__ == "__main__":
    main(sys.argv[1:])
