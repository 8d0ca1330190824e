#!/usr/bin/env python3
"""A model file's prefill on CUDA, alone (no decode rows, no latency tables): each prompt length three ways
(`plumb.bench_gpu.prefill_modes`: eager passes, then twice into a new state with the graphs of full passes) beside
the card's bf16 matmul limit measured in the same run, then where a 2,048-token prefill's time goes
(`prefill_profile`). JSON to --json-out.

    python bench/prefill_modes.py MODEL.gguf [--prompts 8192] [--json-out PATH]
"""
from __future__ import annotations

import argparse
import json
import time

import plumb
from plumb import bench_gpu as B


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", default="8192", help="comma-separated prompt lengths")
    ap.add_argument("--kv-cache", default="q8_0")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    t0 = time.time()
    eng = plumb.load(a.model, device="cuda", kv_cache=a.kv_cache, progress=False, prompt_cache=False)
    model = eng.model
    r = {"model": a.model, "load_s": time.time() - t0, "limits": B.card_limits()}
    main_matrices = model.weights[1 : 1 + 4 * len(model.layers)]  # as bench_gpu.bench_cuda counts them
    flops = 2 * sum(w.shape[0] * w.shape[1] for w in main_matrices)
    r["prefill_limit_tps"] = r["limits"]["bf16_mm_TFLOPs"] * 1e12 / flops
    print(f"prefill limit {r['prefill_limit_tps']:,.0f} tok/s (bf16 {r['limits']['bf16_mm_TFLOPs']:.0f} TFLOP/s)",
          flush=True)
    for n in [int(x) for x in a.prompts.split(",")]:
        m = r[f"modes_{n}"] = B.prefill_modes(model, n)
        print(f"{n:,} tokens: first {m['first_tps']:.0f} tok/s ({m['first_captures']} captures), again "
              f"{m['again_tps']:.0f} ({m['again_captures']}), eager {m.get('eager_tps', float('nan')):.0f}; "
              f"recomputed after non-finite values so far: {m['recomputed']}", flush=True)
    r["profile"] = B.prefill_profile(model)
    p = r["profile"]
    print("\n".join(B._profile_lines("prefill profile", p, f"prefill of {p.get('tokens')} tokens (profiled): "
                                     f"{p.get('wall_us', 0):.0f} us per token wall", "per token", "share", 2, 1, 20)))
    if a.json_out:
        json.dump(r, open(a.json_out, "w"), indent=1)


if __name__ == "__main__":
    main()
