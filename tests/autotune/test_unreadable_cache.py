"""An autotune cache file that cannot be read (not UTF-8, a directory in its place) is a miss with a one-line
warning naming it: `mlxcel generate` prints the same text as with no cache at all, and `mlxcel serve` answers 200."""

from __future__ import annotations

import httpx
import pytest
from servers import start_server

from autotune import runtime
from autotune.store import Store
from mlxcel_cli.main import main

GENERATE = ["generate", "-p", "Hello world", "-n", "6", "--decode-storage-backend", "paged", "--no-chat-template"]


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    monkeypatch.delenv("MLXCEL_PAGED_DECODE_SPLITS", raising=False)
    runtime.reset()
    yield tmp_path
    runtime.reset()


def looked_up(monkeypatch, run) -> list:
    """The cache files the engine reads during `run()` (the real Store.load, watched)."""
    paths = []
    real = Store.load

    def watched(self, key, candidates=None):
        paths.append(self.path(key))
        return real(self, key, candidates)

    monkeypatch.setattr(Store, "load", watched)
    run()
    monkeypatch.setattr(Store, "load", real)
    runtime.reset()
    return sorted(set(paths))


def spoil(paths) -> None:
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    for i, path in enumerate(paths):
        if i % 2 == 0:
            path.write_bytes(b'{"version": 1, "op": "\xff\xfe\xfa"}')  # not UTF-8
        else:
            path.mkdir()  # unreadable as a file


def test_generate_treats_unreadable_files_as_misses(capsys, monkeypatch, cache, tiny_llama_dir):
    def generate():
        assert main([*GENERATE, "-m", str(tiny_llama_dir)]) == 0

    paths = looked_up(monkeypatch, generate)
    assert paths, "the paged engine looked nothing up in the autotune cache"
    expected, clean_err = capsys.readouterr()
    assert "autotune cache" not in clean_err
    spoil(paths)
    code = main([*GENERATE, "-m", str(tiny_llama_dir)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == expected
    warnings = [line for line in err.splitlines() if "autotune cache" in line]
    assert len(warnings) == len(paths)  # one line per file, each naming it
    for path in paths:
        (line,) = [w for w in warnings if str(path) in w]
        assert line.startswith("mlxcel: warning: autotune cache: ") and "ignoring it" in line
        assert ("not UTF-8" in line) == path.is_file()


def test_serve_answers_200_with_unreadable_files(capfd, monkeypatch, cache, tiny_llama_dir):
    def generate():
        assert main([*GENERATE, "-m", str(tiny_llama_dir)]) == 0

    spoil(looked_up(monkeypatch, generate))
    capfd.readouterr()
    running = start_server(tiny_llama_dir, max_batch_size=4)
    try:
        with running.client() as client:
            for _ in range(2):
                reply = client.post(
                    "/v1/completions", json={"prompt": "Hello world", "max_tokens": 6, "temperature": 0}
                )
                assert reply.status_code == 200, reply.text
                assert reply.json()["usage"]["completion_tokens"] == 6
        assert httpx.get(f"{running.url}/health").status_code == 200
    finally:
        running.stop()
    err = capfd.readouterr().err
    assert "not UTF-8" in err and "UnicodeDecodeError" not in err
