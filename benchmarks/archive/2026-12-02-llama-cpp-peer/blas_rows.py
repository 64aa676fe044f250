"""Whether numpy's BLAS gives a row of x @ W.T the same bits whatever the number of rows beside it (the engine's
promise: batching and chunked prefill never change a row's result). SmolLM2's projection shapes, float32, rows
1..64 against the 64-row product.

    python benchmarks/archive/2026-12-02-llama-cpp-peer/blas_rows.py
"""

import numpy as np

rng = np.random.default_rng(0)
print("numpy", np.__version__, "BLAS:", np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"])
for n, k in ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)):
    w = (rng.standard_normal((n, k), dtype=np.float32) * 0.02).T.copy()  # [k, n], as the probe holds it
    x = rng.standard_normal((64, k), dtype=np.float32)
    full = x @ w
    differ = [m for m in range(1, 65) if not np.array_equal((x[:m] @ w), full[:m])]
    offset = [m for m in range(1, 64) if not np.array_equal((x[m:] @ w), full[m:])]
    print(
        f"{n}x{k}: row counts whose rows differ from the 64-row product: {differ or 'none'}; "
        f"offsets: {offset[:8] or 'none'}{' ...' if len(offset) > 8 else ''}"
    )

# Fixed tiles: every product padded to TILE rows. Is a row's result then independent of the other rows' values and
# of its place in the tile?
TILE = 16
for n, k in ((576, 576), (1536, 576), (576, 1536)):
    w = (rng.standard_normal((n, k), dtype=np.float32) * 0.02).T.copy()
    row = rng.standard_normal((1, k), dtype=np.float32)
    results = []
    for place in (0, 5, 15):
        for fill in ("zeros", "random"):
            tile = (
                np.zeros((TILE, k), np.float32) if fill == "zeros" else rng.standard_normal((TILE, k), dtype=np.float32)
            )
            tile[place] = row[0]
            results.append((tile @ w)[place])
    same = all(np.array_equal(r, results[0]) for r in results)
    print(f"{n}x{k}: one row in a {TILE}-row tile, 3 places x 2 fillings: {'identical' if same else 'DIFFERENT'}")
