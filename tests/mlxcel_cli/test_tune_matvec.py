"""`mlxcel tune --op qmv-multirow|hmv-multirow`: the dry run (its cells, defaults and candidates; no MLX imported),
shapes from --shapes, -m or the default model shape, bad input as one line and exit 2, and no CUDA device as a clear
refusal. The measuring itself is tests/autotune/test_matvec_ops.py's CUDA tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune import matvec_ops
from mlxcel_cli.main import main
from mlxcel_core.backends.cuda.kernels import hmv, qmv

ROOT = Path(__file__).resolve().parents[2]


def qmm_rule(n: int, groups: int) -> int:
    from mlxcel_core.backends.cuda.kernels.matvec_config import qmm_split_k

    return qmm_split_k(n, groups)[1]


QMV = ["tune", "--op", "qmv-multirow"]


@pytest.fixture(autouse=True)
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path))
    return tmp_path


def cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_lists_every_cell_with_the_rule_and_its_candidates(capsys, cache):
    code, out, err = cli(
        capsys, *QMV, "--dry-run", "--json", "--shapes", "4096x4096,1024x14336", "--batch-sizes", "1,8"
    )
    doc = json.loads(out)
    assert (
        code == 0 and err == "" and doc["op"] == "qmv-multirow" and doc["runner"] == matvec_ops.runner("qmv-multirow")
    )
    assert [(c["n"], c["k"], c["rows"]) for c in doc["cells"]] == [(4096, 4096, 1), (4096, 4096, 8)] + [
        (1024, 14336, 1),
        (1024, 14336, 8),
    ]
    for c in doc["cells"]:
        assert c["default"] == matvec_ops.label(qmv.launch_config(c["n"], c["k"], c["rows"])) in c["candidates"]
        assert c["cell"] == f"n{c['n']}xk{c['k']}xm{c['rows']}xg64"
    assert list(cache.iterdir()) == []
    code, out, _ = cli(capsys, *QMV, "--dry-run")
    assert (
        code == 0 and "dry run: 24 cells" in out and " 128256x4096    1 |" in out
    )  # Llama-3-8B's six shapes x 1,2,4,8


def test_the_batch_product_splits_k_for_rows_in_8_row_tiles(capsys):
    code, out, _ = cli(capsys, "tune", "--op", "qmm-splits", "--dry-run", "--json", "--shapes", "4096x4096")
    cells = json.loads(out)["cells"]
    assert code == 0 and [(c["rows"], c["cell"]) for c in cells] == [(8, "n4096xk4096xm8xg64")] + [
        (16, "n4096xk4096xm16xg64"),
        (32, "n4096xk4096xm32xg64"),
        (64, "n4096xk4096xm64xg64"),
    ]  # the default rows: 8, 16, 32, 64
    assert cells[0]["default"] == f"gps={qmm_rule(4096, 64)}" and cells[0]["candidates"][0] == "gps=64"
    code, out, _ = cli(capsys, "tune", "--op", "qmm-splits", "--dry-run", "--json", "--batch-sizes", "6,7,9,16,17")
    assert code == 0 and sorted({c["rows"] for c in json.loads(out)["cells"]}) == [8, 16, 24]


def test_the_16_bit_kernel_has_swiglu_cells(capsys):
    args = ["--dry-run", "--json", "--shapes", "4096x4096,28672x4096:swiglu", "--batch-sizes", "1"]
    code, out, _ = cli(capsys, "tune", "--op", "hmv-multirow", *args)
    cells = json.loads(out)["cells"]
    assert code == 0 and [(c["n"], c["mode"], c["cell"]) for c in cells] == [
        (4096, "plain", "n4096xk4096xm1"),
        (28672, "swiglu", "n28672xk4096xm1xswiglu"),
    ]
    assert cells[1]["default"] == matvec_ops.label(hmv.launch_config(28672, 4096, 1, "swiglu"))
    code, out, _ = cli(capsys, *QMV, *args)  # the 4-bit kernel's cells are plain in every mode
    assert code == 0 and [c["mode"] for c in json.loads(out)["cells"]] == ["plain", "plain"]


def test_shapes_from_a_model_directory(capsys, tmp_path):
    config = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "vocab_size": 49152}))
    code, out, _ = cli(capsys, *QMV, "--dry-run", "--json", "-m", str(tmp_path / "model"), "--batch-sizes", "1")
    assert code == 0
    assert [(c["n"], c["k"]) for c in json.loads(out)["cells"]] == [
        (576, 576),
        (192, 576),
        (960, 576),
        (3072, 576),
        (576, 1536),
        (49152, 576),
    ]


def test_dry_run_imports_no_mlx(cache):
    code = (
        "import sys; from mlxcel_cli.main import main; rc = main(['tune', '--op', 'qmv-multirow', '--dry-run']); "
        "assert rc == 0; assert 'mlx.core' not in sys.modules, 'dry run imported mlx'"
    )
    env = {**os.environ, "MLXCEL_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "op, args, message",
    [
        ("qmv-multirow", ["--shapes", "4096by4096"], "--shapes must be a comma-separated list of NxK[:swiglu]"),
        ("hmv-multirow", ["--shapes", "4096x4096:gelu"], "--shapes must be a comma-separated list of NxK[:swiglu]"),
        ("hmv-multirow", ["--shapes", "4095x4096:swiglu"], "a fused gate/up weight has an even number of rows"),
        ("qmv-multirow", ["--shapes", "4096x100"], "K must be a multiple of 32 and of the group size"),
        ("hmv-multirow", ["--shapes", "4096x100"], "K must be a multiple of 8"),
        ("qmv-multirow", ["--batch-sizes", "9"], "qmv-multirow's kernel takes 1..8 rows of x"),
        ("qmm-splits", ["--batch-sizes", "5"], "qmm-splits's kernel takes 6..64 rows of x"),
        ("qmv-multirow", ["--group-size", "48"], "--group-size must be one of 32, 64, 128"),
        ("hmv-multirow", ["--dtype", "int8"], "--dtype must be float16, bfloat16 or float32"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, op, args, message):
    code, out, err = cli(capsys, "tune", "--op", op, "--dry-run", *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err


@pytest.mark.skipif(qmv.kernel_ready(), reason="a machine without the CUDA kernel")
def test_without_cuda_a_run_is_refused_naming_it(capsys, cache):
    code, out, err = cli(capsys, *QMV, "--shapes", "1024x4096", "--batch-sizes", "1")
    assert code == 2 and "no MLX CUDA device" in err and list(cache.iterdir()) == []
    code, out, err = cli(capsys, "tune", "--op", "hmv-multirow", "--shapes", "1024x4096", "--batch-sizes", "1")
    assert code == 2 and "no MLX CUDA device" in err


def test_a_dry_run_without_op_lists_the_product_ops_too(capsys, tmp_path):
    from autotune.profiler import ProfileSettings
    from mlxcel_cli.tune import _other_ops

    code, out, _ = cli(capsys, "tune", "--dry-run", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["op"] == "paged-decode-splits"
    assert [(o["op"], len(o["cells"])) for o in doc["more_ops"]] == [
        ("qmv-multirow", 24),
        ("hmv-multirow", 24),
        ("qmm-splits", 24),
    ]
    (tmp_path / "m.gguf").write_bytes(b"GGUF")  # a GGUF file: its product shapes are not read (-m takes a config.json)
    skipped = _other_ops(str(tmp_path / "m.gguf"), None, 64, "float16", ProfileSettings(), False)
    assert [reason.split(":")[0] for _, reason in skipped] == ["qmv-multirow", "hmv-multirow", "qmm-splits"]
    assert all("give --op" in reason for _, reason in skipped)


def test_shapes_and_group_size_from_a_gguf_file(capsys, tmp_path):
    from gguf_convert import convert
    from tiny_models import save_tiny_llama

    hf = save_tiny_llama(tmp_path / "hf", hidden_size=256, intermediate_size=512, num_key_value_heads=2)
    model = convert(hf, tmp_path / "tiny.gguf", "llama")
    config = json.loads((hf / "config.json").read_text())
    code, out, err = cli(capsys, *QMV, "--dry-run", "--json", "-m", str(model), "--batch-sizes", "1")
    assert code == 0, err
    cells = json.loads(out)["cells"]
    assert [(c["n"], c["k"]) for c in cells] == [(n, k) for n, k, _ in matvec_ops.shapes_from_config(config)]
    assert all(c["cell"].endswith("xg32") for c in cells)  # a GGUF's 4-bit types load as groups of 32
