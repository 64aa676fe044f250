"""The autotune cache: round trip, atomic writes, and every kind of bad file is a miss with one warning line."""

from __future__ import annotations

import json
import os

import pytest

from autotune import store as store_mod
from autotune.store import SCHEMA_VERSION, Entry, Key, Store, versions

KEY = Key("paged-decode-splits", "mlx-ops", "cpu-test-2c", "b8xc16384xhq32xhkv8xd128xbs32", "float16")
CANDIDATES = [f"num_splits={s}" for s in (1, 2, 4, 8, 16, 32)]


def entry(splits: int = 16, key: Key = KEY) -> Entry:
    return Entry(
        key=key,
        tactic={"label": f"num_splits={splits}", "params": {"num_splits": splits}},
        latency_us=100.0,
        default_tactic={"label": "num_splits=8", "params": {"num_splits": 8}},
        default_latency_us=122.0,
        candidates=CANDIDATES,
        reps=40,
        spread=0.01,
        default_spread=0.012,
        required_improvement=0.022,
        bucket_fields={"batch": 8, "context": 16384},
    )


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "autotune")


def one_warning(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("mlxcel: warning: autotune cache:")
    return lines[0]


def test_round_trip_and_file_layout(store):
    path = store.save(entry())
    assert path.parent == store.directory
    assert path.name == KEY.filename() and len(path.stem) == 16 and int(path.stem, 16) >= 0
    record = store.load(KEY, CANDIDATES)
    mlxcel_version, mlx_version = versions()
    assert record["tactic"] == {"label": "num_splits=16", "params": {"num_splits": 16}}
    assert record["version"] == SCHEMA_VERSION
    assert {k: record[k] for k in ("op", "runner", "device", "bucket", "dtype")} == {
        "op": KEY.op,
        "runner": KEY.runner,
        "device": KEY.device,
        "bucket": KEY.bucket,
        "dtype": KEY.dtype,
    }
    assert (record["mlxcel_version"], record["mlx_version"]) == (mlxcel_version, mlx_version)
    for field in (
        "latency_us",
        "default_latency_us",
        "candidates",
        "reps",
        "spread",
        "default_spread",
        "required_improvement",
        "measured_at",
        "default_tactic",
    ):
        assert field in record
    assert record["measured_at"].endswith("+00:00")
    assert list(store.directory.iterdir()) == [path]  # no temp file left behind


def test_key_fields_all_change_the_file_name():
    names = {KEY.filename()}
    for field in ("op", "runner", "device", "bucket", "dtype"):
        names.add(Key(**{**KEY.__dict__, field: "other"}).filename())
    assert len(names) == 6


def test_missing_file_is_a_silent_miss(store, capsys):
    assert store.load(KEY) is None
    assert capsys.readouterr().err == ""


def test_save_overwrites(store):
    store.save(entry(16))
    store.save(entry(4))
    assert store.load(KEY, CANDIDATES)["tactic"]["label"] == "num_splits=4"


def test_atomic_write_keeps_the_old_file_when_writing_fails(store, monkeypatch):
    path = store.save(entry(16))
    before = path.read_text()

    def broken_dump(obj, f, **kwargs):
        f.write('{"version": 1, "op": "paged-dec')  # half a file ...
        raise OSError("No space left on device")  # ... then the disk fills up

    monkeypatch.setattr(store_mod.json, "dump", broken_dump)
    with pytest.raises(OSError, match="No space"):
        store.save(entry(4))
    assert path.read_text() == before  # readers never see the half-written file
    assert [p.name for p in store.directory.iterdir()] == [path.name]  # and the temp file is gone


def test_atomic_write_goes_through_a_temp_file_and_rename(store, monkeypatch):
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((os.path.basename(src), os.path.basename(dst), json.loads(open(src).read())["tactic"]["label"]))
        return real_replace(src, dst)

    monkeypatch.setattr(store_mod.os, "replace", spy)
    store.save(entry(8))
    assert seen == [(f".{KEY.filename()}.tmp.{os.getpid()}", KEY.filename(), "num_splits=8")]


@pytest.mark.parametrize("content", ["{not json", "", "[1, 2]", '{"version": 1, "op"'])
def test_corrupt_file_is_a_miss_with_a_warning(store, capsys, content):
    store.directory.mkdir(parents=True)
    store.path(KEY).write_text(content)
    assert store.load(KEY, CANDIDATES) is None
    assert "corrupt" in one_warning(capsys)


def rewrite(store, **changes):
    path = store.save(entry())
    record = json.loads(path.read_text())
    record.update(changes)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"version": SCHEMA_VERSION + 1}, "schema version"),
        ({"version": "1"}, "schema version"),
        ({"device": "gpu-somewhere-else"}, "device"),
        ({"bucket": "b1xc1024xhq32xhkv8xd128xbs32"}, "bucket"),
        ({"runner": "cuda-kernel-00000000"}, "runner"),
        ({"dtype": "bfloat16"}, "dtype"),
        ({"mlx_version": "0.0.1"}, "mlx 0.0.1"),
        ({"mlxcel_version": "0.0.0"}, "mlxcel 0.0.0"),
        ({"tactic": "num_splits=16"}, "malformed tactic"),
    ],
)
def test_foreign_or_mismatched_record_is_a_miss_with_a_warning(store, capsys, changes, words):
    rewrite(store, **changes)
    assert store.load(KEY, CANDIDATES) is None
    assert words in one_warning(capsys)


def test_tactic_no_longer_a_candidate_is_a_miss(store, capsys):
    store.save(entry(32))
    assert store.load(KEY, CANDIDATES[:5]) is None
    assert "no longer a candidate" in one_warning(capsys)
    assert store.load(KEY, CANDIDATES) is not None


def test_unreadable_file_is_a_miss(store, capsys):
    store.directory.mkdir(parents=True)
    store.path(KEY).mkdir()  # a directory where the file should be
    assert store.load(KEY) is None
    assert "cannot read" in one_warning(capsys)


def test_default_directory_follows_mlxcel_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path))
    assert Store().directory == tmp_path / "autotune"
