"""The autotune cache: one JSON file per tuned (op, runner, device, bucket, dtype).

Directory: `${MLXCEL_CACHE_DIR:-<platform user cache>/mlxcel}/autotune/`. A file's name is the first
16 hex digits of SHA-256 over "op|runner|device|bucket|dtype". It records the schema version, the key
fields, the mlxcel and mlx versions, the tactic and its latency, the default's latency, the candidates,
the rep count, both spreads, the required improvement and when it was measured.

Writes are atomic (a temp file beside the target, then os.replace): a reader never sees half a file.
Reading never crashes: a corrupt file, another schema version, a record whose fields do not match the
key (or the running mlxcel / mlx version), or a tactic no longer among the candidates is a miss, with a
one-line warning on stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

SCHEMA_VERSION = 1


def versions() -> tuple[str, str]:
    """(mlxcel version, mlx version) as recorded in and checked against entries."""
    from importlib.metadata import PackageNotFoundError, version

    from mlxcel_core import __version__

    try:
        mlx_version = version("mlx")
    except PackageNotFoundError:
        mlx_version = "unknown"
    return __version__, mlx_version


@dataclass(frozen=True)
class Key:
    op: str
    runner: str
    device: str
    bucket: str  # Bucket.key()
    dtype: str

    def digest(self) -> str:
        text = "|".join((self.op, self.runner, self.device, self.bucket, self.dtype))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def filename(self) -> str:
        return f"{self.digest()}.json"


@dataclass
class Entry:
    key: Key
    tactic: dict[str, Any]  # {"label": "num_splits=16", "params": {"num_splits": 16}}
    latency_us: float
    default_tactic: dict[str, Any]
    default_latency_us: float
    candidates: list[str]
    reps: int
    spread: float
    default_spread: float
    required_improvement: float
    bucket_fields: dict[str, int] = field(default_factory=dict)
    measured_at: str = ""
    mlxcel_version: str = ""
    mlx_version: str = ""

    def to_json(self) -> dict[str, Any]:
        mlxcel_version, mlx_version = versions()
        return {
            "version": SCHEMA_VERSION,
            "op": self.key.op,
            "runner": self.key.runner,
            "device": self.key.device,
            "bucket": self.key.bucket,
            "bucket_fields": self.bucket_fields,
            "dtype": self.key.dtype,
            "mlxcel_version": self.mlxcel_version or mlxcel_version,
            "mlx_version": self.mlx_version or mlx_version,
            "tactic": self.tactic,
            "latency_us": self.latency_us,
            "default_tactic": self.default_tactic,
            "default_latency_us": self.default_latency_us,
            "candidates": self.candidates,
            "reps": self.reps,
            "spread": self.spread,
            "default_spread": self.default_spread,
            "required_improvement": self.required_improvement,
            "measured_at": self.measured_at or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }


def entry_from_profile(
    key: Key, result, params: dict[str, int], default: tuple[str, dict[str, int]], bucket_fields: dict, per_run: int = 1
) -> Entry:
    """A cache Entry for a usable ProfileResult: its selected (fastest kept) candidate, whose tactic parameters are
    `params`, against `default` (label, parameters); latencies are a timed run's over `per_run` (the calls it holds)."""
    best, ref = result.best, result.default_measurement
    return Entry(
        key=key,
        tactic={"label": best.label, "params": params},
        latency_us=best.median_us / per_run,
        default_tactic={"label": default[0], "params": default[1]},
        default_latency_us=ref.median_us / per_run,
        candidates=list(result.candidates),
        reps=result.reps,
        spread=best.spread,
        default_spread=ref.spread,
        required_improvement=result.required_improvement,
        bucket_fields=bucket_fields,
    )


def _warn(message: str) -> None:
    print(f"mlxcel: warning: autotune cache: {message}", file=sys.stderr)


class Store:
    def __init__(self, directory: Optional[Path] = None):
        if directory is None:
            from . import autotune_dir

            directory = autotune_dir()
        self.directory = Path(directory)

    def path(self, key: Key) -> Path:
        return self.directory / key.filename()

    def save(self, entry: Entry) -> Path:
        """Write atomically: temp file in the same directory, fsync, os.replace."""
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.path(entry.key)
        tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(entry.to_json(), f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                tmp.unlink()
        return target

    def load(self, key: Key, candidates: Optional[list[str]] = None) -> Optional[dict[str, Any]]:
        """The stored record for `key`, or None (a miss). A file that exists but cannot be used warns once
        on stderr. `candidates`: the current candidate labels; a tactic outside them is a miss."""
        path = self.path(key)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            _warn(f"cannot read {path}: {exc.strerror or exc}; ignoring it")
            return None
        except UnicodeDecodeError as exc:
            _warn(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); ignoring it (rerun `mlxcel tune`)")
            return None
        try:
            record = json.loads(text)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            _warn(f"{path} is corrupt ({str(exc).splitlines()[0]}); ignoring it (rerun `mlxcel tune` to replace it)")
            return None
        problem = _mismatch(record, key, candidates)
        if problem:
            _warn(f"{path}: {problem}; ignoring it (rerun `mlxcel tune` to replace it)")
            return None
        return record


def _mismatch(record: dict[str, Any], key: Key, candidates: Optional[list[str]]) -> Optional[str]:
    if record.get("version") != SCHEMA_VERSION:
        return f"schema version {record.get('version')!r}, expected {SCHEMA_VERSION}"
    for name in ("op", "runner", "device", "bucket", "dtype"):
        if record.get(name) != getattr(key, name):
            return f"{name} is {record.get(name)!r}, expected {getattr(key, name)!r}"
    mlxcel_version, mlx_version = versions()
    if record.get("mlx_version") != mlx_version:
        return f"measured with mlx {record.get('mlx_version')}, running mlx {mlx_version}"
    if record.get("mlxcel_version") != mlxcel_version:
        return f"measured with mlxcel {record.get('mlxcel_version')}, running mlxcel {mlxcel_version}"
    tactic = record.get("tactic")
    if (
        not isinstance(tactic, dict)
        or not isinstance(tactic.get("label"), str)
        or not isinstance(tactic.get("params"), dict)
    ):
        return "malformed tactic"
    if candidates is not None and tactic["label"] not in candidates:
        return f"tactic {tactic['label']} is no longer a candidate ({', '.join(candidates)})"
    return None
