"""benchmarks/serve_hostile.py, run as a script at a small size: a real `mlxcel serve` on a tiny random model, a few
streaming clients of which some reset mid-stream, stalled connections and a 20 MB body; it must pass its own checks
(/health fast, every completed stream equal to its lone reference, KV blocks and running rows back to 0, a 413) and
report them; and its checks must fail where the server misbehaves (here: a /health limit no server meets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_hostile.py"
SMALL = ["--model-shape", "tiny", "--clients", "6", "--rounds", "1", "--stalled", "6", "--max-tokens", "8", "--json"]


def run(*extra: str, tmp: Path) -> tuple[int, dict]:
    """The script's exit status and JSON report; it leaves nothing in its temporary directory."""
    env = dict(os.environ, TMPDIR=str(tmp))
    argv = [sys.executable, str(SCRIPT), *SMALL, *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert done.stdout.strip(), done.stderr[-2000:]
    assert not [p for p in tmp.iterdir() if p.name.startswith("mlxcel-hostile-")], list(tmp.iterdir())
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


def test_a_small_hostile_load_passes_and_is_reported(tmp_path):
    rc, result = run(tmp=tmp_path)
    assert rc == 0, result["failed"]
    streams = result["streams"]
    # round(0.3 * 6) = 2 clients reset theirs, unless the reply ends (EOS) before the event they reset at
    assert streams["requests"] == 6 and 1 <= streams["disconnected"] <= 2
    assert streams["completed"] == streams["correct"] == 6 - streams["disconnected"]
    assert result["big_body"]["status"] == 413
    assert result["stalled"]["opened"] == 6
    assert result["health"]["probes"] >= 1 and result["health"]["max_s"] < 1.0
    assert result["after"]["mlxcel_kv_blocks_used"] == 0 and result["after"]["llamacpp:requests_processing"] == 0
    assert result["server_alive"] and result["failed"] == []


def test_a_failed_check_exits_1(tmp_path):
    rc, result = run("--health-limit", "0", "--stalled", "0", "--big-body-mb", "0", tmp=tmp_path)
    assert rc == 1 and result["failed"] and "/health max" in result["failed"][0]
