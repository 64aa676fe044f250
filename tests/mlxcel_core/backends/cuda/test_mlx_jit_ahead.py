"""MLX's own JIT modules compiled ahead in helper processes (backends/cuda/mlx_jit_ahead.py).

On any machine: each listed module's op runs, and a fused module's listed name is the one MLX gives the op's graph
(MLX's CPU backend names its compiled graphs as its CUDA backend does: both take Compiled's kernel name); the move
into the cache directory renames the cubin last; a module already cached starts no helper. On CUDA: the helpers'
modules land in the cache directory, and a serve warm-up on an empty cache then compiles no module of MLX's own that
the helpers did not make."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from mlxcel_core.backends.cuda import mlx_jit_ahead
from mlxcel_core.backends.cuda.paged_attention import cuda_kernel_available

needs_cuda = pytest.mark.skipif(not cuda_kernel_available(), reason="needs MLX's CUDA backend and a CUDA device")
ROOT = Path(__file__).resolve().parents[4]


def _pythonpath() -> str:
    """This checkout first, then what the environment has (where MLX may be installed apart)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_every_listed_module_has_an_op_that_runs(dtype):
    names = mlx_jit_ahead.modules_for(dtype)
    assert len(names) == len(set(names)) >= 5 and f"gather_{mlx_jit_ahead.mlx_name(dtype)}_uint32_1" in names
    for name in names:
        assert mlx_jit_ahead.runs(name)
        mx.eval(mlx_jit_ahead.trigger(name))
    quantized = mlx_jit_ahead.modules_for(dtype, [(4, 64, "affine"), (8, 32, "affine")])
    tile = f"qmm_sm80_tn_{mlx_jit_ahead.mlx_name(dtype)}_m64_b8_g32_affine"
    assert len(quantized) == len(names) + 2 + 3 * 2 and tile in quantized and quantized[: len(names)] == names
    for name in quantized[len(names) :]:
        assert mlx_jit_ahead.runs(name)
        if not cuda_kernel_available():  # (on CUDA each is a CUTLASS compile of minutes: the warm-up test runs them)
            mx.eval(mlx_jit_ahead.trigger(name))
    assert not mlx_jit_ahead.runs("gather_bfloat16") and not mlx_jit_ahead.runs("Cf4IAbsAB_V_f4_1")
    with pytest.raises(ValueError, match="no op known"):
        mlx_jit_ahead.trigger("slice_update_Assign_bfloat16")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_fused_modules_names_are_the_ones_mlx_gives_their_graphs(tmp_path, dtype):
    """In a process of its own whose temp dir is empty: MLX's CPU backend writes each compiled graph's source as
    NAME_contiguous.cpp under TMPDIR/mlx/<version>/cpu."""
    script = textwrap.dedent(f"""
        import mlx.core as mx
        from mlxcel_core.backends.cuda import mlx_jit_ahead as j
        mx.set_default_device(mx.cpu)
        for name in j.modules_for(mx.{dtype}):
            if not name.startswith(("gather_", "scatter_")):
                mx.eval(j.trigger(name))
    """)
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=_pythonpath())
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=ROOT)
    written = {p.name.split("_contiguous")[0] for p in tmp_path.rglob("*_contiguous.cpp")}
    fused = {n for n in mlx_jit_ahead.modules_for(getattr(mx, dtype)) if not n.startswith(("gather_", "scatter_"))}
    assert fused == written


def test_the_move_renames_each_modules_cubin_last(tmp_path, monkeypatch):
    scratch, directory = tmp_path / "scratch", tmp_path / "cache"
    scratch.mkdir(), directory.mkdir()
    for name in ("gather_a", "gather_b"):
        for suffix in (".cu", ".txt", ".ptx"):
            (scratch / f"{name}{suffix}").write_text(name + suffix)
    moves = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: moves.append(Path(b).name) or real(a, b))
    assert mlx_jit_ahead._move_in(scratch, directory) == 2
    assert moves == ["gather_a.cu", "gather_a.txt", "gather_a.ptx", "gather_b.cu", "gather_b.txt", "gather_b.ptx"]
    assert (directory / "gather_b.ptx").read_text() == "gather_b.ptx" and not list(scratch.iterdir())


def test_a_cached_module_starts_no_helper_and_a_helper_leaves_no_scratch(tmp_path):
    (tmp_path / "gather_bfloat16_uint32_1.ptx").write_bytes(b"cubin")
    ahead = mlx_jit_ahead.start(tmp_path, ["gather_bfloat16_uint32_1", "scatter_float32_int32_Assign_1", "nothing"])
    assert [name for name, _, _ in ahead.jobs] == ["scatter_float32_int32_Assign_1"]
    moved, _ = ahead.wait()
    on_cuda = cuda_kernel_available()
    assert moved == (1 if on_cuda else 0)  # (on CPU MLX keeps no module files: the helper only runs the op)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ahead-")]


def test_a_checkpoints_modules_come_from_its_weights_header_and_config(tmp_path):
    """Before the load: the dtype most of the first weights file's floating tensors hold (config.json's otherwise),
    the quantizations of config.json's entry, a layer's own among them."""
    config = {
        "torch_dtype": "float32",
        "quantization": {"group_size": 64, "bits": 4, "lm_head": {"group_size": 32, "bits": 8}},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(tmp_path / "model.safetensors"),
        {
            "a": mx.zeros((2,), mx.bfloat16),
            "b": mx.zeros((2,), mx.bfloat16),
            "c": mx.zeros((2,), mx.float32),
            "q": mx.zeros((2,), mx.uint32),
            "i": mx.zeros((2,), mx.int32),
        },
    )
    want = mlx_jit_ahead.modules_for(mx.bfloat16, [(4, 64, "affine"), (8, 32, "affine")])
    assert mlx_jit_ahead.checkpoint_modules(tmp_path) == want
    (tmp_path / "model.safetensors").unlink()  # (no weights file: config.json's dtype)
    assert mlx_jit_ahead.checkpoint_modules(tmp_path)[0] == "gather_float32_uint32_1"
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    assert mlx_jit_ahead.checkpoint_modules(tmp_path) == []  # no dtype anywhere
    assert mlx_jit_ahead.config_quantizations({"quantization_config": {"quant_method": "fp8"}}) == []


class _Helper:
    """subprocess.Popen's stand-in: a helper that writes its module into its scratch directory and exits."""

    made: list = []

    def __init__(self, command, env, **_):
        self.name, self.returncode = command[-1], None
        (Path(env["MLX_PTX_CACHE_DIR"]) / f"{self.name}.ptx").write_bytes(b"cubin")
        _Helper.made.append(self.name)

    def wait(self, timeout=None):
        self.returncode = 0


def test_helpers_started_before_the_load_are_adopted_by_the_warm_ups_start(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", _Helper)
    monkeypatch.setattr(_Helper, "made", [])
    guess = ["gather_float16_uint32_1", "gather_float16_int32_1"]
    assert mlx_jit_ahead.start_early(tmp_path, guess) == 2
    ahead = mlx_jit_ahead.start(tmp_path, ["gather_float16_int32_1", "gather_float32_uint32_1"])
    assert [name for name, _, _ in ahead.jobs] == [*guess, "gather_float32_uint32_1"]  # none started twice
    assert _Helper.made == [*guess, "gather_float32_uint32_1"] and mlx_jit_ahead._EARLY == {}
    assert ahead.wait()[0] == 3 and {p.name for p in tmp_path.iterdir()} == {f"{n}.ptx" for n in _Helper.made}
    assert mlx_jit_ahead.start(tmp_path, guess).jobs == []  # all cached now


def test_a_dead_processs_scratch_is_swept_at_the_next_start(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for pid in (int(dead.stdout), os.getpid()):
        (tmp_path / f".ahead-{pid}-gather_float16_uint32_1").mkdir()
    mlx_jit_ahead.start(tmp_path, [])
    assert [p.name for p in tmp_path.iterdir()] == [f".ahead-{os.getpid()}-gather_float16_uint32_1"]


def _mlx_modules(directory: Path) -> set[str]:
    """MLX's modules in a cache directory (ours are .cubin files): a long name is split into folders."""
    return {str(p.relative_to(directory).with_suffix("")).replace(os.sep, "") for p in directory.rglob("*.ptx")}


@needs_cuda
def test_on_cuda_the_helpers_modules_are_in_the_cache(tmp_path):
    names = mlx_jit_ahead.modules_for(mx.bfloat16)
    moved, _ = mlx_jit_ahead.start(tmp_path, names).wait()
    assert moved == len(names) and _mlx_modules(tmp_path) == set(names)
    for name in names:
        assert (tmp_path / f"{name}.txt").stat().st_size > 0 and (tmp_path / f"{name}.cu").exists()


WARM_UP = """
import sys
from mlxcel_core.bench import RandomIdTokenizer
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.loading.shapes import build_random_model, shape_config
from mlxcel_core.server.warmup import dry_run_config, warm_up_ahead, warmup_plan

bits = int(sys.argv[1]) or None
small = dict(shape_config("llama-3.2-1b"), num_hidden_layers=2)
model, config = build_random_model("llama-3.2-1b", bits=bits, dtype="bfloat16", seed=0, config=small)
tokenizer = RandomIdTokenizer(config["vocab_size"])
tokenizer.eos_token_ids = frozenset({2})  # as a real tokenizer's: the dry run suppresses them
serving = EngineConfig(max_batch_size=12)
new_engine = lambda dry=False: Engine(model, tokenizer, dry_run_config(serving) if dry else serving)
warm_up_ahead(new_engine, warmup_plan(serving), model)
"""


@needs_cuda
@pytest.mark.parametrize("bits", [0, 4])
def test_on_cuda_a_warm_up_on_an_empty_cache_compiles_only_the_helpers_mlx_modules(tmp_path, bits):
    """A 2-layer Llama-3.2-1B of bf16 (4-bit: its weights) warmed up as serve does, in a process of its own on an
    empty kernel cache: every module of MLX's own in the cache afterwards is one the helpers made."""
    env = dict(os.environ, MLXCEL_CACHE_DIR=str(tmp_path), PYTHONPATH=_pythonpath())
    env.pop("MLX_PTX_CACHE_DIR", None)
    subprocess.run([sys.executable, "-c", WARM_UP, str(bits)], env=env, check=True, cwd=ROOT, timeout=600)
    (directory,) = [p for p in (tmp_path / "kernels").glob("mlx-*/*") if p.is_dir()]
    quantized = [(4, 64, "affine")] if bits else []
    assert _mlx_modules(directory) - set(mlx_jit_ahead.modules_for(mx.bfloat16, quantized)) == set()


def test_a_models_modules_follow_its_dtype_and_each_quantization_its_layers_use():
    import mlx.nn as nn

    from mlxcel_core.loading.shapes import build_random_model

    model, _ = build_random_model("tiny", dtype="float16", seed=0)
    assert mlx_jit_ahead.modules_of(model) == mlx_jit_ahead.modules_for(mx.float16)
    nn.quantize(
        model, group_size=32, bits=4, class_predicate=lambda path, m: "mlp" in path and hasattr(m, "to_quantized")
    )
    nn.quantize(
        model, group_size=64, bits=8, class_predicate=lambda path, m: "self_attn" in path and hasattr(m, "to_quantized")
    )
    assert set(mlx_jit_ahead.quantizations(model)) == {(4, 32, "affine"), (8, 64, "affine")}
    assert mlx_jit_ahead.modules_of(model) == mlx_jit_ahead.modules_for(mx.float16, mlx_jit_ahead.quantizations(model))
