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
Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"cold": ["--warmup"], "warm": ["--warmup"], "nowarmup": ["--no-warmup"]}


def save_model(shape: str, bits: int | None, dtype: str, path: Path) -> Path:
    """A random model of `shape` as an MLX checkpoint (the layout mlx-lm writes) plus the tests' tiny tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxcel_core import backends
    from mlxcel_core.backends.base import Backend
    from mlxcel_core.loading.shapes import QUANT_GROUP_SIZE, build_random_model

    sys.path.insert(0, str(ROOT / "tests"))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="llama-3.2-1b")
    parser.add_argument("--bits", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--runs", default="cold,warm,nowarmup", help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ready-timeout", type=float, default=300)
    args = parser.parse_args()
    runs = args.runs.split(",")
    if unknown := [r for r in runs if r not in RUNS]:
        parser.error(f"unknown run(s) {unknown}; choose from {list(RUNS)}")

    work = Path(tempfile.mkdtemp(prefix="mlxcel-coldstart-"))
    os.environ["MLXCEL_CACHE_DIR"] = str(work / "builder-cache")  # the builder's own compiles stay out of `cache`
    began = time.perf_counter()
    model = save_model(args.model_shape, args.bits, args.dtype, work / "model")
    print(
        f"model {args.model_shape} {'%d-bit' % args.bits if args.bits else args.dtype} saved in "
        f"{time.perf_counter() - began:.1f} s",
        flush=True,
    )
    cache = work / "cache"
    for run in runs:
        log_lines: list[str] = []
        began = time.perf_counter()
        proc, port = start_server(model, cache, RUNS[run], log_lines)
        try:
            wait_ready(port, proc, args.ready_timeout)
            ready = time.perf_counter() - began
            first = timed_request(port, args.max_tokens)
            second = timed_request(port, args.max_tokens)
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
        for line in log_lines:  # where the warm-up's time went (its dry run's and its own parts)
            if m := re.search(r"(warm-up(?: dry run)? parts: .*)$", line):
                print(f"{'':9s} {m.group(1)}", flush=True)


if __name__ == "__main__":
    main()
