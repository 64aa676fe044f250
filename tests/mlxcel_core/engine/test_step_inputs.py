"""engine/step_inputs.py: a step's integer inputs as views of one host-built array (kept out of MLX's CUDA
small-block pool: see the module docstring)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxcel_core.engine.step_inputs import int_views


def test_parts_keep_their_values_shapes_and_int32():
    slots, tables, positions = int_views([70], [[2, 5, 0, 0]], [37])
    assert slots.tolist() == [70] and slots.shape == (1,)
    assert tables.tolist() == [[2, 5, 0, 0]] and tables.shape == (1, 4)
    assert positions.tolist() == [37]
    assert {a.dtype for a in (slots, tables, positions)} == {mx.int32}


def test_batch_rows_and_empty_parts():
    slots, tables, lens, nothing = int_views([1, 2, 3], [[9, 8], [7, 6], [5, 4]], [11, 12, 13], [])
    assert slots.tolist() == [1, 2, 3]
    assert tables.tolist() == [[9, 8], [7, 6], [5, 4]]
    assert lens.tolist() == [11, 12, 13]
    assert nothing.shape == (0,)


def test_ragged_rows_are_refused():
    with pytest.raises(ValueError, match="equal lengths"):
        int_views([[1, 2], [3]])
