"""The host's share of a constrained step: filling a batch's token masks (engine/constrained.py's `next_masks`, the
rows in turn) against llguidance's thread pool (`LLExecutor`, the rows at once), per batch size.

    python benchmarks/mask_fill.py --tokenizer-model DIR --batches 1,8,32 --reps 200

Each row holds the 50-property schema of structured_outputs.py, part-way through a valid object (a different
prefix per row), as in a batch of constrained requests mid-reply: --where "key" ends each prefix before a property's
name, "string" inside a string value. Median and p90 microseconds of one batch's fill over --reps, the two ways
interleaved; the masks of the two ways are checked equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def rows_midway(tokenizer, n_vocab: int, batch: int, properties: int, where: str):
    """`batch` matchers of the wide schema, row i advanced through the first 3 + i properties of a valid object, then
    (`where` "string") into the next string value."""
    from structured_outputs import KINDS, wide_schema

    from mlxcel_core.engine.constrained import Grammars

    grammars = Grammars(tokenizer, n_vocab)
    values = {"string": '"abc def"', "integer": "1234", "boolean": "true"}
    rows = []
    for i in range(batch):
        row = grammars.open(wide_schema(properties))
        done = 3 * (1 + i % (properties // 3 - 1))  # (the next property is a string)
        fields = [f'"field_{k}": {values[KINDS[k % 3]]}' for k in range(done)]
        text = "{" + ", ".join(fields) + ", " + (f'"field_{done}": "some text' if where == "string" else "")
        for token in tokenizer.encode(text):
            if row.advance(token) is not None:
                raise SystemExit(f"the prefix {text!r} does not match the schema at token {token}")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    import llguidance
    import numpy as np

    from mlxcel_core.engine.constrained import next_masks, prepare, vocab_words
    from mlxcel_core.loading import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer-model", help="whose tokenizer (default: the default model)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--properties", type=int, default=50)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--where", choices=("key", "string"), default="string")
    args = parser.parse_args(argv)
    tokenizer = load_model(args.tokenizer_model, log=lambda m: None).tokenizer
    n_vocab = tokenizer.vocab_size
    prepare(tokenizer, n_vocab).result()
    executor = llguidance.LLExecutor()
    print(f"masks {args.where}: {os.cpu_count()} CPUs, llguidance {metadata.version('llguidance')}")
    print("| batch | in turn, median us | in turn, p90 | LLExecutor, median us | LLExecutor, p90 | ratio |")
    print("|--:|--:|--:|--:|--:|--:|")
    for batch in [int(b) for b in args.batches.split(",")]:
        rows = rows_midway(tokenizer, n_vocab, batch, args.properties, args.where)
        words = vocab_words(rows[0].n_vocab)
        par = np.zeros((batch, words), dtype=np.int32)
        serial_us, par_us = [], []
        for _ in range(args.reps):
            start = time.perf_counter()
            serial, _ = next_masks(rows)
            serial_us.append((time.perf_counter() - start) * 1e6)
            start = time.perf_counter()
            executor.unsafe_compute_mask_ptr(
                [(r.matcher, i) for i, r in enumerate(rows)], par.ctypes.data, words * 4, batch
            )
            par_us.append((time.perf_counter() - start) * 1e6)
        if not np.array_equal(serial, par):
            raise SystemExit("the two ways computed different masks")
        s, p = statistics.median(serial_us), statistics.median(par_us)
        p90 = lambda xs: sorted(xs)[int(0.9 * (len(xs) - 1))]
        print(f"| {batch} | {s:.0f} | {p90(serial_us):.0f} | {p:.0f} | {p90(par_us):.0f} | {p / s:.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
