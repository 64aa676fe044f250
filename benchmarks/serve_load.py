"""Load test for an OpenAI-compatible server: N concurrent streaming clients for T seconds.

    python benchmarks/serve_load.py --url http://127.0.0.1:8080 --clients 8 --duration 30 --max-tokens 64

Each client sends streaming requests (stream_options.include_usage) back to back until the time is
up; requests still running then are allowed to finish (bounded by --timeout). Reports requests/s,
output tok/s (completion tokens from usage, or content chunks when a server sends no usage),
TTFT (request sent -> first content), TPOT ((last - first content) / (tokens - 1)), ITL (gap between
content chunks), end-to-end latency, each as p50/p90/p99, and errors by kind. Works against
`mlxcel serve`, `mlx_lm.server`, llama-server or vLLM. Only the URL given is contacted.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "What is the capital of France, and what is it known for?",
    "Summarize the plot of a detective story you invent.",
    "Give two tips for learning a new language.",
    "Describe a sunrise to someone who has never seen one.",
    "Why do cats purr? Answer briefly.",
]


@dataclass
class Sample:
    ttft: float
    e2e: float
    tokens: int
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class Results:
    samples: list[Sample] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    pos = (len(values) - 1) * q
    low = int(pos)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (pos - low)


def one_request(client: httpx.Client, args, body: dict, results: Results) -> None:
    start = time.perf_counter()
    first = last = None
    chunks, usage_tokens, itl, done = 0, None, [], False
    try:
        with client.stream("POST", args.path, json=body, timeout=args.timeout) as response:
            if response.status_code != 200:
                response.read()
                with results.lock:
                    results.errors[f"HTTP {response.status_code}"] += 1
                return
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    with results.lock:
                        results.errors[f"stream error: {event['error'].get('type')}"] += 1
                    return
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        else:
                            itl.append(now - last)
                        last = now
                        chunks += 1
    except httpx.HTTPError as exc:
        with results.lock:
            results.errors[type(exc).__name__] += 1
        return
    if not done:
        with results.lock:
            results.errors["no [DONE]"] += 1
        return
    end = time.perf_counter()
    sample = Sample(ttft=(first or end) - start, e2e=end - start, tokens=usage_tokens or chunks, itl=itl)
    with results.lock:
        results.samples.append(sample)


def client_loop(worker: int, args, model: str, deadline: float, results: Results) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers) as client:
        i = worker
        while time.perf_counter() < deadline:
            prompt = PROMPTS[i % len(PROMPTS)]
            i += args.clients
            body = {
                "model": model,
                "max_tokens": args.max_tokens,
                "temperature": args.temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if args.endpoint == "chat":
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            one_request(client, args, body, results)


def served_model(args) -> str:
    if args.model:
        return args.model
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    response = httpx.get(f"{args.url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def report(results: Results, elapsed: float, args, model: str) -> dict:
    samples = results.samples
    tokens = sum(s.tokens for s in samples)

    def stats(values):
        return {f"p{int(q * 100)}_ms": round(percentile(values, q) * 1000, 2) for q in (0.5, 0.9, 0.99)}

    return {
        "url": args.url,
        "endpoint": args.endpoint,
        "model": model,
        "clients": args.clients,
        "duration_s": args.duration,
        "max_tokens": args.max_tokens,
        "elapsed_s": round(elapsed, 2),
        "requests": len(samples),
        "errors": dict(results.errors),
        "requests_per_s": round(len(samples) / elapsed, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / elapsed, 2),
        "mean_output_tokens": round(tokens / len(samples), 1) if samples else 0,
        "ttft": stats([s.ttft for s in samples]),
        "tpot": stats([s.tpot for s in samples if s.tpot is not None]),
        "itl": stats([gap for s in samples for gap in s.itl]),
        "e2e": stats([s.e2e for s in samples]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (no /v1)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds to keep sending requests")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--api-key")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    args.url = args.url.rstrip("/")
    args.path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    model = served_model(args)
    results = Results()
    start = time.perf_counter()
    deadline = start + args.duration
    threads = [
        threading.Thread(target=client_loop, args=(w, args, model, deadline, results), daemon=True)
        for w in range(args.clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(args.duration + args.timeout + 10)
    summary = report(results, time.perf_counter() - start, args, model)
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{summary['url']} {summary['endpoint']} model={model} clients={args.clients} "
            f"duration={args.duration}s max_tokens={args.max_tokens}"
        )
        print(
            f"requests: {summary['requests']} in {summary['elapsed_s']} s ({summary['requests_per_s']} req/s), "
            f"errors: {summary['errors'] or 0}"
        )
        print(
            f"output: {summary['output_tokens']} tokens ({summary['output_tokens_per_s']} tok/s, "
            f"{summary['mean_output_tokens']} per request)"
        )
        for name in ("ttft", "tpot", "itl", "e2e"):
            s = summary[name]
            print(
                f"{name.upper():5s} p50 {s['p50_ms']:>9.2f} ms   p90 {s['p90_ms']:>9.2f} ms   "
                f"p99 {s['p99_ms']:>9.2f} ms"
            )
    return 1 if not results.samples else 0


if __name__ == "__main__":
    sys.exit(main())
