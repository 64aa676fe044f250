"""The model catalogue: names resolve to entries, unknown names suggest close ones, `smollm2` is the default model."""

from __future__ import annotations

import re

import pytest

from mlxcel_core import catalog
from mlxcel_core.errors import ModelNotFoundError
from mlxcel_core.loading import resolve as r


def test_entries_are_well_formed():
    assert len(catalog.BY_NAME) == len(catalog.ENTRIES)  # no duplicate name
    for e in catalog.ENTRIES:
        assert catalog.looks_like_name(e.name) and ":" in e.name, e.name
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", e.repo), e.repo
        assert e.format in ("safetensors", "mlx", "gguf")
        assert (e.format == "gguf") == (e.file_pattern is not None and e.file_pattern.endswith(".gguf")), e.name
    for family, tag in catalog.DEFAULT_TAGS.items():
        assert f"{family}:{tag}" in catalog.BY_NAME
    (default,) = [e for e in catalog.ENTRIES if e.default_model]
    assert default.name == "smollm2:135m" and default.repo == r.DEFAULT_HUB_REPO


@pytest.mark.parametrize("spec", ["smollm2", "smollm2:latest", "smollm2:135m"])
def test_family_and_latest_mean_the_default_tag(spec):
    assert catalog.lookup(spec).name == "smollm2:135m"


def test_unknown_names_suggest_close_ones():
    with pytest.raises(ModelNotFoundError, match=r"did you mean smollm2, .*`mlxcel ls --catalog`"):
        catalog.lookup("smolm2")
    with pytest.raises(ModelNotFoundError) as info:
        catalog.lookup("zzzz")
    assert "did you mean" not in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("spec", ["./model", "model.gguf", "org/repo", "/abs/path", "Qwen3"])
def test_paths_and_repo_ids_are_not_names(spec):
    assert not catalog.looks_like_name(spec)


def test_smollm2_resolves_as_the_default_model(tmp_path, monkeypatch):
    """`-m smollm2` finds the default model's GGUF in mlxcel's cache dir, offline, as no `-m` does."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))  # an empty Hugging Face cache
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gguf = r.default_gguf_path()
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    default = r.resolve_model(None, print)
    assert default.path == gguf
    for spec in ("smollm2", "smollm2:latest", "smollm2:135m"):
        assert r.resolve_model(spec, print) == default
    with pytest.raises(ModelNotFoundError, match="did you mean smollm2"):
        r.resolve_model("smolm2", print)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        r.resolve_model("./missing-model", print)
