import sys, time, argparse, collections
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import mlxcel_core  # noqa
from mlxcel_core.loading import shapes
shapes.SHAPES["hostbound"] = dict(shapes.SHAPES["tiny"], vocab_size=49152)
import structured_outputs as so
import mlx.core as mx
from mlxcel_core.engine import Engine, EngineConfig, engine as engmod
from mlxcel_core.engine import constrained
from mlxcel_core.bench import random_prompt
T = collections.defaultdict(float)
def wrap(obj, name, key):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T[key] += time.perf_counter() - t
    setattr(obj, name, g)
wrap(Engine, "_masks", "masks(all)")
wrap(Engine, "_commit", "commit")
wrap(Engine, "_submit", "submit")
wrap(constrained, "next_masks", "next_masks")
wrap(Engine, "_constrain", "constrain(all)")
wrap(Engine, "_run", "run(all)")
args = argparse.Namespace(model=None, model_shape="hostbound", bits=None, dtype="float32", tokenizer_model=sys.argv[1])
bench, tok = so.load(args)
schema = so.wide_schema(50)
eng = Engine(bench.model, tok, EngineConfig(max_batch_size=8))
prompts = [random_prompt(bench.vocab_size, 32, "structured", 8, i) for i in range(8)]
for c in (None, schema):
    so.decode_run(eng, prompts, 8, c)
for rep in range(2):
  for name, c in (("free", None), ("constrained", schema)):
    T.clear()
    t0 = time.perf_counter()
    tps, _ = so.decode_run(eng, prompts, 128, c)
    tot = time.perf_counter() - t0
    print(name, round(tps, 1), "total", round(tot*1e3), "ms", {k: round(v*1e3, 1) for k, v in sorted(T.items())})
