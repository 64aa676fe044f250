import sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import mlxcel_core  # noqa
from mlxcel_core.loading import shapes
shapes.SHAPES["hostbound"] = dict(shapes.SHAPES["tiny"], vocab_size=49152)
import structured_outputs
sys.exit(structured_outputs.main(sys.argv[1:]))
