"""models/base.py protocols: what is checked at runtime must work on every supported Python."""

from __future__ import annotations

import inspect
import typing

import mlx.nn as nn

from mlxcel_core.models.base import Quantizable, is_quantizable
from mlxcel_core.models.moe import SwitchGLU


def test_quantizable_members_are_found_statically():
    """Python >= 3.12 resolves runtime-protocol members with inspect.getattr_static, which does not see an
    nn.Module's parameters (they live in the module's dict): a data member in the protocol made every layer
    non-quantizable there (GGUF and MLX-quantized checkpoints failed to load on 3.12)."""
    members = typing._get_protocol_attrs(Quantizable)
    for layer in (nn.Linear(64, 8), nn.Embedding(8, 64), SwitchGLU(64, 128, 4)):
        target = getattr(layer, "gate_proj", layer)
        assert all(inspect.getattr_static(target, name, None) is not None for name in members), members


def test_is_quantizable():
    assert is_quantizable(nn.Linear(64, 8)) and is_quantizable(nn.Embedding(8, 64))
    assert not is_quantizable(nn.RMSNorm(8))
