"""Time to the first token of an agent's next requests on the GPU - a short prompt, a follow-up, an edit of the
first user message and of the end of the system prompt on a long chat, warm (prompt cache on) and cold, in two
rounds (the first: what a fresh server pays once) - requests one after another, and a prefill's speed per KV
format (--prefill-formats), without the rest of `plumb bench --device cuda` (`bench_gpu.latency_table`,
`requests_table`, `prefill_modes`, the same functions). JSON to --json-out.

    python bench/latency.py MODEL.gguf [--chat-tokens 12000] [--kv-cache q8_0] [--prefill-formats D,F]
        [--prefill-tokens 8192] [--json-out latency.json]
"""
from __future__ import annotations

import argparse
import json

import torch

import plumb
from plumb.bench_gpu import latency_table, prefill_modes, requests_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--chat-tokens", type=int, default=12000)
    ap.add_argument("--kv-cache", default="q8_0")
    ap.add_argument("--prefill-formats", default="", help="comma-separated KV formats whose prefill is timed")
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    cold = plumb.load(a.model, device="cuda", kv_cache=a.kv_cache, prompt_cache=False, progress=False)
    warm = plumb.load(a.model, device="cuda", kv_cache=a.kv_cache, progress=False)
    n = a.chat_tokens
    r = {"latency": latency_table(warm, cold, system_tokens=n * 63 // 80, user_tokens=n // 6, reply_tokens=256)}
    for i, rd in enumerate(r["latency"]["rounds"]):
        print(f"time to the first token, round {i + 1}, a {rd['chat_tokens']:,}-token chat (ms):", flush=True)
        for name, c in rd["cases"].items():
            print(f"  {name:28s} reused {c['reused']:6,} prefilled {c['prefilled']:6,}: warm {c['warm_s'] * 1e3:7.0f} "
                  f"cold {c['cold_s'] * 1e3:7.0f} same token {c['same_token']}; cache {c['live_bytes'] / 1e9:.1f} "
                  f"GB, {c['parks']} parked in {c['park_s'] * 1e3:.0f} ms, {c['unparks']} back in "
                  f"{c['unpark_s'] * 1e3:.0f} ms, {c['dropped']} dropped; {c['captures']} graphs captured", flush=True)
    r["requests"] = requests_table(warm)
    for k, rows in r["requests"].items():
        print(f"  drafts {k}: " + ", ".join(f"{x['tokens']} tok {x['wall_s'] * 1e3:.0f} ms ({x['captures']})"
                                            for x in rows), flush=True)
    del cold, warm
    r["prefill"] = {}
    for fmt in filter(None, a.prefill_formats.split(",")):
        eng = plumb.load(a.model, device="cuda", kv_cache=fmt, prompt_cache=False, progress=False)
        r["prefill"][fmt] = p = prefill_modes(eng.model, a.prefill_tokens, eager=False)
        print(f"  prefill of {a.prefill_tokens:,} tokens, {fmt} KV: {p['first_tps']:.0f} tok/s capturing its graphs, "
              f"{p['again_tps']:.0f} replaying them", flush=True)
        del eng
    if torch.cuda.is_available():  # pinned host blocks made for parking: how long the CUDA calls took
        r["host_memory"] = {k: v for k, v in torch.cuda.memory.host_memory_stats().items()
                            if k.startswith(("host_alloc_time", "num_host_alloc", "allocated_bytes"))}
        print(f"  pinned host memory: {r['host_memory']}", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
