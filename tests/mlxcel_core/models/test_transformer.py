"""models/transformer.py helpers."""

import mlx.core as mx

from mlxcel_core.models.transformer import heads_first, heads_last


def test_heads_first_and_last_are_the_transposing_reshapes():
    """At L = 1 they are single reshapes; they must equal the reshape-and-transpose at every L."""
    for length in (1, 3):
        x = mx.random.normal((2, length, 4 * 8), key=mx.random.key(length))
        expected = x.reshape(2, length, 4, 8).transpose(0, 2, 1, 3)
        assert mx.array_equal(heads_first(x, 4), expected)
        assert mx.array_equal(heads_last(expected), x)
