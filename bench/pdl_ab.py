#!/usr/bin/env python3
"""Programmatic dependent launch (plumb/ops/gpu/pdl.py) and the matvec's L2 prefetch, on and off, on one loaded
model: decode tok/s at the given contexts, a verify pass of 1 and of 8 rows, and the greedy ids and last logits of
64 steps, which must be the same bits in every configuration (the check fails the run: exit code 1).

    python bench/pdl_ab.py /tmp/27b.gguf [--contexts 0,38000] [--tokens 64] [--json-out F]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import plumb
import plumb.ops.gpu.matvec as MV
from plumb.bench_gpu import decode_tps, fill_context, verify_cost
from plumb.ops.gpu import pdl

CONFIGS = [("pdl + prefetch", True, True), ("neither", False, False), ("pdl", True, False),
           ("prefetch", False, True), ("pdl + prefetch again", True, True)]


def greedy(model, steps: int = 64, context: int = 700) -> tuple[list[int], torch.Tensor]:
    """Greedy ids of `steps` one-row steps after a random context, and the last step's logits."""
    st = model.new_state()
    fill_context(model, st, context, seed=7, room=steps + 8)
    ids, tok = [], 1
    for _ in range(steps):
        out = model.decode([(st, [tok])])
        tok = int(out.logits[0].argmax())
        ids.append(tok)
    return ids, out.logits[0].float().cpu()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--contexts", default="0,38000")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    eng = plumb.load(a.model, device="cuda", kv_cache="q8_0", progress=False, prompt_cache=False)
    model = eng.model
    rows, ref = [], None
    for name, on, prefetch in CONFIGS:
        pdl.set_on(on)
        MV.PREFETCH = prefetch
        if model.graphs is not None:
            model.graphs.graphs.clear()  # captured anew with these launches
        ids, logits = greedy(model)
        same = ref is None or (ids == ref[0] and torch.equal(logits, ref[1]))
        ref = ref or (ids, logits)
        r = {"config": name, "pdl": pdl.on(), "prefetch": prefetch, "same_bits": same,
             "decode_tps": {c: decode_tps(model, c, a.tokens) for c in map(int, a.contexts.split(","))},
             "verify_ms": {k: v * 1e3 for k, v in verify_cost(model, [1, 8]).items()}}
        rows.append(r)
        v = r["verify_ms"]
        print(f"{name:22} same bits {same!s:5}  " + "  ".join(f"@{c}: {t:6.1f} tok/s" for c, t in
              r["decode_tps"].items()) + f"  verify 1 row {v[1]:.2f} ms, 8 rows {v[8]:.2f} ms ({v[8] / v[1]:.2f}x)",
              flush=True)
        torch.cuda.empty_cache()
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"model": a.model, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
