import mlxcel_core
import mlx.core as mx
from mlxcel_core.bench_model import RandomIdTokenizer
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.loading.shapes import build_random_model
from mlxcel_core.sampling import SamplingParams
from mlxcel_core.backends import cpu_float32
PROMPTS = [[5, 9, 33, 2, 71, 18, 40], [12, 4, 4, 90], [61, 3, 27, 8, 15, 99, 42, 7, 23, 11, 5]]
def greedy(model, config, prompts, storage, bs=None):
    engine = Engine(model, RandomIdTokenizer(config["vocab_size"]), EngineConfig(max_batch_size=bs or len(prompts), storage=storage))
    seqs = [engine.open(p, SamplingParams(max_tokens=40)) for p in prompts]
    out = {s: [] for s in seqs}
    while engine.has_work():
        for step in engine.step():
            if step.token is not None: out[step.seq_id].append(step.token)
    return [out[s] for s in seqs]
for dtype in ("bfloat16","float32"):
    model, config = build_random_model("tiny", dtype=dtype, seed=3)
    for swap in (True, False):
        if not swap: cpu_float32.unprepare(model)
        b = greedy(model, config, PROMPTS, "paged")
        for st in ("paged","dense"):
            a = [greedy(model, config, [p], st, bs=(3 if st=="paged" else 1))[0] for p in PROMPTS]
            print(dtype, "swap" if swap else "mlx", "alone", st, "== batched paged:", a == b, [next((i for i,(x,y) in enumerate(zip(u,v)) if x!=y), None) for u,v in zip(a,b)])
