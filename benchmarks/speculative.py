"""Decode tok/s with prompt-lookup speculative decoding vs plain, interleaved, on an input-grounded prompt and an open
one.

    python benchmarks/speculative.py MODEL.gguf MAX_TOKENS REPS K1,K2

MODEL.gguf: e.g. the SmolLM2 Q4_1 GGUF (mlxcel generate fetches it).
"""

import json
import sys

sys.path.insert(0, ".")
import mlxcel_core  # noqa: F401  (before mlx: MLX's CPU products on OpenBLAS, cpu_blas.py)

# isort: split
import mlx.core as mx

from mlxcel_core.api import prepare_prompt, stream_generate
from mlxcel_core.engine import EngineConfig, SpeculativeConfig
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

gguf, max_tokens, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ks = [int(k) for k in sys.argv[4].split(",")]
m = load_model(gguf, log=lambda x: None)
CODE = """import math


class Circle:
    def __init__(self, radius):
        self.radius = radius

    def area(self):
        return math.pi * self.radius ** 2

    def perimeter(self):
        return 2 * math.pi * self.radius


class Rectangle:
    def __init__(self, width, height):
        self.width = width
        self.height = height

    def area(self):
        return self.width * self.height

    def perimeter(self):
        return 2 * (self.width + self.height)


def total_area(shapes):
    return sum(shape.area() for shape in shapes)
"""
PROMPTS = {
    "edit-code": "Here is some Python code:\n\n" + CODE + "\nPrint the same code again with a comment at the top.",
    "open-question": "Write a short story about a robot who learns to paint.",
}
out = {"device": str(mx.default_device()), "mlx": mx.__version__, "runs": []}
configs = [("plain", None)] + [(f"ngram3-k{k}", SpeculativeConfig(ngram=3, num_draft_tokens=k)) for k in ks]
for name, text in PROMPTS.items():
    ids = prepare_prompt(m.tokenizer, text)
    params = SamplingParams(max_tokens=max_tokens)
    ref = None
    for rep in range(reps + 1):  # rep 0: warm-up
        for label, spec in configs:
            chunks = list(stream_generate(m, ids, params, EngineConfig(speculative=spec)))
            stats = chunks[-1].stats
            tokens = [c.token for c in chunks if c.token is not None]
            if ref is None:
                ref = tokens
            row = {
                "prompt": name,
                "config": label,
                "rep": rep,
                "prompt_tokens": len(ids),
                "generated": stats.generated_tokens,
                "decode_tps": round(stats.decode_tps, 2),
                "identical": tokens == ref,
            }
            if stats.speculative is not None:
                s = stats.speculative
                row.update(
                    rounds=s.rounds,
                    proposed=s.proposed,
                    accepted=s.accepted,
                    acceptance=round(s.acceptance_rate, 3),
                    mean_accepted=round(s.mean_accepted, 2),
                )
            out["runs"].append(row)
            print(json.dumps(row), flush=True)
summary = {}
for r in out["runs"]:
    if r["rep"] == 0:
        continue
    summary.setdefault((r["prompt"], r["config"]), []).append(r["decode_tps"])
print("\nprompt | config | decode tok/s (mean of reps) | x plain")
for (p, c), v in summary.items():
    base = sum(summary[(p, "plain")]) / len(summary[(p, "plain")])
    mean = sum(v) / len(v)
    print(f"{p} | {c} | {mean:.1f} ({', '.join(f'{x:.1f}' for x in v)}) | {mean / base:.2f}x")
