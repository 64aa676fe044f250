"""benchmarks/llama_cpp_peer.py without llama.cpp: the random-block GGUF writer gives weights of about 0.02 that
`mlxcel bench -m` loads and runs (the file llama-bench reads on the GPU machine), and the staging's split pieces
join back byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import llama_cpp_peer  # noqa: E402


@pytest.mark.parametrize("qtype", ["q4_0", "q4_k"])
def test_written_file_holds_weights_of_about_0_02_and_mlxcel_runs_it(tmp_path, qtype):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = tmp_path / f"m-{qtype}.gguf"
    llama_cpp_peer.main(
        ["write", str(path), "--model-shape", "llama-3.2-1b", "--type", qtype, "--layers", "1", "--vocab", "512"]
    )
    reader = GGUFReader(path)
    kinds = {t.tensor_type.name.lower() for t in reader.tensors if len(t.shape) == 2}
    assert kinds == {qtype}
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    values = dequantize(q.data, q.tensor_type)
    assert values.shape == (2048, 2048) and np.isfinite(values).all()
    assert 0.015 < values.std() < 0.03 and abs(values.mean()) < 0.005
    bench = [sys.executable, "-m", "mlxcel_cli.main", "bench", "-m", str(path), "-p", "8", "-n", "4", "-r", "1"]
    done = subprocess.run(bench + ["-o", "json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["test"] for r in rows] == ["pp8", "tg4"] and all(r["avg_ts"] > 0 for r in rows)


def test_a_row_length_the_block_does_not_divide_is_refused():
    with pytest.raises(SystemExit, match="multiple of 256"):
        llama_cpp_peer.random_blocks(np.random.default_rng(0), 2, 576, "q4_k")


def test_split_pieces_join_back(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp_peer, "CHUNK", 1000)
    big = tmp_path / "big.whl"
    data = np.random.default_rng(0).bytes(2500)
    big.write_bytes(data)
    pieces = llama_cpp_peer._pieces([big], tmp_path)
    assert [p.name for p in pieces] == ["big.whl.part00of03", "big.whl.part01of03", "big.whl.part02of03"]
    carried = tmp_path / "repo" / ".devwheels" / "lcp_1"
    carried.mkdir(parents=True)
    for piece in pieces[:2]:  # one call carries two pieces, the next the third
        piece.rename(carried / piece.name)
    monkeypatch.setattr(llama_cpp_peer, "ROOT", tmp_path / "repo")
    monkeypatch.setattr(llama_cpp_peer, "WORK", tmp_path / "work")
    llama_cpp_peer.unpack()
    assert not (tmp_path / "work" / "big.whl").exists()
    for f in carried.iterdir():
        f.unlink()
    pieces[2].rename(carried / pieces[2].name)
    llama_cpp_peer.unpack()
    assert (tmp_path / "work" / "big.whl").read_bytes() == data
    assert not list((tmp_path / "work").glob("*.part*"))
