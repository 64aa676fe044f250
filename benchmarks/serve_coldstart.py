"""`mlxcel serve`'s cold start: how long from launch until /health is 200, and the first request's TTFT.

    python benchmarks/serve_coldstart.py --model-shape llama-3.2-1b --bits 4 --runs cold,warm,nowarmup

Saves a random-weight model of the shape (with the tests' tiny tokenizer: the text is noise, ids past its
vocabulary decode to nothing) to a temporary directory, then starts `mlxcel serve` on it once per run, each a new
process on one MLXCEL_CACHE_DIR that starts empty:
  cold      warm-up on, nothing in the kernel cache yet (a fresh machine)
  warm      warm-up on, the kernel cache filled by an earlier run (a restart)
  nowarmup  --no-warmup: /health turns 200 at once and the first request pays whatever is left to compile
For each: seconds to ready, the server's `warm-up: N s` log line, then two streaming completions one after the other
(TTFT = request sent -> first streamed chunk, and the whole request), and the kernel files cached after the run.
On a CUDA machine also MLX's own JIT modules the run compiled (`mlx_jit_modules`): how many, how many of them
mx.compile's fused elementwise kernels, and the seconds from the first to the last one written. MLX compiles them
one at a time as the server first runs each, so that span is where a cold warm-up's time beyond mlxcel's kernels goes
(`--jit-names` lists them, each with the seconds since the one before: about its compile where they follow on).
`--burst N` (issue 42's "first burst as fast as later ones") then sends N streaming completions at once, twice, one
burst after the other, and prints each burst's TTFT p50 / p99 and its output tok/s (N x --max-tokens over the burst's
wall time), first against second: a first burst that waits on compiles the warm-up left shows as a ratio above 1.
`--max-batch-size` is passed to the server (a burst larger than the batch limit queues its rest).
Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # (the packages from this tree, before tests/'s folders of the same names)
RUNS = {"cold": ["--warmup"], "warm": ["--warmup"], "nowarmup": ["--no-warmup"]}


def save_model(shape: str, bits: int | None, dtype: str, path: Path) -> Path:
    """A random model of `shape` as an MLX checkpoint (the layout mlx-lm writes) plus the tests' tiny tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxcel_core import backends
    from mlxcel_core.backends.base import Backend
    from mlxcel_core.loading.shapes import QUANT_GROUP_SIZE, build_random_model

    sys.path.append(str(ROOT / "tests"))
    from tiny_models import CHATML, build_tokenizer

    previous = backends.use(Backend())  # built on the portable backend: plain parameters, as a checkpoint holds them
    try:
        model, config = build_random_model(shape, bits=bits, dtype=dtype, seed=0)
    finally:
        backends.use(previous)
    if bits:
        config = {**config, "quantization": {"group_size": QUANT_GROUP_SIZE, "bits": bits}}
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    build_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML})
    )
    return path


def start_server(
    model: Path | None, cache: Path, flags: list[str], log_lines: list[str]
) -> tuple[subprocess.Popen, int]:
    """`mlxcel serve` on `model` (None: its default model) and a free port; its stderr lines go to `log_lines`."""
    env = {k: v for k, v in os.environ.items() if k != "MLX_PTX_CACHE_DIR"}
    env["MLXCEL_CACHE_DIR"] = str(cache)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxcel_cli", "serve", *(["-m", str(model)] if model else []), "--port", "0", *flags],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    port: list[int] = []
    ready = threading.Event()

    def read() -> None:  # keeps draining stderr for the process's life (a full pipe would block the server)
        for line in proc.stderr:
            log_lines.append(line.rstrip())
            found = re.search(r"listening on http://\S+:(\d+)", line)
            if found and not port:
                port.append(int(found.group(1)))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(120)
    if not port:
        proc.kill()
        raise RuntimeError("the server printed no port:\n" + "\n".join(log_lines[-20:]))
    return proc, port[0]


def wait_ready(port: int, proc: subprocess.Popen, limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"not ready after {limit:.0f} s")


def timed_request(port: int, max_tokens: int) -> tuple[float, float]:
    """(TTFT, total) in seconds of one streaming completion."""
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": True})
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"status {response.status}: {response.read()[:300]!r}")
    first = None
    for line in response:
        if line.startswith(b"data:") and first is None:
            first = time.perf_counter() - start
    return first if first is not None else float("nan"), time.perf_counter() - start


def burst(port: int, clients: int, max_tokens: int) -> tuple[float, float, float]:
    """(TTFT p50, TTFT p99, output tok/s) of `clients` streaming completions sent at once."""
    results: list[tuple[float, float] | BaseException] = []
    gate = threading.Barrier(clients)

    def client() -> None:
        gate.wait()
        try:
            results.append(timed_request(port, max_tokens))
        except BaseException as e:  # (reported below: a failed request is not a fast one)
            results.append(e)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if failed := [r for r in results if isinstance(r, BaseException)]:
        raise RuntimeError(f"{len(failed)} of {clients} burst requests failed: {failed[0]}")
    ttfts = sorted(r[0] for r in results)
    pick = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]  # noqa: E731
    return pick(0.5), pick(0.99), clients * max_tokens / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="llama-3.2-1b")
    parser.add_argument("--bits", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--runs", default="cold,warm,nowarmup", help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ready-timeout", type=float, default=300)
    parser.add_argument("--burst", type=int, default=0, help="clients of the two bursts after the two requests")
    parser.add_argument("--max-batch-size", type=int, default=None, help="the server's batch limit")
    parser.add_argument("--jit-names", action="store_true", help="also list MLX's JIT modules, in the order written")
    args = parser.parse_args()
    runs = args.runs.split(",")
    if unknown := [r for r in runs if r not in RUNS]:
        parser.error(f"unknown run(s) {unknown}; choose from {list(RUNS)}")

    work = Path(tempfile.mkdtemp(prefix="mlxcel-coldstart-"))
    os.environ["MLXCEL_CACHE_DIR"] = str(work / "builder-cache")  # the builder's own compiles stay out of `cache`
    try:
        began = time.perf_counter()
        model = save_model(args.model_shape, args.bits, args.dtype, work / "model")
        kind = f"{args.bits}-bit" if args.bits else args.dtype
        print(f"model {args.model_shape} {kind} saved in {time.perf_counter() - began:.1f} s", flush=True)
        for run in runs:
            one_run(run, args, model, work / "cache")
    finally:
        shutil.rmtree(work, ignore_errors=True)  # (an 8B model is 4.5 GB)


def one_run(run: str, args: argparse.Namespace, model: Path, cache: Path) -> None:
    """One server process on `cache`: ready, two requests one after the other, the bursts; its lines printed."""
    log_lines: list[str] = []
    began, began_wall = time.perf_counter(), time.time()
    flags = RUNS[run] + (["--max-batch-size", str(args.max_batch_size)] if args.max_batch_size else [])
    proc, port = start_server(model, cache, flags, log_lines)
    try:
        wait_ready(port, proc, args.ready_timeout)
        ready = time.perf_counter() - began
        first = timed_request(port, args.max_tokens)
        second = timed_request(port, args.max_tokens)
        bursts = [burst(port, args.burst, args.max_tokens) for _ in range(2)] if args.burst else []
    finally:
        proc.terminate()
        proc.wait(30)
    warm = next((m.group(1) for line in log_lines if (m := re.search(r"warm-up: ([\d.]+) s", line))), "-")
    ours = next((m.group(1) for line in log_lines if (m := re.search(r"mlxcel's kernels: (.*)$", line))), "")
    ours = f"; mlxcel's kernels: {ours}" if ours else ""  # (its own compiles; MLX's are the rest)
    files = sum(1 for p in (cache / "kernels").rglob("*") if p.is_file()) if (cache / "kernels").exists() else 0
    print(
        f"{run:9s} ready {ready:6.1f} s (warm-up {warm} s{ours}) | first request TTFT {first[0] * 1e3:8.1f} ms, "
        f"total {first[1] * 1e3:8.1f} ms | second TTFT {second[0] * 1e3:7.1f} ms, total {second[1] * 1e3:7.1f}"
        f" ms | kernel cache {files} files",
        flush=True,
    )
    if bursts:
        (p50, p99, rate), (p50b, p99b, rateb) = bursts
        print(
            f"{'':9s} burst of {args.burst}: first TTFT p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, "
            f"{rate:.1f} tok/s | second TTFT p50 {p50b * 1e3:.1f} ms, p99 {p99b * 1e3:.1f} ms, {rateb:.1f} tok/s"
            f" | first / second: TTFT p50 {p50 / p50b:.2f}x, tok/s {rate / rateb:.2f}x",
            flush=True,
        )
    if jit := mlx_jit_modules(cache, began_wall, args.jit_names):
        print(textwrap.indent(jit, " " * 10), flush=True)
    for line in log_lines:  # where the warm-up's time went (its dry run's and its own parts)
        if m := re.search(r"(warm-up(?: dry run)? parts: .*)$", line):
            print(f"{'':9s} {m.group(1)}", flush=True)


def mlx_jit_modules(cache: Path, since: float, names: bool = False) -> str:
    """A line on the JIT modules MLX wrote to its cache (paths.py: kernels/mlx-<version>/<device>/) since `since`
    (a wall time): MLX writes a module's source (`NAME.cu`) after compiling it. Fused elementwise modules (from
    mx.compile) are named by their graph, which starts with an upper-case letter (`Cf4IBroadcast...`); MLX's other
    JIT kernels by their op (`gather_...`, `qmm_naive_...`). Empty where MLX wrote none (a CPU machine, a restart).
    `names`: a line more per module, its name and the seconds since the one before it was written."""
    written = sorted((t, p.name) for p in cache.glob("kernels/mlx-*/*/*.cu") if (t := p.stat().st_mtime) >= since)
    if not written:
        return ""
    fused = sum(1 for _, name in written if name[:1].isupper())
    span = written[-1][0] - written[0][0]
    line = (
        f"MLX's JIT: {len(written)} modules compiled ({fused} fused elementwise, {len(written) - fused} others), "
        f"written over {span:.1f} s"
    )
    if names:
        line += "".join(f"\n  +{t - before:5.1f} s {name[:-3]}" for (before, _), (t, name) in zip(written, written[1:]))
    return line


if __name__ == "__main__":
    main()
