"""`mlxcel serve` under hostile load: does /health stay fast, every finished stream stay correct, no KV block leak?

    python benchmarks/serve_hostile.py --model-shape tiny --dtype float32 --clients 64 --stalled 200 --max-tokens 32
    python benchmarks/serve_hostile.py --model PATH|NAME --clients 64 --max-tokens 8

Starts a real `mlxcel serve` process (on a random-weight model of --model-shape, saved with the tests' tokenizer, or
on --model; neither: the default model), asks each (endpoint, prompt) pair once alone (greedy, temperature 0: the
reference text), then at the same time:
  - --clients streaming clients (chat and completions alternately), each sending --rounds requests; a
    --disconnect-frac share of the clients reset each of their connections (TCP RST) after a random number of
    events;
  - --stalled connections that send part of a request and hold: half stop inside the headers, half send whole
    headers with a Content-Length and then only part of the body;
  - one request with a --big-body-mb MB body (past the server's default 16 MiB limit: a 413 is expected);
  - a prober timing GET /health every --probe-interval seconds on a new connection.
Reports /health latency (max, p99: must stay under --health-limit seconds), whether every completed stream's text
and token count equal the reference, the big body's status, the stalled connections the server closed, and the
server's /metrics gauges once the load ends (KV blocks in use and running sequences must return to 0).
Exit status 1 when any check fails. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from serve_coldstart import save_model, start_server, wait_ready  # noqa: E402

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "What is the capital of France?",
    "Describe a sunrise in two sentences.",
    "Give two tips for learning a language.",
    "Why do cats purr?",
    "Name a prime number larger than ten.",
]
ENDPOINTS = ("chat", "completions")


@dataclass
class Outcome:
    """What one streaming request saw: its text, completion tokens (usage), and how it ended."""

    text: str = ""
    tokens: int | None = None
    done: bool = False
    error: str | None = None


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    completed: int = 0
    correct: int = 0
    disconnected: int = 0
    mismatches: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def request_body(endpoint: str, prompt: str, max_tokens: int) -> dict:
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def stream(port: int, endpoint: str, prompt: str, max_tokens: int, cut_after: int | None = None) -> Outcome:
    """One streaming request; with `cut_after`, the connection is reset (RST) after that many events."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    outcome = Outcome()
    try:
        conn.request("POST", path, json.dumps(request_body(endpoint, prompt, max_tokens)),
                     {"Content-Type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        if response.status != 200:
            outcome.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return outcome
        events = 0
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                outcome.done = True
                break
            events += 1
            if cut_after is not None and events >= cut_after:
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return outcome  # closed below with linger 0: the server sees a reset mid-stream
            event = json.loads(line[6:])
            if "error" in event:
                outcome.error = f"error event: {event['error'].get('message')}"
                return outcome
            if event.get("usage"):
                outcome.tokens = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or []:
                outcome.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    except OSError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return outcome


def pair_of(client: int, round_: int) -> tuple[str, str]:
    """The (endpoint, prompt) a client sends in a round: every pair in use has a reference."""
    k = client + round_
    return ENDPOINTS[k % 2], PROMPTS[(k // 2) % len(PROMPTS)]


def references(port: int, args) -> dict[tuple[str, str], Outcome]:
    pairs = {pair_of(c, r) for c in range(args.clients) for r in range(args.rounds)}
    refs = {}
    for endpoint, prompt in sorted(pairs):
        outcome = stream(port, endpoint, prompt, args.max_tokens)
        if not outcome.done:
            raise RuntimeError(f"reference request ({endpoint}, {prompt!r}) failed: {outcome.error}")
        refs[(endpoint, prompt)] = outcome
    return refs


def client(port: int, index: int, args, refs: dict, tally: Tally, rng: random.Random, cuts: bool) -> None:
    """Sends --rounds streaming requests; with `cuts`, each is reset after a random number of events."""
    for round_ in range(args.rounds):
        endpoint, prompt = pair_of(index, round_)
        cut = rng.randint(1, max(1, args.max_tokens // 2)) if cuts else None
        outcome = stream(port, endpoint, prompt, args.max_tokens, cut)
        ref = refs[(endpoint, prompt)]
        with tally.lock:
            if cut is not None and not outcome.done and outcome.error is None:
                tally.disconnected += 1
            elif outcome.done:
                tally.completed += 1
                if outcome.text == ref.text and outcome.tokens == ref.tokens:
                    tally.correct += 1
                else:
                    tally.mismatches.append(
                        {
                            "endpoint": endpoint,
                            "prompt": prompt,
                            "got": outcome.text,
                            "want": ref.text,
                            "tokens": outcome.tokens,
                            "want_tokens": ref.tokens,
                        }  # fmt: skip
                    )
            else:
                tally.errors.append(f"client {index} ({endpoint}): {outcome.error or 'stream ended without [DONE]'}")


def stall(port: int, index: int) -> socket.socket | None:
    """A connection that sends part of a request and then nothing: inside the headers, or inside the body."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if index % 2:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        else:
            head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            sock.sendall(f"{head}Content-Length: 4096\r\n\r\n".encode() + b'{"prompt": "Once upon')
        sock.setblocking(False)
        return sock
    except OSError:
        return None


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server answered (a 408) or closed the stalled connection."""
    try:
        sock.recv(1, socket.MSG_PEEK)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def big_body(port: int, megabytes: int, result: dict) -> None:
    """POST a body of `megabytes` MB to /v1/completions; the status (or the error) and the seconds it took."""
    payload = b'{"prompt": "' + b"a" * (megabytes * 1_000_000) + b'", "max_tokens": 1}'
    start = time.perf_counter()
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode())
        try:
            sock.sendall(payload)
        except OSError:
            pass  # the server may answer and close before the whole body is in
        reply = sock.recv(4096).decode(errors="replace")
        result["status"] = int(reply.split(" ", 2)[1]) if reply.startswith("HTTP/") else reply[:80] or "closed"
        sock.close()
    except OSError as exc:
        result["status"] = f"{type(exc).__name__}: {exc}"
    result["seconds"] = round(time.perf_counter() - start, 3)


def probe_health(port: int, interval: float, stop: threading.Event, latencies: list, failures: list) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/health")
            status = conn.getresponse().status
            conn.close()
            latencies.append(time.perf_counter() - start)
            if status != 200:
                failures.append(f"status {status}")
        except OSError as exc:
            latencies.append(time.perf_counter() - start)
            failures.append(f"{type(exc).__name__}: {exc}")
        stop.wait(interval)


def gauges(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


IDLE_GAUGES = ("mlxcel_kv_blocks_used", "llamacpp:requests_processing", "mlxcel_queue_depth")


def settle(port: int, limit: float) -> tuple[dict, float]:
    """The idle gauges once they all read 0 (or at `limit` seconds), and the seconds that took."""
    start = time.perf_counter()
    while True:
        values = gauges(port)
        idle = {name: values.get(name) for name in IDLE_GAUGES}
        if all(v == 0 for v in idle.values()) or time.perf_counter() - start > limit:
            return idle, round(time.perf_counter() - start, 2)
        time.sleep(0.1)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def run_load(port: int, args, refs: dict) -> dict:
    tally, big, latencies, failures = Tally(), {}, [], []
    stop = threading.Event()
    prober = threading.Thread(target=probe_health, args=(port, args.probe_interval, stop, latencies, failures))
    prober.start()
    stalled = [s for s in (stall(port, i) for i in range(args.stalled)) if s is not None]
    seeds = random.Random(args.seed)
    cutters = set(seeds.sample(range(args.clients), round(args.disconnect_frac * args.clients)))
    workers = [
        threading.Thread(target=client, args=(port, i, args, refs, tally, random.Random(seeds.random()), i in cutters))
        for i in range(args.clients)
    ]
    if args.big_body_mb:
        workers.append(threading.Thread(target=big_body, args=(port, args.big_body_mb, big)))
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - start
    closed = sum(closed_by_server(s) for s in stalled)
    stop.set()
    prober.join()
    for sock in stalled:
        sock.close()
    idle, settle_s = settle(port, args.settle_timeout)
    return {
        "load_s": round(elapsed, 2),
        "health": {
            "probes": len(latencies),
            "max_s": round(max(latencies, default=float("nan")), 4),
            "p99_s": round(percentile(latencies, 0.99), 4),
            "failures": failures[:5],
        },  # fmt: skip
        "streams": {
            "requests": args.clients * args.rounds,
            "completed": tally.completed,
            "correct": tally.correct,
            "disconnected": tally.disconnected,
            "errors": tally.errors[:5],
            "mismatches": tally.mismatches[:3],
        },  # fmt: skip
        "stalled": {"opened": len(stalled), "closed_by_server": closed},
        "big_body": big,
        "after": {**idle, "settle_s": settle_s},
    }


def verdict(result: dict, args) -> list[str]:
    """The failed checks, in words (empty: all passed)."""
    failed = []
    health, streams = result["health"], result["streams"]
    if health["failures"] or not health["max_s"] < args.health_limit:
        failed.append(f"/health max {health['max_s']} s (limit {args.health_limit}), failures {health['failures']}")
    if streams["correct"] != streams["completed"] or streams["errors"]:
        failed.append(f"{streams['completed'] - streams['correct']} wrong streams, errors {streams['errors']}")
    if streams["completed"] + streams["disconnected"] != streams["requests"]:
        failed.append(f"{streams['requests'] - streams['completed'] - streams['disconnected']} streams unaccounted")
    if any(result["after"][name] != 0 for name in IDLE_GAUGES):
        failed.append(f"not idle after the load: {result['after']}")
    if args.big_body_mb and result["big_body"].get("status") not in (413,):
        failed.append(f"the {args.big_body_mb} MB body got {result['big_body'].get('status')}, not 413")
    return failed


def serve_flags(args) -> list[str]:
    flags = ["--max-batch-size", str(args.batch), "--max-queue-depth", str(args.clients + 8)]
    return flags + [flag for extra in args.server_arg for flag in extra.split()]


def launch(args, work: Path) -> tuple[subprocess.Popen, int, list[str]]:
    model = save_model(args.model_shape, args.bits, args.dtype, work / "model") if args.model_shape else args.model
    log_lines: list[str] = []
    proc, port = start_server(model, work / "cache", serve_flags(args), log_lines)
    wait_ready(port, proc, args.ready_timeout)
    return proc, port, log_lines


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", help="model directory, .gguf file or Hub id (default: serve's default model)")
    model.add_argument("--model-shape", help="random weights of this shape (e.g. tiny, llama-3.2-1b)")
    parser.add_argument("--bits", type=int, choices=(4, 8))
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests each client sends one after the other")
    parser.add_argument("--stalled", type=int, default=200)
    parser.add_argument("--disconnect-frac", type=float, default=0.3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--big-body-mb", type=int, default=20, help="0: no big body")
    parser.add_argument("--batch", type=int, default=16, help="serve --max-batch-size")
    parser.add_argument("--server-arg", action="append", default=[], help="more `mlxcel serve` flags (repeatable)")
    parser.add_argument("--health-limit", type=float, default=1.0)
    parser.add_argument("--probe-interval", type=float, default=0.1)
    parser.add_argument("--settle-timeout", type=float, default=30.0)
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mlxcel-hostile-") as scratch:  # the model and caches, removed after
        work = Path(scratch)
        os.environ.setdefault("MLXCEL_CACHE_DIR", str(work / "builder-cache"))
        proc, port, log_lines = launch(args, work)
        try:
            refs = references(port, args)
            result = run_load(port, args, refs)
            result["server_alive"] = proc.poll() is None
        finally:
            proc.terminate()
            proc.wait(60)
    result["config"] = {k: v for k, v in vars(args).items() if k not in ("json",)}
    result["server_log_lines"] = len(log_lines)
    failed = verdict(result, args) + ([] if result["server_alive"] else ["the server died"])
    result["failed"] = failed
    print(json.dumps(result) if args.json else describe(result))
    return 1 if failed else 0


def describe(result: dict) -> str:
    h, s, st, b, a = (result[k] for k in ("health", "streams", "stalled", "big_body", "after"))
    return "\n".join(
        [
            f"load {result['load_s']} s: {s['requests']} streams, {st['opened']} stalled connections, "
            f"big body {result['config']['big_body_mb']} MB",
            f"/health: {h['probes']} probes, max {h['max_s'] * 1e3:.1f} ms, p99 {h['p99_s'] * 1e3:.1f} ms, "
            f"failures {len(h['failures'])}",
            f"streams: {s['completed']} completed ({s['correct']} equal to the lone reference), "
            f"{s['disconnected']} reset mid-stream, {len(s['errors'])} errors",
            f"stalled: {st['closed_by_server']} of {st['opened']} closed by the server during the load",
            f"big body: status {b.get('status')} after {b.get('seconds')} s",
            f"after the load ({a['settle_s']} s): KV blocks used {a['mlxcel_kv_blocks_used']}, "
            f"running {a['llamacpp:requests_processing']}, queued {a['mlxcel_queue_depth']}",
            "PASS" if not result["failed"] else "FAIL: " + "; ".join(result["failed"]),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
