import sys, time
from pathlib import Path; root = Path(__file__).resolve().parents[3]; sys.path.insert(0, str(root)); sys.path.insert(0, str(root / 'benchmarks'))
import mlx.core as mx
from scaled_shapes import scaled_down
from mlxcel_core.loading.shapes import build_random_model, shape_config
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.bench import RandomIdTokenizer, random_prompt
from mlxcel_core.sampling import SamplingParams
config, _ = scaled_down(shape_config("qwen3.5-9b"))
config.update(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128)
model, config = build_random_model("qwen3.5-9b", dtype="float32", config=config)
tok = RandomIdTokenizer(config["vocab_size"])
prompt = random_prompt(config["vocab_size"], 16, "pool")
for mb in [int(x) for x in sys.argv[1:]]:
    for storage in ("paged",):
        eng = Engine(model, tok, EngineConfig(max_batch_size=mb, storage=storage, compile_decode=True))
        for rep in range(2):
            eng.forget_cached_prefixes()
            seq = eng.open(prompt, SamplingParams(max_tokens=40))
            n = 0; t0 = None
            while eng.has_work():
                out = eng.step(); n += sum(1 for o in out if o.token is not None)
                if t0 is None and n >= 2: t0 = time.perf_counter(); n0 = n
            dt = time.perf_counter() - t0
            eng.release(seq)
        print(f"max_batch {mb} {storage}: {(n - n0) / dt:.1f} tok/s, pool {eng.storage.state_pool.nbytes/1e6 if getattr(eng.storage,'state_pool',None) else 'n/a'} MB")
