import sys, runpy
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import mlxcel_core  # noqa
from mlxcel_core.loading import shapes
shapes.SHAPES["hostbound"] = dict(shapes.SHAPES["tiny"], vocab_size=49152)
sys.argv = ["worker_probe.py"] + sys.argv[1:]
runpy.run_path(str(ROOT / "benchmarks/archive/2026-12-03-h200-constrained-worker/worker_probe.py"), run_name="__main__")
