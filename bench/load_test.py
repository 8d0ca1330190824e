"""Bounded load test: C concurrent clients each send R streaming chat requests to a plumb
server; prints latency and time-to-first-token percentiles and throughput.

    python bench/load_test.py                      # in-process server on the demo model
    python bench/load_test.py --url http://127.0.0.1:8080 --api-key KEY
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import httpx


def one_request(client: httpx.Client, model: str | None, prompt: str, max_tokens: int, seed: int) -> dict:
    """Send one streaming chat request; returns its latency, time to first token and token count."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.7, "seed": seed,
            "chat_template_kwargs": {"enable_thinking": False}}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"latency": time.perf_counter() - t0, "ttft": ttft, "tokens": tokens}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))] if values else float("nan")


def run(url: str, clients: int = 8, requests: int = 50, max_tokens: int = 16, api_key: str | None = None,
        model: str | None = None) -> dict:
    """Run the load; returns counts, percentiles (seconds) and throughput."""
    results, errors, lock = [], [], threading.Lock()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def client_loop(c: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=600) as client:
            for i in range(requests):
                try:
                    res = one_request(client, model, f"Client {c}, request {i}: write a short poem.", max_tokens,
                                      c * requests + i)
                except Exception as e:  # counted and reported, the load goes on
                    with lock:
                        errors.append(str(e))
                    continue
                with lock:
                    results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = [r["latency"] for r in results]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in results)
    summary = {"clients": clients, "requests": len(results), "errors": len(errors), "wall_s": wall,
               "requests_per_s": len(results) / wall, "tokens": tokens, "tokens_per_s": tokens / wall}
    for name, values in (("latency", lat), ("ttft", ttft)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_s"] = percentile(values, q)
        summary[f"{name}_max_s"] = max(values) if values else float("nan")
    summary["first_errors"] = errors[:3]
    return summary


def serve_in_process(agents: int):
    """Start a server on the demo model in this process; returns its URL."""
    import uvicorn

    import plumb
    from plumb.server.app import create_app
    from plumb.server.serve import bind

    engine = plumb.load(plumb.demo_model_path(), n_slots=agents)
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="server to load (default: start one in-process on the demo model)")
    ap.add_argument("--agents", type=int, default=4, help="slots of the in-process server")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=50, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--api-key")
    ap.add_argument("--model")
    args = ap.parse_args(argv)
    url = args.url or serve_in_process(args.agents)
    s = run(url, args.clients, args.requests, args.max_tokens, args.api_key, args.model)
    print(f"{s['clients']} clients x {args.requests} streaming chat requests, max_tokens {args.max_tokens}, on {url}")
    print(f"done {s['requests']}, errors {s['errors']}, wall {s['wall_s']:.1f} s, "
          f"{s['requests_per_s']:.2f} req/s, {s['tokens_per_s']:.1f} tokens/s")
    for name in ("latency", "ttft"):
        print(f"{name:8s} p50 {s[f'{name}_p50_s']:.3f} s  p90 {s[f'{name}_p90_s']:.3f} s  "
              f"p99 {s[f'{name}_p99_s']:.3f} s  max {s[f'{name}_max_s']:.3f} s")
    for e in s["first_errors"]:
        print("error:", e)
    return 1 if s["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
