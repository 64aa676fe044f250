import mlxcel_core, time
from mlxcel_core.loading import load_model
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.sampling import SamplingParams
loaded = load_model("/tmp/srv/smol-q4")  # from: mlxcel convert SmolLM2-135M-Instruct.Q4_1.gguf -o /tmp/srv/smol-q4
e = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=16, prefill_grant_interval=int(__import__("sys").argv[1])))
t0 = time.perf_counter()
for i in range(4):
    e.open([100 + i] + list(range(300, 340)), SamplingParams(max_tokens=32))
first = {}
step = 0
while e.has_work():
    outs = e.step()
    toks = [o.seq_id for o in outs if o.token is not None]
    for s in toks:
        first.setdefault(s, round(time.perf_counter() - t0, 2))
    step += 1
print("first tokens at", first, "steps", step, "total", round(time.perf_counter() - t0, 2))
