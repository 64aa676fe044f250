"""benchmarks/prefill_chunk.py at test size: one JSON row per chunk size, each prompt prefilled in at least its
number of chunks (one a step at most) with the stream decoding beside it, and bad options refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import prefill_chunk  # noqa: E402


def test_one_row_per_chunk_size(capsys):
    argv = ["--model-shape", "tiny", "--dtype", "float32", "--chunks", "16,4", "--prompt-tokens", "32", "--json"]
    assert prefill_chunk.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["chunk"] for r in rows] == [16, 4]
    for row in rows:
        assert row["steps"] >= 32 // row["chunk"]
        assert 0 < row["longest_step_wall_s"] <= row["prefill_wall_s"]
        assert row["decode_step_wall_s"] > 0 and row["model"].startswith("tiny")


@pytest.mark.parametrize("bad", [["--chunks", "8,x"], ["--chunks", "0"], ["--grant-interval", "0"]])
def test_bad_options_exit_2(bad):
    with pytest.raises(SystemExit) as exit_info:
        prefill_chunk.main(["--model-shape", "tiny", *bad])
    assert exit_info.value.code == 2
