"""How the engine picks paged decode attention's num_splits for a shape.

Precedence, highest first:
1. `MLXCEL_PAGED_DECODE_SPLITS=N` (an int >= 1): always N.
2. A value fixed by the caller (PagedStorage(num_splits=N)).
3. The autotune cache, per `MLXCEL_AUTOTUNE`: off (unset/0) never touches it; `cache` reads stored
   winners; `1` reads, and on a miss tunes the bucket right there on a synthetic workload of the bucket's
   shape (logged on stderr), stores the winner and uses it.
4. The built-in heuristic (autotune.ops.default_splits).

Each bucket is resolved once per process (the cache is not read again for it); a chooser also memoizes
per exact shape, so the per-layer cost after the first step is one dict lookup.
"""

from __future__ import annotations

import sys
from typing import Optional

from . import Mode, autotune_dir, autotune_mode
from .ops import OP, Bucket, Geometry, candidates, default_splits, label

ENV_SPLITS = "MLXCEL_PAGED_DECODE_SPLITS"

# (cache dir, mode, runner, device, bucket key, dtype) -> num_splits, for the life of the process
_RESOLVED: dict[tuple, int] = {}


def reset() -> None:
    """Forget what this process resolved (tests)."""
    _RESOLVED.clear()


def env_splits(value: Optional[str] = None) -> Optional[int]:
    """MLXCEL_PAGED_DECODE_SPLITS as an int >= 1, or None (unset, or invalid with a warning)."""
    from mlxcel_core import settings

    raw = settings.raw(ENV_SPLITS) if value is None else value
    if not raw.strip():
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        print(f"mlxcel: warning: {ENV_SPLITS}={raw!r} is not an integer >= 1; ignoring it", file=sys.stderr)
        return None
    return n


def entry_from_result(bucket: Bucket, runner: str, device: str, dtype: str, default: int, result):
    """A cache Entry for a usable ProfileResult of paged-decode-splits."""
    from .store import Key, entry_from_profile

    key = Key(OP, runner, device, bucket.key(), dtype)
    params = {"num_splits": int(result.best.label.split("=")[1])}
    return entry_from_profile(key, result, params, (label(default), {"num_splits": default}), bucket.as_dict())


class SplitsChooser:
    """num_splits for (batch, context, Hq, Hkv, D, block size, dtype, runner); see the module docstring."""

    def __init__(self, fixed: Optional[int] = None, mode: Optional[Mode] = None):
        self.env = env_splits()
        self.fixed = fixed
        self.mode: Mode = autotune_mode() if mode is None and self.env is None and fixed is None else (mode or "off")
        self._memo: dict[tuple, int] = {}

    def __call__(
        self,
        batch: int,
        context: int,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: str,
        runner: str,
    ) -> int:
        if self.env is not None:
            return self.env
        if self.fixed is not None:
            return self.fixed
        shape = (batch, context, q_heads, kv_heads, head_dim, block_size, dtype, runner)
        n = self._memo.get(shape)
        if n is None:
            n = self._memo[shape] = self._resolve(*shape)
        return n

    def _resolve(self, batch, context, q_heads, kv_heads, head_dim, block_size, dtype, runner) -> int:
        geometry = Geometry(head_dim, q_heads, kv_heads, block_size)
        bucket = Bucket.of(batch, context, geometry)
        default = default_splits(bucket, runner, dtype)
        if self.mode == "off":
            return default
        from .ops import device_identity

        device = device_identity()
        memo_key = (str(autotune_dir()), self.mode, runner, device, bucket.key(), dtype)
        if memo_key in _RESOLVED:
            return _RESOLVED[memo_key]
        n = self._lookup(bucket, runner, device, dtype)
        if n is None and self.mode == "tune":
            from mlxcel_core import backends

            if backends.current().in_dry_run():  # (its kernels give zeros: nothing measured now, nothing kept)
                return default
            n = self._tune(bucket, geometry, runner, device, dtype, default)
        _RESOLVED[memo_key] = default if n is None else n
        return _RESOLVED[memo_key]

    @staticmethod
    def _lookup(bucket: Bucket, runner: str, device: str, dtype: str) -> Optional[int]:
        from .store import Key, Store

        labels = [label(s) for s in candidates(bucket, runner)]
        record = Store().load(Key(OP, runner, device, bucket.key(), dtype), candidates=labels)
        if record is None:
            return None
        n = record["tactic"]["params"].get("num_splits")
        if isinstance(n, bool) or not isinstance(n, int) or label(n) != record["tactic"]["label"]:
            print(
                f"mlxcel: warning: autotune cache: bad tactic {record['tactic']!r} for {bucket.key()}; ignoring it",
                file=sys.stderr,
            )
            return None
        return n

    @staticmethod
    def _tune(bucket: Bucket, geometry: Geometry, runner: str, device: str, dtype: str, default: int) -> Optional[int]:
        """MLXCEL_AUTOTUNE=1 on a miss: profile the bucket's shape now, store and use the winner."""
        from .ops import profile_cell
        from .profiler import ProfileSettings
        from .store import Store

        where = f"{OP} {bucket.key()} {dtype}"
        print(f"mlxcel: autotune: tuning {where} on {runner} (first use in this process)...", file=sys.stderr)
        try:
            _, _, _, result = profile_cell(bucket.batch, bucket.context, geometry, dtype, ProfileSettings(), runner)
        except Exception as exc:  # tuning must never take the engine down
            print(
                f"mlxcel: warning: autotune: tuning {where} failed ({type(exc).__name__}: {exc}); "
                f"using the default {label(default)}",
                file=sys.stderr,
            )
            return None
        if not result.usable:
            print(
                f"mlxcel: warning: autotune: no usable measurement for {where}; using {label(default)}", file=sys.stderr
            )
            return None
        entry = entry_from_result(bucket, runner, device, dtype, default, result)
        try:
            path = Store().save(entry)
            saved = f"saved to {path}"
        except OSError as exc:
            saved = f"not saved ({exc.strerror or exc})"
        print(
            f"mlxcel: autotune: {where}: {result.selected} ({entry.latency_us:.1f}us, "
            f"{result.speedup:.3f}x vs {label(default)}); {saved}",
            file=sys.stderr,
        )
        return entry.tactic["params"]["num_splits"]
