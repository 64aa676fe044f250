"""`mlxcel serve` against `mlx_lm.server` under the same streaming load, on one random-weight checkpoint.

    python benchmarks/serve_peer.py --model-shape llama-3-8b --bits 4 --clients 16,64 --duration 30 --max-tokens 128

Issue 42's serving target at a real model size without downloading one. The checkpoint: a random model of the shape
(as serve_coldstart.py saves it, the layout mlx-lm writes) with a word-level tokenizer covering the model's whole
vocabulary, so every generated id decodes to a word, streamed chunks carry content from the first token on, and time
to first token is the first token's (the tests' 320-token tokenizer would leave most ids of a real-size vocabulary
empty). Prompts are unknown words to it (one id each); what they say does not matter to speed.

Per client count, both servers run one at a time on the same port range, the order alternating from one count to the
next: start, wait until ready (mlxcel: /health, after its warm-up; mlx-lm: /v1/models), one warm-up load of --clients
clients for --warmup seconds, then serve_load.py's clients for --duration seconds, stop. Both are given the same batch
limit (mlxcel `--max-batch-size`, mlx-lm `--decode-concurrency`). Prints each run's serve_load summary and a table of
output tok/s, TTFT p50/p99 and the ratio. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import mlxcel_core  # noqa: E402, F401  (first: on a CPU it installs the BLAS before MLX loads)

# isort: split
from serve_coldstart import save_model  # noqa: E402

from mlxcel_core.loading.shapes import shape_names  # noqa: E402

SPECIAL = ["<unk>", "<|im_start|>", "<|im_end|>"]


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of `vocab_size` ids: the ChatML specials, then one word per id ("w3", "w4", ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIAL[1:])
    return tok


def save_checkpoint(shape: str, bits: int | None, dtype: str, path: Path) -> Path:
    save_model(shape, bits, dtype, path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    word_tokenizer(vocab).save(str(path / "tokenizer.json"))
    return path


def server_command(runtime: str, model: Path, port: int, batch: int) -> tuple[list[str], str]:
    """(argv, the path that answers 200 once the server is ready)."""
    if runtime == "mlxcel":
        argv = ["-m", "mlxcel_cli", "serve", "-m", str(model), "--port", str(port), "--max-batch-size", str(batch)]
        return [sys.executable, *argv], "/health"
    argv = ["-m", "mlx_lm", "server", "--model", str(model), "--port", str(port), "--decode-concurrency", str(batch)]
    return [sys.executable, *argv], "/v1/models"


def wait_ready(proc: subprocess.Popen, port: int, path: str, limit: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"not ready after {limit:.0f} s")


def load(port: int, model: str | None, clients: int, duration: float, max_tokens: int) -> dict:
    """serve_load.py's summary; `model`: the name to send (None: the first of /v1/models)."""
    argv = [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--url", f"http://127.0.0.1:{port}"]
    argv += ["--clients", str(clients), "--duration", str(duration), "--max-tokens", str(max_tokens), "--json"]
    argv += ["--model", model] if model else []
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(runtime: str, model: Path, port: int, args, clients: int, logs: Path) -> dict:
    argv, ready_path = server_command(runtime, model, port, args.max_batch)
    log = (logs / f"{runtime}_c{clients}.log").open("w")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    name = None if runtime == "mlxcel" else str(model)  # (mlx-lm's /v1/models lists its cache, not the served path)
    try:
        ready = wait_ready(proc, port, ready_path, args.ready_limit)
        if args.warmup > 0:
            load(port, name, clients, args.warmup, args.max_tokens)
        summary = load(port, name, clients, args.duration, args.max_tokens)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    summary["ready_s"] = round(ready, 1)
    print(f"{runtime} clients={clients}: {json.dumps(summary)}", flush=True)
    return summary


def table(results: dict) -> str:
    lines = [
        "| clients | mlxcel tok/s (TTFT p50 / p99 ms) | mlx_lm.server tok/s (TTFT p50 / p99 ms) | ratio | errors |",
        "| --: | --- | --- | --: | --- |",
    ]
    for clients, by in results.items():
        ours, theirs = by["mlxcel"], by["mlx-lm"]

        def cell(s):
            return f"{s['output_tokens_per_s']} ({s['ttft']['p50_ms']} / {s['ttft']['p99_ms']})"

        ratio = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"] if theirs["output_tokens_per_s"] else 0
        errors = f"{ours['errors'] or 0} / {theirs['errors'] or 0}"
        lines.append(f"| {clients} | {cell(ours)} | {cell(theirs)} | {ratio:.2f}x | {errors} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", required=True, choices=shape_names())
    parser.add_argument("--bits", type=int, choices=(4, 8))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--clients", default="16,64", help="comma-separated client counts")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the timed one (0: none)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=64, help="both servers' batch limit")
    parser.add_argument("--port", type=int, default=8190)
    parser.add_argument("--ready-limit", type=float, default=900.0, help="seconds a server may take to be ready")
    parser.add_argument("--out", help="directory for the checkpoint and the servers' logs (default: a temporary one)")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="serve-peer-"))
    out.mkdir(parents=True, exist_ok=True)
    model = save_checkpoint(args.model_shape, args.bits, args.dtype, out / "model")
    print(f"{args.model_shape} bits={args.bits} dtype={args.dtype} saved to {model}", flush=True)
    results: dict[int, dict] = {}
    for i, clients in enumerate(int(c) for c in args.clients.split(",")):
        order = ("mlxcel", "mlx-lm") if i % 2 == 0 else ("mlx-lm", "mlxcel")
        results[clients] = {rt: run(rt, model, args.port + 2 * i + j, args, clients, out) for j, rt in enumerate(order)}
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
