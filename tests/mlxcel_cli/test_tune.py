"""`mlxcel tune`: the dry run (golden output, fast, writes nothing), -m geometry, bad input, and a real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import autotune.ops as ops
from autotune import runtime
from autotune.runtime import SplitsChooser
from mlxcel_cli.main import main

GOLDEN_DRY_RUN = """\
autotune cache: {cache}/autotune
profile: warmup>=3 (40ms) reps 5..1000 (250ms budget) min_improvement=0.020 (+ measured spread)
runner: mlx-ops (MLX ops: split, reduce, merge; no custom kernel on this backend)
paged-decode-splits: head_dim=128 q_heads=32 kv_heads=8 block_size=32 dtype=float16
  batch  context |       default  candidates
      1     1024 |  num_splits=1  1,2,4,8,16,32  (dry run)
      1     4096 |  num_splits=2  1,2,4,8,16,32  (dry run)
      1    16384 |  num_splits=8  1,2,4,8,16,32  (dry run)
      1    32768 | num_splits=16  1,2,4,8,16,32  (dry run)
      2     1024 |  num_splits=1  1,2,4,8,16,32  (dry run)
      2     4096 |  num_splits=2  1,2,4,8,16,32  (dry run)
      2    16384 |  num_splits=8  1,2,4,8,16,32  (dry run)
      2    32768 | num_splits=16  1,2,4,8,16,32  (dry run)
      4     1024 |  num_splits=1  1,2,4,8,16,32  (dry run)
      4     4096 |  num_splits=2  1,2,4,8,16,32  (dry run)
      4    16384 |  num_splits=8  1,2,4,8,16,32  (dry run)
      4    32768 | num_splits=16  1,2,4,8,16,32  (dry run)
      8     1024 |  num_splits=1  1,2,4,8,16,32  (dry run)
      8     4096 |  num_splits=2  1,2,4,8,16,32  (dry run)
      8    16384 |  num_splits=8  1,2,4,8,16,32  (dry run)
      8    32768 | num_splits=16  1,2,4,8,16,32  (dry run)
dry run: 16 cells, nothing measured or written. Set MLXCEL_AUTOTUNE=cache (or 1) to consume these tactics at runtime.
"""

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--batch-sizes",
    "1",
    "--context-lengths",
    "64",
    "--head-dim",
    "32",
    "--q-heads",
    "4",
    "--kv-heads",
    "2",
    "--sample-ms",
    "20",
    "--warmup-ms",
    "5",
]


@pytest.fixture(autouse=True)
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MLXCEL_AUTOTUNE", raising=False)
    monkeypatch.delenv("MLXCEL_PAGED_DECODE_SPLITS", raising=False)
    monkeypatch.setattr(ops, "predicted_runner", lambda: ops.RUNNER_OPS)  # the golden output is the CPU one
    runtime.reset()
    yield tmp_path
    runtime.reset()


def cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_golden_output_writes_nothing_and_is_fast(capsys, cache):
    start = time.perf_counter()
    code, out, err = cli(capsys, "tune", "--dry-run")
    assert time.perf_counter() - start < 1.0
    assert code == 0 and err == ""
    golden = GOLDEN_DRY_RUN.format(cache=cache)
    assert out.startswith(golden)
    # without --op, every op: then the product kernels' sections, each at its default shapes and rows
    sections = out[len(golden) :].split("\n\n")
    assert [s.strip().splitlines()[1].split(":")[0] for s in sections] == ["qmv-multirow", "hmv-multirow", "qmm-splits"]
    assert [s.strip().splitlines()[-1] for s in sections] == [
        "dry run: 24 cells, nothing measured or written.",
        "dry run: 24 cells, nothing measured or written.",
        "dry run: 24 cells, nothing measured or written.",
    ]
    code, out, _ = cli(capsys, "tune", "--dry-run", "--op", "paged-decode-splits")
    assert out == golden
    assert list(cache.iterdir()) == []


def test_dry_run_imports_no_mlx(cache):
    code = (
        "import sys; from mlxcel_cli.main import main; rc = main(['tune', '--dry-run']); "
        "assert rc == 0; assert 'mlx.core' not in sys.modules, 'dry run imported mlx'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "MLXCEL_CACHE_DIR": str(cache)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "dry run: 16 cells" in proc.stdout


def test_dry_run_json(capsys, cache):
    code, out, _ = cli(
        capsys,
        "tune",
        "--dry-run",
        "--json",
        "--batch-sizes",
        "2",
        "--context-lengths",
        "100,3000",
        "--block-size",
        "16",
    )
    doc = json.loads(out)
    assert code == 0 and doc["dry_run"] is True and doc["cache_dir"] == str(cache / "autotune")
    assert doc["geometry"] == {"head_dim": 128, "q_heads": 32, "kv_heads": 8, "block_size": 16}
    assert [(c["batch"], c["context"], c["bucket"]) for c in doc["cells"]] == [
        (2, 100, "b2xc128xhq32xhkv8xd128xbs16"),
        (2, 3000, "b2xc4096xhq32xhkv8xd128xbs16"),
    ]
    assert doc["cells"][0]["candidates"] == [f"num_splits={s}" for s in (1, 2, 4, 8)]
    assert doc["cells"][1]["default"] == "num_splits=2"


def write_config(path, config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "config, geometry",
    [
        (
            {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8},
            "head_dim=128 q_heads=32 kv_heads=8",
        ),
        ({"hidden_size": 2048, "num_attention_heads": 16}, "head_dim=128 q_heads=16 kv_heads=16"),  # kv falls back
        (
            {"hidden_size": 2560, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
            "head_dim=256 q_heads=8 kv_heads=4",
        ),
        (
            {
                "model_type": "gemma3",
                "text_config": {
                    "hidden_size": 1152,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 1,
                    "head_dim": 256,
                },
            },
            "head_dim=256 q_heads=4 kv_heads=1",
        ),
    ],
)
def test_model_config_geometry(capsys, tmp_path, config, geometry):
    model = write_config(tmp_path / "m", config)
    for spec in (model, model / "config.json"):
        code, out, err = cli(
            capsys, "tune", "--dry-run", "-m", str(spec), "--batch-sizes", "1", "--context-lengths", "1024"
        )
        assert code == 0, err
        assert f"paged-decode-splits: {geometry} block_size=32 dtype=float16" in out


def test_explicit_flags_override_the_model(capsys, tmp_path):
    model = write_config(tmp_path / "m", {"hidden_size": 4096, "num_attention_heads": 32})
    code, out, _ = cli(capsys, "tune", "--dry-run", "-m", str(model), "--kv-heads", "4")
    assert code == 0 and "head_dim=128 q_heads=32 kv_heads=4" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--op", "qmm-tile"], "--op must be one of paged-decode-splits, qmv-multirow, hmv-multirow"),
        (["--batch-sizes", "1,x"], "--batch-sizes must be a comma-separated list of positive integers"),
        (["--context-lengths", "0"], "--context-lengths must be"),
        (["--q-heads", "6"], "--q-heads (6) must be a multiple of --kv-heads (8)"),
        (["--head-dim", "0"], "--head-dim must be a positive integer"),
        (["--dtype", "int8"], "--dtype must be float16, bfloat16 or float32"),
        (["--min-reps", "0"], "--min-reps must be >= 1"),
        (["--min-reps", "9", "--max-reps", "3"], "--max-reps (3) must be >= --min-reps (9)"),
        (["--sample-ms", "0"], "--sample-ms must be > 0"),
        (["--min-improvement", "1"], "--min-improvement must be in [0, 1)"),
        (["--warmup", "abc"], "Invalid value for '--warmup'"),
        (["-m", "/no/such/model"], "no config.json there"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, cache, args, message):
    code, out, err = cli(capsys, "tune", "--dry-run", *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("mlxcel: error: ") and message in err
    assert list(cache.iterdir()) == []


def test_bad_model_config_is_exit_2(capsys, tmp_path):
    model = write_config(tmp_path / "m", {"hidden_size": 64})
    code, _, err = cli(capsys, "tune", "--dry-run", "-m", str(model))
    assert code == 2 and "num_attention_heads" in err
    (model / "config.json").write_text("{broken")
    code, _, err = cli(capsys, "tune", "--dry-run", "-m", str(model))
    assert code == 2 and "cannot read" in err


def _here() -> tuple[str, str]:
    """The runner the tiny cells run on here (head dim 32) and the device's name prefix."""
    import mlx.core as mx

    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    return ops.current_runner(32), "gpu-" if on_gpu else "cpu-"


def test_real_run_writes_the_cache_the_engine_reads(capsys, cache, monkeypatch):
    runner, device = _here()
    code, out, err = cli(capsys, "tune", *TINY)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"autotune cache: {cache / 'autotune'}"
    assert lines[2].startswith(f"runner: {runner}") and f"device: {device}" in lines[2]
    assert lines[4].split() == [
        "batch",
        "context",
        "|",
        "default",
        "default_us",
        "selected",
        "best_us",
        "spread",
        "reps",
        "guard",
        "speedup",
    ]
    row = lines[5].split()
    assert row[:4] == ["1", "64", "|", "num_splits=1"] and row[5].startswith("num_splits=")
    assert row[7].endswith("%") and int(row[8]) >= 5 and row[9].endswith("%") and row[10].endswith("x")
    assert lines[-1] == "done. Set MLXCEL_AUTOTUNE=cache (or 1) to consume these tactics at runtime."
    files = list((cache / "autotune").glob("*.json"))
    assert len(files) == 1
    record = json.loads(files[0].read_text())
    assert record["bucket"] == "b1xc64xhq4xhkv2xd32xbs32" and record["tactic"]["label"] == row[5]
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    chosen = SplitsChooser()(1, 64, 4, 2, 32, 32, "float16", runner)
    assert chosen == record["tactic"]["params"]["num_splits"]


def test_real_run_json(capsys, cache):
    code, out, _ = cli(capsys, "tune", *TINY, "--json", "--dtype", "float32")
    doc = json.loads(out)
    assert code == 0 and doc["dry_run"] is False and doc["runner"] == _here()[0] and doc["dtype"] == "float32"
    (cell,) = doc["cells"]
    assert cell["selected"] in cell["candidates"] and cell["reps"] >= 5 and cell["speedup"] > 0
    assert {"default_us", "best_us", "spread", "default_spread", "guard", "cache_file", "dropped"} <= set(cell)
