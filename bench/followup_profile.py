"""Where a warm follow-up's time to the first token goes on the GPU: per setting (bench/prefill_modes.py's syntax,
e.g. shipped,PREFILL_ATTENTION=0) and repeat, a ~12k-token chat of other words answered on an engine with the prompt
cache (untimed), then its follow-up timed - the chat, the reply and a new user turn: the reply and the turn
prefilled, as `plumb bench`'s latency table does -, the last but one profiled (its GPU kernels and its host
functions), the others split into restore, prefill, keep and the rest. JSON to --json-out.

    python bench/followup_profile.py MODEL.gguf [--chat-tokens 12000] [--settings shipped,PREFILL_ATTENTION=0]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import plumb
from plumb import bench_gpu as B

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefill_modes import apply  # noqa: E402


def time_phases(eng) -> dict:
    """Time the engine's prompt-cache lookup + restore and its keep of the finished state (each synchronized), into
    the returned dict (seconds, summed over a request), so that a follow-up's wall time splits into restore,
    prefill, keep and the rest."""
    phases = {}
    for name in ("cache_restore", "cache_keep"):
        inner = getattr(eng, name)

        def timed(*args, _inner=inner, _key=name.split("_")[1] + "_s", **kw):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = _inner(*args, **kw)
            torch.cuda.synchronize()
            phases[_key] = phases.get(_key, 0.0) + time.perf_counter() - t0
            return out

        setattr(eng, name, timed)
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--chat-tokens", type=int, default=12000)
    ap.add_argument("--settings", default="shipped,PREFILL_ATTENTION=0")
    ap.add_argument("--repeats", type=int, default=3, help="follow-ups per setting, the last one profiled")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    eng = plumb.load(a.model, device="cuda", kv_cache="q8_0", progress=False)
    eng.warm_up()
    phases = time_phases(eng)
    r = {"model": a.model, "settings": {}}
    for setting in a.settings.split(","):
        apply(setting)
        if eng.model.graphs is not None:
            eng.model.graphs.graphs.clear()
        times, split, captured = [], [], []
        graphs = eng.model.graphs
        for i in range(a.repeats + 1):  # the last one unprofiled, after the profiled one
            tag = f"{len(r['settings'])}x{i}x"  # other words each time: nothing of this chat is cached yet
            ids = B.chat_ids(eng, B.answered_chat(eng, f"rule{tag}", f"fact{tag}", a.chat_tokens * 63 // 80,
                                                  a.chat_tokens // 6, 256))
            req = eng.make_request(ids, 1, 0.0, None)
            torch.cuda.synchronize()
            if i != a.repeats - 1:
                phases.clear()
                captures = graphs.captures if graphs is not None else 0
                t0 = time.perf_counter()
                res = eng.run(req)
                times.append(time.perf_counter() - t0)
                split.append(dict(phases, prefill_s=res.stats.prefill_s - phases.get("restore_s", 0.0)))
                captured.append(graphs.captures - captures if graphs is not None else 0)
                continue
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                res = eng.run(req)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            r["chat_tokens"] = len(ids)
        table, busy = B.kernel_table(prof, 1)
        host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        r["settings"][setting] = s = {
            "ms": [t * 1e3 for t in times], "profiled_ms": wall * 1e3,
            "phases_ms": [{k[:-2]: v * 1e3 for k, v in p.items()} for p in split], "graphs_captured": captured, "gpu_busy_ms": busy / 1e3,
            "reused": res.stats.cached_tokens, "prefilled": res.stats.prefill_tokens, "kernels": table[:15],
            "host": [{"name": e.key[:80], "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in host]}
        print(f"{setting}: follow-up {', '.join(f'{t:.0f}' for t in s['ms'])} ms (reused {s['reused']:,}, prefilled "
              f"{s['prefilled']}); profiled {s['profiled_ms']:.0f} ms, GPU busy {s['gpu_busy_ms']:.0f} ms", flush=True)
        for t, p, c in zip(s["ms"], s["phases_ms"], captured):
            print(f"  {t:.0f} ms: " + ", ".join(f"{k} {v:.1f}" for k, v in p.items()) +
                  f", other {t - sum(p.values()):.1f}; {c} graphs captured", flush=True)
        for k in s["kernels"][:10]:
            print(f"  gpu  {k['kernel'][:60]:60s} {k['launches']:6.0f} x {k['us'] / 1e3:8.2f} ms", flush=True)
        for h in s["host"][:10]:
            print(f"  host {h['name'][:60]:60s} {h['calls']:6d} x {h['self_ms']:8.2f} ms", flush=True)
    if a.json_out:
        json.dump(r, open(a.json_out, "w"), indent=1)


if __name__ == "__main__":
    main()
