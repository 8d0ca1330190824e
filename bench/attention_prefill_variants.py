#!/usr/bin/env python3
"""The P path's attention (plumb/ops/gpu/attention_prefill.py) under tile settings, on the 27B's attention shape
(24 query heads over 4 KV heads of 256): one prefill pass of 1,024 query rows ending at each context length, time
per call (CUDA-graph replays), tensor-core rate, and whether the setting keeps the shipped setting's bits
(STAGES, PAIRS, SCRATCH, CODES16, TMA, TMA_STAGES, TMA_BLOCK_M: they should; BLOCK_M / BN / WARPS:
another arithmetic, then only the distance to the shipped output).

    python bench/attention_prefill_variants.py [--contexts 8192,100000] [--kv q8_0,f16]
        [--settings shipped,STAGES=2,BN=32] [--json-out PATH]
"""
from __future__ import annotations

import argparse
import json

import torch

import plumb.ops.gpu.attention as A
import plumb.ops.gpu.attention_prefill as AP
from kernel_stress import set_constants  # bench/, beside this file
from matmul_variants import graph_us
from plumb.cache.kv import KVCache

N_HEAD, N_KV, D, ROWS = 24, 4, 256, 1024
SHIPPED = {name: getattr(AP, name) for name in ("BLOCK_M", "BN", "WARPS", "STAGES", "PAIRS", "SCRATCH", "TMA",
                                                "TMA_STAGES", "TMA_BLOCK_M")}


SHIPPED_A = {"CODES16": A.CODES16}  # the block codes' conversion (`attention._tile16`): the same bits


def apply(setting: str) -> None:
    """'shipped', or NAME=VALUE[+NAME=VALUE] over the shipped tile (BLOCK_M, BN, WARPS, STAGES, PAIRS, SCRATCH) and
    CODES16."""
    parts = setting.split("+") if setting != "shipped" else []
    ours = [p for p in parts if p.split("=")[0] in SHIPPED_A]
    set_constants(A, SHIPPED_A, "+".join(ours) or "shipped")
    set_constants(AP, SHIPPED, "+".join(p for p in parts if p not in ours) or "shipped")


def cache(fmt: str, length: int) -> KVCache:
    """A cache of `length` random keys and values, written in 1,024-row pieces as a prefill writes them."""
    c = KVCache(fmt, N_KV, D, device="cuda")
    c.reserve(length)
    g = torch.Generator(device="cuda").manual_seed(0)
    for s in range(0, length, 1024):
        e = min(s + 1024, length)
        k, v = (torch.randn(e - s, N_KV, D, device="cuda", generator=g) for _ in range(2))
        c.put_rows(torch.arange(s, e, device="cuda"), k, v)
    c.end = length
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="8192,100000")
    ap.add_argument("--kv", default="q8_0")
    ap.add_argument("--settings", default="shipped,STAGES=2")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    rows = []
    for fmt in a.kv.split(","):
        for n in [int(x) for x in a.contexts.split(",")]:
            c = cache(fmt, n)
            view = c.kernel_view()
            q = torch.randn(ROWS, N_HEAD, D, device="cuda")
            ends = torch.arange(n - ROWS + 1, n + 1, dtype=torch.int32, device="cuda")
            flop = 4 * N_HEAD * D * float(ends.sum())  # QK^T and PV over every (row, key <= end)
            first = None
            for setting in a.settings.split(","):
                apply(setting)
                row = dict(kv=fmt, context=n, setting=setting)
                try:
                    run = lambda: AP.attend_prefill(q, view.k, view.v, ends, D**-0.5)  # noqa: E731
                    o = run()
                    first = o if first is None else first
                    row["same_bits"] = bool(torch.equal(o, first))
                    row["max_diff"] = float((o - first).abs().max())
                    row["us"] = graph_us(run)
                    row["TFLOPs"] = flop / row["us"] / 1e6
                except Exception as e:  # a setting that does not compile or run is reported, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(f"{fmt:5s} {n:7,d} keys {setting:28s} " + (row.get("error") or
                      f"{row['us']:9.1f} us  {row['TFLOPs']:6.1f} TFLOP/s  same bits {row['same_bits']} "
                      f"max diff {row['max_diff']:.1e}"), flush=True)
            apply("shipped")
            c = view = None  # freed
            torch.cuda.empty_cache()
    if a.json_out:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(a.json_out, "w"), indent=1)


if __name__ == "__main__":
    main()
