"""What a never-seen 50-property schema costs on the way to a row's first token, on this machine: the grammar's
generation and validation (constraints.grammar_of, in series in Engine.open), the matcher's compile (on a worker
thread, beside the prefill) and the first mask.

    python benchmarks/archive/2026-12-03-h200-constrained/open_costs.py --tokenizer-model DIR
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

root = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(root))
sys.path.insert(0, str(root / "benchmarks"))


def main() -> int:
    import llguidance
    from structured_outputs import wide_schema

    from mlxcel_core.constraints import JSON_DEFAULTS, _limits
    from mlxcel_core.engine import constrained
    from mlxcel_core.loading import load_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer-model")
    args = parser.parse_args()
    tokenizer = load_model(args.tokenizer_model, log=lambda m: None).tokenizer
    constrained.prepare(tokenizer, tokenizer.vocab_size).result()
    grammars = constrained.Grammars(tokenizer, tokenizer.vocab_size)
    for i in range(5):
        c = wide_schema(50, f"cost{i}")
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(c.text, defaults=JSON_DEFAULTS)
        t1 = time.perf_counter()
        llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=_limits())
        t2 = time.perf_counter()
        row = grammars.open(c)  # (grammar_of again: cached now; the compile starts on the worker)
        row.matcher  # waits for the compile
        t3 = time.perf_counter()
        constrained.next_masks([row])
        t4 = time.perf_counter()
        ms = [1e3 * (b - a) for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4))]
        print("schema -> grammar %.3f ms, validate %.3f ms, open + compile %.3f ms, first mask %.3f ms" % tuple(ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
