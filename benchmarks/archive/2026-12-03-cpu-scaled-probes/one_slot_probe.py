"""b1 decode of a scaled qwen3.5 (op overhead dominated), state pool gather/scatter vs direct (1 slot)."""
import sys, time
from pathlib import Path; root = Path(__file__).resolve().parents[3]; sys.path.insert(0, str(root)); sys.path.insert(0, str(root / 'benchmarks'))
import mlx.core as mx
from scaled_shapes import scaled_down
from mlxcel_core.loading.shapes import build_random_model, shape_config
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.engine import state_pool as sp
from mlxcel_core.bench import RandomIdTokenizer, random_prompt
from mlxcel_core.sampling import SamplingParams
config, _ = scaled_down(shape_config("qwen3.5-9b"))
model, config = build_random_model("qwen3.5-9b", dtype="float32", config=config)
tok = RandomIdTokenizer(config["vocab_size"])
prompt = random_prompt(config["vocab_size"], 16, "pool")
orig_state, orig_write = sp.StateView.recurrent_state, sp.StatePool.write
def direct_state(self):
    if self.fresh or self.pool.arrays[self.layer] is None:
        return None
    if self.pool.num_slots == 1:
        return list(self.pool.arrays[self.layer])
    return orig_state(self)
def direct_write(self, layer, slots, state):
    if self.num_slots == 1:
        self.arrays[layer] = [p for p in state]
        return
    orig_write(self, layer, slots, state)
compile_ = sys.argv[1] == "compiled"
def run(direct):
    sp.StateView.recurrent_state = direct_state if direct else orig_state
    sp.StatePool.write = direct_write if direct else orig_write
    eng = Engine(model, tok, EngineConfig(max_batch_size=1, storage="paged", compile_decode=compile_))
    outs = []
    for rep in range(2):
        eng.forget_cached_prefixes()
        seq = eng.open(prompt, SamplingParams(max_tokens=60))
        n = 0; t0 = None; toks = []
        while eng.has_work():
            out = eng.step(); toks += [o.token for o in out if o.token is not None]
            if t0 is None and len(toks) >= 2: t0 = time.perf_counter(); n0 = len(toks)
        dt = time.perf_counter() - t0
        eng.release(seq)
    return (len(toks) - n0) / dt, toks
for r in range(3):
    for direct in (False, True):
        tps, toks = run(direct)
        print(f"{'direct' if direct else 'pool  '}: {tps:.1f} tok/s  {toks[:6]}")
