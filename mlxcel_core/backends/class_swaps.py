"""Undoing a backend's class swaps: a built model's modules swapped (by `__class__`) for subclasses that compute the
same values another way (cpu_float32.py, cpu_rope.py, cpu_norm.py) get their own classes back."""

from __future__ import annotations

from typing import Callable

import mlx.nn as nn


def swap_back(model: nn.Module, swaps: dict[type, type], undo: Callable[[nn.Module], None] | None = None) -> int:
    """Give every module whose class is a value of `swaps` (plain class -> swapped class) its plain class again, after
    `undo` (what the swap added to it); returns how many."""
    plain = {swapped: own for own, swapped in swaps.items()}
    restored = 0
    for _, module in model.named_modules():
        if type(module) in plain:
            if undo is not None:
                undo(module)
            module.__class__ = plain[type(module)]
            restored += 1
    return restored
