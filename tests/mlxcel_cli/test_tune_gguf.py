"""`mlxcel tune -m FILE.gguf`: the head geometry comes from the GGUF metadata (header only, no MLX import in a dry
run); a GGUF that is broken or whose geometry varies by layer is one error line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel_cli.main import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_gguf(path: Path, **fields) -> Path:
    """A GGUF file with llama attention metadata and a small vocabulary, and no tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        name = f"llama.{key.replace('__', '.')}"
        if isinstance(value, list):
            writer.add_array(name, value)
        else:
            writer.add_uint32(name, value)
    writer.add_token_list(["<s>", "</s>", "héllo", "wörld"] * 50)
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tune(capsys, model: Path, *extra):
    code = main(["tune", "--dry-run", "-m", str(model), "--batch-sizes", "1", "--context-lengths", "1024", *extra])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "fields, geometry",
    [
        (
            {"embedding_length": 512, "attention__head_count": 8, "attention__head_count_kv": 2},
            "head_dim=64 q_heads=8 kv_heads=2",
        ),
        (  # key_length wins over embedding / heads; kv heads fall back to the query heads
            {"embedding_length": 512, "attention__head_count": 4, "attention__key_length": 256},
            "head_dim=256 q_heads=4 kv_heads=4",
        ),
        (  # per-layer kv heads that agree
            {"embedding_length": 256, "attention__head_count": 4, "attention__head_count_kv": [2, 2, 2]},
            "head_dim=64 q_heads=4 kv_heads=2",
        ),
    ],
)
def test_geometry_from_gguf_metadata(capsys, tmp_path, fields, geometry):
    model = write_gguf(tmp_path / "m.gguf", **fields)
    code, out, err = tune(capsys, model)
    assert code == 0, err
    assert f"paged-decode-splits: {geometry} block_size=32 dtype=float16" in out


def test_a_gguf_without_the_suffix_is_recognised_by_its_magic(capsys, tmp_path):
    model = write_gguf(tmp_path / "model.bin", embedding_length=512, attention__head_count=8)
    code, out, err = tune(capsys, model, "--kv-heads", "4")
    assert code == 0, err
    assert "head_dim=64 q_heads=8 kv_heads=4" in out  # flags still override the file


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "attention.head_count_kv differs between layers ([1, 2])"),
        (b"GGUF\x03\x00\x00\x00", "not a readable GGUF file (the file ends inside its header)"),
        (b"NOPE" + bytes(40), "not a readable GGUF file (no GGUF magic number (not a GGUF file))"),
    ],
)
def test_bad_gguf_is_one_line_and_exit_2(capsys, tmp_path, content, message):
    model = tmp_path / "bad.gguf"
    if content is None:
        write_gguf(model, embedding_length=512, attention__head_count=8, attention__head_count_kv=[1, 2])
    else:
        model.write_bytes(content)
    code, out, err = tune(capsys, model)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("mlxcel: error: ") and message in err, err


def test_gguf_dry_run_imports_no_mlx(tmp_path, cache):
    model = write_gguf(tmp_path / "m.gguf", embedding_length=512, attention__head_count=8)
    code = (
        f"import sys; from mlxcel_cli.main import main; rc = main(['tune', '--dry-run', '-m', {str(model)!r}]); "
        "assert rc == 0; assert 'mlx.core' not in sys.modules, 'dry run imported mlx'"
    )
    env = {**os.environ, "MLXCEL_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "head_dim=64 q_heads=8 kv_heads=8" in proc.stdout


@pytest.mark.real_model
def test_the_default_models_gguf(capsys, smollm2_gguf):
    code, out, err = tune(capsys, smollm2_gguf)
    assert code == 0, err
    assert "paged-decode-splits: head_dim=64 q_heads=9 kv_heads=3 block_size=32" in out
