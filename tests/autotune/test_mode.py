import pytest

from autotune import autotune_dir, autotune_mode


@pytest.mark.parametrize(
    "value, mode",
    [
        ("", "off"),
        ("0", "off"),
        ("OFF", "off"),
        ("cache", "cache"),
        ("read-only", "cache"),
        ("1", "tune"),
        ("yes", "tune"),
    ],
)
def test_modes(value, mode):
    assert autotune_mode(value) == mode


def test_unknown_value_warns_and_is_off(capsys):
    assert autotune_mode("sometimes") == "off"
    assert "MLXCEL_AUTOTUNE='sometimes'" in capsys.readouterr().err


def test_env_and_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("MLXCEL_AUTOTUNE", raising=False)
    assert autotune_mode() == "off"
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    assert autotune_mode() == "cache"
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path))
    assert autotune_dir() == tmp_path / "autotune"
