"""`mlxcel bench` through the real entry point: every output format, batch rows, bad input, fast --help."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys

import pytest

from mlxcel_cli.main import main

FAST = ["bench", "--model-shape", "tiny", "-p", "16", "-n", "4", "-r", "2", "--pg", "8,4", "-d", "0,32"]
LABELS = ["pp16", "tg4", "pp8+tg4", "pp16 @ d32", "tg4 @ d32", "pp8+tg4 @ d32"]
NUMBERS = {
    "n_prompt",
    "n_gen",
    "n_depth",
    "n_batch",
    "avg_ts",
    "stddev_ts",
    "avg_ns",
    "stddev_ns",
    "ttft_ms",
    "peak_memory_gb",
    "samples_ts",
    "samples_ns",
}


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def check_record(record: dict, label: str) -> None:
    assert record["test"] == label
    assert NUMBERS | {"model_type", "mlxcel_version", "mlx_version", "backend"} <= set(record)
    assert record["model_type"] == "tiny (random) bf16" and record["backend"].startswith("mlx-")
    assert len(record["samples_ns"]) == len(record["samples_ts"]) == 2
    assert record["avg_ts"] > 0 and record["prefill_computed"] == (
        1 if label.startswith("tg") else int(label[2:].split("+")[0].split(" ")[0])
    )


def test_markdown_table(capsys):
    code, out, err = run_cli(capsys, *FAST)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("mlxcel 0.1.0, mlx ") and "tiny (random) bf16" in lines[0] and "Device(" in lines[0]
    table = [ln for ln in lines if ln.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == ["model", "size", "params", "backend", "test", "t/s", "TTFT ms", "peak GB"]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in table[2:]]
    assert [r[4] for r in rows] == LABELS
    for r in rows:
        mean, std = r[5].split(" ± ")
        assert float(mean) > 0 and float(std) >= 0 and len(mean.split(".")[1]) == 2


def test_json(capsys):
    code, out, _ = run_cli(capsys, *FAST, "-o", "json")
    assert code == 0
    records = json.loads(out)
    assert isinstance(records, list) and [r["test"] for r in records] == LABELS
    for record, label in zip(records, LABELS):
        check_record(record, label)
    assert records[3]["n_depth"] == 32 and records[3]["n_prompt"] == 16 and records[3]["n_gen"] == 0


def test_jsonl_and_csv_have_the_same_fields(capsys):
    code, out, _ = run_cli(capsys, *FAST, "-o", "jsonl")
    assert code == 0
    records = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["test"] for r in records] == LABELS
    for record, label in zip(records, LABELS):
        check_record(record, label)

    code, out, err = run_cli(capsys, *FAST, "-o", "csv", "--no-warmup")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == list(records[0])
    assert [r["test"] for r in rows] == LABELS
    assert float(rows[0]["avg_ts"]) > 0 and len(json.loads(rows[0]["samples_ns"])) == 2
    assert "mlxcel 0.1.0" in err  # the header line goes to stderr for machine formats


def test_batch_rows_report_aggregate(capsys):
    code, out, _ = run_cli(
        capsys,
        "bench",
        "--model-shape",
        "tiny",
        "-p",
        "8",
        "-n",
        "6",
        "-r",
        "2",
        "-b",
        "1,3",
        "-o",
        "json",
        "--no-warmup",
    )
    assert code == 0
    records = json.loads(out)
    assert [(r["test"], r["n_batch"]) for r in records] == [("pp8", 1), ("tg6", 1), ("pp8", 3), ("tg6", 3)]
    for r in records:
        tokens = r["n_batch"] * (r["n_prompt"] + r["n_gen"])
        assert r["samples_ts"] == pytest.approx([tokens * 1e9 / ns for ns in r["samples_ns"]])
    assert records[2]["prefill_computed"] == 3 * 8 and records[3]["storage"] == "paged"
    code, out, _ = run_cli(capsys, "bench", "--model-shape", "tiny", "-p", "0", "-n", "4", "-r", "1", "-b", "2")
    assert "|   b |" in out  # md shows the batch column when a row is batched


BAD = {
    "negative -p": (["-p", "-5"], "-p/--n-prompt values must be >= 0"),
    "empty -b": (["-b", ""], "-b/--batch-size needs a comma-separated list"),
    "-b with empty item": (["-b", "1,,8"], "-b/--batch-size needs a comma-separated list"),
    "-b zero": (["-b", "0"], "-b/--batch-size values must be >= 1"),
    "not a number": (["-n", "ten"], "-n/--n-gen needs a comma-separated list"),
    "unknown shape": (["--model-shape", "gpt-5"], "unknown model shape 'gpt-5'"),
    "both models": (["-m", "some/model"], "either -m/--model or --model-shape, not both"),
    "bits": (["--bits", "3"], "--bits must be 4 or 8"),
    "dtype": (["--dtype", "int8"], "--dtype must be"),
    "output": (["-o", "xml"], "-o/--output must be one of md, json, jsonl, csv"),
    "repetitions": (["-r", "0"], "-r/--repetitions must be >= 1"),
    "pg": (["--pg", "512"], "--pg takes PROMPT,GEN"),
    "nothing to run": (["-p", "0", "-n", "0"], "nothing to run"),
    "kv-bits": (["--kv-bits", "3"], "--kv-bits must be 4 or 8"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_exit_2(capsys, case):
    extra, message = BAD[case]
    args = ["bench"] + (["--model-shape", "tiny"] if "--model-shape" not in extra else []) + extra
    code, out, err = run_cli(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert out == ""
    assert len(lines) == 1 and lines[0].startswith("mlxcel: error: "), err
    assert message in lines[0]


def test_bits_without_shape_is_a_usage_error(capsys):
    code, out, err = run_cli(capsys, "bench", "--bits", "4")
    assert code == 2 and "--bits and --dtype apply to --model-shape only" in err


def test_help_does_not_import_mlx():
    probe = (
        "import sys; from mlxcel_cli.main import main; code = main(['bench', '--help']); "
        "print(int(code), any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split()[-2:] == ["0", "False"], proc.stderr
    assert "--model-shape" in proc.stdout and "--n-depth" in proc.stdout


def test_checkpoint_model(tiny_llama_dir, capsys):
    code, out, err = run_cli(capsys, "bench", "-m", str(tiny_llama_dir), "-p", "8", "-n", "4", "-r", "1", "-o", "jsonl")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["test"] for r in records] == ["pp8", "tg4"]
    assert records[0]["model_type"].startswith("llama ") and records[0]["model_n_params"] > 0


def test_cpu_header_names_no_gpu_setting(capsys):
    """On CPU decode steps are not compiled, nor replayed, nor waiting prompts prefilled together: the header
    names the portable backend and none of those settings."""
    import mlx.core as mx

    from mlxcel_core import cpu_blas

    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("the CPU header")
    code, out, err = run_cli(capsys, "bench", "--model-shape", "tiny", "-p", "8", "-n", "0", "-r", "1")
    assert code == 0, err
    header = out.splitlines()[0]
    assert header.endswith(f"; MLX ops (the portable backend); CPU float32 products: {cpu_blas.status()}")
    for gpu_only in ("decode steps", "compiled", "recorded graph", "prefilled together"):
        assert gpu_only not in header
