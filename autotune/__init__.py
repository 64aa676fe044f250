"""Autotuning support shared by the engine and the `tune` command.

`MLXCEL_AUTOTUNE` decides whether tuned kernel parameters are used:
unset / 0 / false / off / no -> "off" (the cache is never touched), cache / read / readonly -> "cache"
(read stored winners), 1 / true / on / yes -> "tune" (read, and tune unseen shapes on first use).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

Mode = Literal["off", "cache", "tune"]

_MODES: dict[str, Mode] = {
    "": "off",
    "0": "off",
    "false": "off",
    "off": "off",
    "no": "off",
    "cache": "cache",
    "read": "cache",
    "readonly": "cache",
    "read-only": "cache",
    "1": "tune",
    "true": "tune",
    "on": "tune",
    "yes": "tune",
}


def autotune_mode(value: str | None = None) -> Mode:
    """Parse MLXCEL_AUTOTUNE (or `value`); unknown values warn once on stderr and mean off."""
    from mlxcel_core import settings

    raw = settings.get("MLXCEL_AUTOTUNE") if value is None else value
    mode = _MODES.get(raw.strip().lower())
    if mode is None:
        print(f"mlxcel: warning: MLXCEL_AUTOTUNE={raw!r} is not one of 0, cache, 1; autotuning is off", file=sys.stderr)
        return "off"
    return mode


def autotune_dir() -> Path:
    from mlxcel_core.paths import cache_dir

    return cache_dir() / "autotune"
