"""`mlxcel tune -m NAME`: a catalogue name or a Hub repo id reads the head geometry from the model's files in the
Hugging Face cache (laid out by huggingface_hub's own snapshot_download from a stand-in Hub), offline; a name that is
not downloaded, or not in the catalogue, is one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from stand_in_hub import stand_in_hub

from mlxcel_cli.main import main

CONFIG = {"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8}
GEOMETRY = "paged-decode-splits: head_dim=64 q_heads=16 kv_heads=8 block_size=32 dtype=float16"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path / "mlxcel"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


def download(monkeypatch, repo: str, files: dict[str, bytes]) -> None:
    from huggingface_hub import constants, snapshot_download

    with stand_in_hub({repo: files}) as hub, monkeypatch.context() as m:
        m.setattr(constants, "HF_HUB_OFFLINE", False)
        snapshot_download(repo, endpoint=hub.url)


def tune(capsys, model: str) -> tuple[int, str, str]:
    code = main(["tune", "--dry-run", "-m", model, "--batch-sizes", "1", "--context-lengths", "1024"])
    out, err = capsys.readouterr()
    return code, out, err


def test_catalogue_name_and_repo_id_read_the_cached_config(hf_cache, monkeypatch, capsys):
    download(monkeypatch, "mlx-community/Qwen3-0.6B-4bit", {"config.json": json.dumps(CONFIG).encode()})
    for spec in ("qwen3:0.6b-4bit", "mlx-community/Qwen3-0.6B-4bit"):
        code, out, err = tune(capsys, spec)
        assert code == 0, err
        assert GEOMETRY in out


def test_not_downloaded_or_unknown_name_is_exit_2(hf_cache, capsys):
    code, out, err = tune(capsys, "qwen3:4b")
    assert code == 2 and out == ""
    assert err == "mlxcel: error: 'qwen3:4b' is not downloaded: `mlxcel pull qwen3:4b`\n"
    code, out, err = tune(capsys, "qwen9:4b")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "'qwen9:4b' is not a local path, a Hugging Face repo id or a model name in the catalogue" in err
