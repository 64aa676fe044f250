"""One rank of the mirror test: rank 0 drives a batching Engine (arrivals at different steps, a cancel, greedy,
seeded and unseeded sampled rows); ranks > 0 mirror it. Run alone (tp 1) it is the single-process reference.

usage: python mirror_rank.py MODEL_DIR TP STORAGE   (rank 0 prints {prompt index: token ids} as JSON)
"""

import json
import sys

from mlxcel_core.distributed import init_group
from mlxcel_core.distributed.mirror import LeaderMirror, follow
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

model_dir, tp, storage = sys.argv[1], int(sys.argv[2]), sys.argv[3]
group = init_group(tp) if tp > 1 else None
loaded = load_model(model_dir, log=lambda m: None, group=group)
engine = Engine(
    loaded.model,
    loaded.tokenizer,
    EngineConfig(max_batch_size=3, storage=storage, prefill_chunk_size=8, prefill_grant_interval=2),
)
if group is not None and group.rank() > 0:
    follow(engine, group)
    sys.exit(0)
if group is not None:
    engine.mirror = LeaderMirror(group)

no_eos = (0, 1, 2)  # random weights: keep every row going to max_tokens
greedy = SamplingParams(max_tokens=12, suppress_tokens=no_eos)
seeded = SamplingParams(max_tokens=12, suppress_tokens=no_eos, temperature=0.9, seed=7)
unseeded = SamplingParams(max_tokens=12, suppress_tokens=no_eos, temperature=0.9)
prompts = [list(range(3 + 7 * i, 3 + 7 * i + 5 + 4 * i)) for i in range(6)]
params = [greedy, greedy, seeded, greedy, unseeded, greedy]
arrivals = {0: [0, 1], 2: [2], 3: [3, 4], 6: [5]}  # step -> prompts opened before it
cancel = {9: 1}  # step -> prompt cancelled before it

seq_of, tokens = {}, {i: [] for i in range(len(prompts))}
step = 0
while step <= max(arrivals) or engine.has_work():
    for i in arrivals.get(step, []):
        seq_of[engine.open(prompts[i], params[i])] = i
    if step in cancel:
        engine.close(next(s for s, i in seq_of.items() if i == cancel[step]))
    for out in engine.step():
        if out.token is not None:
            tokens[seq_of[out.seq_id]].append(out.token)
        if out.finished:
            engine.release(out.seq_id)
    step += 1
if engine.mirror is not None:
    engine.mirror.stop()
print(json.dumps({str(i): t for i, t in tokens.items() if params[i] is not unseeded}))
