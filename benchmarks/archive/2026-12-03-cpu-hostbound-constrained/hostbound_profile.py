import sys, cProfile, pstats, argparse, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import mlxcel_core  # noqa
from mlxcel_core.loading import shapes
shapes.SHAPES["hostbound"] = dict(shapes.SHAPES["tiny"], vocab_size=49152)
import structured_outputs as so
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.bench import random_prompt
args = argparse.Namespace(model=None, model_shape="hostbound", bits=None, dtype="float32", tokenizer_model=sys.argv[1])
bench, tok = so.load(args)
schema = so.wide_schema(50)
eng = Engine(bench.model, tok, EngineConfig(max_batch_size=8))
prompts = [random_prompt(bench.vocab_size, 32, "structured", 8, i) for i in range(8)]
for c in (None, schema):
    so.decode_run(eng, prompts, 8, c)
for name, c in (("free", None), ("constrained", schema)):
    pr = cProfile.Profile()
    pr.enable()
    tps, _ = so.decode_run(eng, prompts, 128, c)
    pr.disable()
    print(name, round(tps, 1))
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
