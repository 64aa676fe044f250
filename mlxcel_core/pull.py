"""`mlxcel pull`: download a catalogue model or a Hub repo into the Hugging Face cache and verify every file.

huggingface_hub downloads (its cache is the store; no second copy). What it guarantees: a file's bytes arrive whole
(its size is checked), a dropped connection is resumed with a Range request within the same run, and files already
in the cache are not fetched again (an interrupted pull of several files resumes file by file). What it does not:
hash the bytes. So after the download, every file of the snapshot that the pull asked for is hashed and compared with
the Hub's listing of that commit: the sha256 of LFS files (the weights), the git blob sha1 of the others. A file that
differs (corrupted on disk or in transfer) is deleted and downloaded again once; if it differs again the pull fails.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import catalog
from .errors import InputError, ModelNotFoundError, RuntimeFailure

Log = Callable[[str], None]
# Beside what mlxcel loads, the license and the model card (`mlxcel show` reports the license from them).
CARD_PATTERNS = ["LICENSE*", "LICENCE*", "README.md"]


@dataclass
class PullResult:
    name: str  # what was asked for
    repo: str
    commit: str
    path: Path  # the snapshot directory
    files: list[str]  # repo-relative paths verified
    size: int  # bytes of those files
    fetched_again: list[str]  # files that failed their checksum and were downloaded again

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "repo": self.repo,
            "commit": self.commit,
            "path": str(self.path),
            "files": self.files,
            "size": self.size,
            "verified": True,
            "fetched_again": self.fetched_again,
        }


def target(spec: str) -> tuple[str, list[str], str | None]:
    """(repo, allow patterns, the GGUF pattern or None) for a catalogue name or a Hub repo id."""
    from .loading.resolve import _REPO_ID, HUB_PATTERNS

    if catalog.looks_like_name(spec):
        entry = catalog.lookup(spec)
        if entry.file_pattern:
            return entry.repo, [entry.file_pattern, *CARD_PATTERNS], entry.file_pattern
        return entry.repo, [*HUB_PATTERNS, *CARD_PATTERNS], None
    if _REPO_ID.match(spec):
        return spec, [*HUB_PATTERNS, *CARD_PATTERNS], None
    raise InputError(f"'{spec}' is neither a model name of the catalogue nor a Hugging Face repo id (org/name)")


def pull(spec: str, log: Log, progress: bool) -> PullResult:
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    repo, patterns, gguf = target(spec)
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise InputError(f"HF_HUB_OFFLINE=1 forbids downloading '{repo}'")
    (enable_progress_bars if progress else disable_progress_bars)()
    path = _download(repo, patterns, log)
    if gguf and len(list(path.glob(gguf))) != 1:
        raise ModelNotFoundError(f"{repo} has {len(list(path.glob(gguf)))} files matching {gguf} (expected one)")
    if not gguf and not (path / "config.json").is_file():
        raise InputError(f"{repo} has no config.json: not a model mlxcel loads (a GGUF repo? pull a catalogue name)")
    files, size, again = verify(repo, path, patterns, log)
    return PullResult(spec, repo, path.name, path, files, size, again)


def _download(repo: str, patterns: list[str], log: Log) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    from .loading.resolve import _bound_hub_timeouts

    _bound_hub_timeouts()
    log(f"pulling {repo}")
    try:
        return Path(snapshot_download(repo, allow_patterns=patterns))
    except GatedRepoError:
        raise InputError(f"'{repo}' is gated: accept its license on the Hub, then log in (HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"'{repo}' is not a repository on the Hugging Face Hub") from None
    except Exception as exc:  # noqa: BLE001 - a reset, a timeout, an HTTP error: the network failed, not the name
        first = (str(exc).strip().splitlines() or [""])[0]
        raise RuntimeFailure(f"could not download '{repo}': {type(exc).__name__}: {first}") from None


def verify(repo: str, snapshot: Path, patterns: list[str], log: Log) -> tuple[list[str], int, list[str]]:
    """Hash each requested file of the snapshot against the Hub's listing of its commit; fetch a bad one again."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    try:
        remote = {
            f.path: f
            for f in HfApi().list_repo_tree(repo, revision=snapshot.name, recursive=True)
            if isinstance(f, RepoFile)
        }
    except Exception as exc:  # noqa: BLE001 - the listing is the reference: without it nothing is verified
        raise RuntimeFailure(f"could not list '{repo}' to verify its checksums: {type(exc).__name__}: {exc}") from None
    wanted = sorted(filter_repo_objects(remote, allow_patterns=patterns))
    log(f"verifying {len(wanted)} files")
    again = []
    for rel in wanted:
        if not _matches(snapshot / rel, remote[rel]):
            log(f"{rel}: checksum mismatch, downloading it again")
            _fetch_again(repo, snapshot, rel)
            again.append(rel)
            if not _matches(snapshot / rel, remote[rel]):
                raise RuntimeFailure(f"{repo}: {rel} does not match the Hub's checksum after downloading it again")
    return wanted, sum(remote[rel].size for rel in wanted), again


def _matches(path: Path, remote) -> bool:
    from huggingface_hub.utils.sha import git_hash, sha_fileobj

    if not path.is_file():
        return False
    with open(path, "rb") as f:
        if remote.lfs is not None:
            return sha_fileobj(f).hex() == remote.lfs.sha256
        return git_hash(f.read()) == remote.blob_id


def _fetch_again(repo: str, snapshot: Path, rel: str) -> None:
    """Delete the bad file (the snapshot link and the blob it points to) and download it anew."""
    from huggingface_hub import hf_hub_download

    link = snapshot / rel
    blob = link.resolve() if link.is_symlink() else None
    link.unlink(missing_ok=True)
    if blob is not None:
        blob.unlink(missing_ok=True)
    try:
        hf_hub_download(repo, rel, revision=snapshot.name, force_download=True)
    except Exception as exc:  # noqa: BLE001 - as for the first download: the network failed
        raise RuntimeFailure(f"could not download '{repo}' {rel} again: {type(exc).__name__}: {exc}") from None
