import pytest

from mlxcel_core.engine.budget import device_memory_bytes, parse_kv_budget
from mlxcel_core.errors import InputError


def test_sizes_tokens_and_fractions():
    assert parse_kv_budget("1000t", 64) == 1000
    assert parse_kv_budget("4GiB", 1 << 20) == 4096
    assert parse_kv_budget("512m", 1 << 10) == 512 * 1024
    assert parse_kv_budget("0.5", 1) == device_memory_bytes() // 2


@pytest.mark.parametrize("text", ["lots", "4 parsecs", "-1", "0t"])
def test_bad_budgets_are_input_errors(text):
    with pytest.raises(InputError):
        parse_kv_budget(text, 64)
