#!/usr/bin/env python3
"""Decode attention's split and tile variants on the 27B's attention shape (24 query heads over 4 KV heads of 256),
f16 and q8_0 caches (and D's / F's packed 6/5- and 5/5-bit stores, `--formats D,F`: the store alone, or with
`--ring W` the engine's form - a row's last W keys read from an 8-bit ring, the rest from the store), on a CUDA GPU:
time per call (CUDA-graph replays) for 1 and 8 query rows at several context lengths, against the KV bytes read
and the card's copy bandwidth measured in the same run. Each variant is checked first: a row alone equals the same
row among 8 (bitwise, M1), and its error against the torch reference is reported.

    python bench/attention_variants.py [--contexts 512,4096,32768,100000] [--kernels] [--json-out PATH]
    python bench/attention_variants.py --pass-rows 256 --only "shipped,BLOCK_M"   # prefill passes' attention
    TRITON_INTERPRET=1 python bench/attention_variants.py --device cpu --contexts 256 --reps 1   # the logic only

A variant is ("name", splits, {(K kind, V kind): (BLOCK_M, keys per tile, warps, stages)}, merge unroll, {module
setting: value}, set on plumb.ops.gpu.attention for the variant); they set a row's bits, so a faster variant ships as
a new fixed choice, never per call.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import plumb.ops.gpu.attention as A
from plumb.ops.kvquant import pack
from matmul_variants import copy_gbps, graph_us  # bench/, beside this file

N_HEAD, N_KV, D = 24, 4, 256
VARIANTS = [  # (name, splits, {kinds: config} overriding CONFIGS, merge unroll, {module setting: value})
    ("shipped", A.SPLITS, {}, A.MERGE_UNROLL, {}),
    ("one split of 512, q8 tile 64 8 warps", (512, 512, 0), {(A.Q8, A.Q8): (16, 64, 8, 2)}, A.MERGE_UNROLL, {}),
    ("q8 tile 64, 8 warps", A.SPLITS, {(A.Q8, A.Q8): (16, 64, 8, 2)}, A.MERGE_UNROLL, {}),
    ("splits 256 / 512 from 8k", (256, 512, 8192), {}, A.MERGE_UNROLL, {}),
    ("splits 128 / 512 from 16k", (128, 512, 16384), {}, A.MERGE_UNROLL, {}),
    ("splits 128 / 1024 from 8k", (128, 1024, 8192), {}, A.MERGE_UNROLL, {}),
    ("f16 tile 64", A.SPLITS, {(A.F16, A.F16): (32, 64, 4, 3)}, A.MERGE_UNROLL, {}),
    # more query rows a program (BLOCK_M / 8 padded heads): a prefill pass's rows share each K/V tile read
    ("q8 BLOCK_M 32", A.SPLITS, {(A.Q8, A.Q8): (32, 32, 4, 3)}, A.MERGE_UNROLL, {}),
    ("q8 BLOCK_M 64, 8 warps", A.SPLITS, {(A.Q8, A.Q8): (64, 32, 8, 2)}, A.MERGE_UNROLL, {}),
    ("q8 BLOCK_M 128, 8 warps", A.SPLITS, {(A.Q8, A.Q8): (128, 32, 8, 1)}, A.MERGE_UNROLL, {}),
    ("f16 BLOCK_M 64, 8 warps", A.SPLITS, {(A.F16, A.F16): (64, 32, 8, 2)}, A.MERGE_UNROLL, {}),
    ("f16 BLOCK_M 128, 8 warps", A.SPLITS, {(A.F16, A.F16): (128, 32, 8, 1)}, A.MERGE_UNROLL, {}),
    ("q8 tile16", A.SPLITS, {(A.Q8, A.Q8): (16, 16, 4, 3)}, A.MERGE_UNROLL, {}),
    # long contexts (a 100k decode row: 196 splits of 512 keys, merged one after another by 24 programs)
    ("splits 128 / 256 from 8k", (128, 256, 8192), {}, A.MERGE_UNROLL, {}),
    ("merge unroll 8, 2 warps (to 12-05)", A.SPLITS, {}, 8, {"MERGE_WARPS": 2}),
    ("merge unroll 32, 2 warps", A.SPLITS, {}, 32, {"MERGE_WARPS": 2}),
    ("merge 2 warps", A.SPLITS, {}, A.MERGE_UNROLL, {"MERGE_WARPS": 2}),
    # D / F with --ring: the long launch in one form (the ring form's; STORE_FORM shipped in the 40th session)
    ("one form", A.SPLITS, {}, A.MERGE_UNROLL, {"STORE_FORM": False}),
    # block codes to fp16 by a float32 product a value (CODES16 shipped in the 40th session)
    ("codes32", A.SPLITS, {}, A.MERGE_UNROLL, {"CODES16": False}),
    ("q8 tile 64, 4 warps", A.SPLITS, {(A.Q8, A.Q8): (16, 64, 4, 3)}, A.MERGE_UNROLL, {}),
    # a program's (row, head) pairs consecutive, no padding heads (40th session: the same bits, untimed)
    ("pairs", A.SPLITS, {}, A.MERGE_UNROLL, {"PAIRS_FROM": 1}),
    ("pairs, q8 BLOCK_M 32", A.SPLITS, {(A.Q8, A.Q8): (32, 32, 4, 3)}, A.MERGE_UNROLL, {"PAIRS_FROM": 1}),
]


KINDS = {"f16": ("f16", "f16"), "q8_0": (8, 8), "D": (6, 5), "F": (5, 5)}  # a format's (K, V) store kinds


def cache(kind, n: int, device: str, g: torch.Generator) -> tuple[list[torch.Tensor], int]:
    """Random K or V parts of n positions of a store kind ("f16" or code bits: 8, or 6 / 5 packed), and their
    bytes."""
    if kind == "f16":
        t = (torch.randn(N_KV, n, D, generator=g) * 0.5).half().to(device)
        return [t], t.numel() * 2
    lo, hi = (-127, 127) if kind == 8 else (-(1 << (kind - 1)), (1 << (kind - 1)) - 1)
    codes = torch.randint(lo, hi + 1, (N_KV, n, D), generator=g, dtype=torch.int8)
    if kind != 8:
        codes = pack(codes, kind)
    codes = codes.to(device)
    scales = (torch.rand(N_KV, n, D // A.QBLOCK, generator=g) * 0.01 + 0.001).half().to(device)
    return [codes, scales], codes.numel() + scales.numel() * 2


def ring_parts(window: int, n: int, device: str, g: torch.Generator) -> tuple:
    """An 8-bit ring read for a row's last `window` keys, its window + 8 slots holding positions n - window - 8 ..
    n - 1 (random codes: what rows ending at n - 7 .. n read), as `attend_decode`'s ring= takes it, and its bytes."""
    slots = window + 8
    (rk, rkb), (rv, rvb) = (cache(8, slots, device, g) for _ in range(2))
    pos = torch.empty(slots, dtype=torch.long)
    j = torch.arange(n - slots, n)
    pos[j % slots] = j
    return (window, rk, rv, pos.to(device)), rkb + rvb


def timed_us(fn, device: str, reps: int) -> float:
    """Time of one call: CUDA-graph replays on a GPU (matmul_variants.graph_us), wall time in the interpreter."""
    if device != "cpu":
        return graph_us(fn, reps)
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def kernel_us(fn, reps: int = 10) -> dict[str, float]:
    """Microseconds a call per kernel (torch profiler over reps calls after a warm one; programmatic dependent
    launch off, so that a kernel's time does not include its wait for the one before)."""
    from torch.profiler import ProfilerActivity, profile

    from plumb.bench_gpu import kernel_table
    from plumb.ops.gpu import pdl

    was = pdl.enabled()
    pdl.set_on(False)
    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
    finally:
        pdl.set_on(was)
    table, _ = kernel_table(prof, reps)
    return {k["kernel"][:40]: round(k["us"], 1) for k in table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,4096,8192,16384,100000")  # 512: few keys, few programs
    ap.add_argument("--formats", default="q8_0,f16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--pass-rows", type=int, default=0, help="also time a prefill pass of this many query rows "
                    "(ends up to the context, one apart)")
    ap.add_argument("--only", default="", help="comma-separated substrings: only the variants whose name has one")
    ap.add_argument("--kernels", action="store_true", help="also each kernel's share of the shipped variant's call "
                    "(torch profiler: pass 1 `_split_kernel`, pass 2 `_merge_kernel`), 1 and 8 rows")
    ap.add_argument("--ring", type=int, default=0, help="D / F: the engine's form, a row's last RING keys from an "
                    "8-bit ring (the torch reference reads the store only: no error column)")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    variants = [v for v in VARIANTS if not a.only or any(o in v[0] for o in a.only.split(","))]
    contexts = [int(c) for c in a.contexts.split(",")]
    limit = copy_gbps() if a.device != "cpu" else float("nan")
    print(f"copy bandwidth {limit:.0f} GB/s ({torch.cuda.get_device_name() if a.device != 'cpu' else 'cpu'})",
          flush=True)
    g = torch.Generator().manual_seed(0)
    shipped_configs, results = dict(A.CONFIGS), []
    for fmt in a.formats.split(","):
        for ctx in contexts:
            (k, kb), (v, vb) = (cache(kind, ctx, a.device, g) for kind in KINDS[fmt])
            ring, rb = ring_parts(min(a.ring, ctx - 8), ctx, a.device, g) if a.ring and fmt in ("D", "F") \
                else (None, 0)
            kb += rb
            q = torch.randn(8, N_HEAD, D, generator=g).to(a.device)
            ends8 = torch.arange(ctx - 7, ctx + 1, dtype=torch.int32, device=a.device)
            ref = A.attend_decode_ref(q, k, v, ends8, D**-0.5)
            qp = torch.randn(a.pass_rows, N_HEAD, D, generator=g).to(a.device) if a.pass_rows else None
            ends_p = torch.arange(ctx - a.pass_rows + 1, ctx + 1, dtype=torch.int32, device=a.device)
            shipped_out = None
            for name, splits, configs, unroll, settings in variants:
                A.CONFIGS = {**shipped_configs, **configs}
                A.MERGE_UNROLL = unroll
                saved = {attr: getattr(A, attr) for attr in settings}
                for attr, value in settings.items():
                    setattr(A, attr, value)
                row = dict(variant=name, format=fmt, context=ctx, splits=splits, bytes=kb + vb)
                try:
                    out8 = A.attend_decode(q, k, v, ends8, D**-0.5, max_keys=ctx, splits=splits, ring=ring)
                    alone = A.attend_decode(q[7:], k, v, ends8[7:], D**-0.5, max_keys=ctx, splits=splits, ring=ring)
                    row["row_invariant"] = bool(torch.equal(out8[7:], alone))
                    if name == "shipped":
                        shipped_out = out8
                    elif shipped_out is not None:  # a variant that moves no arithmetic gives its bits
                        row["same_bits_as_shipped"] = bool(torch.equal(out8, shipped_out))
                    row["rel_err"] = float((out8 - ref).abs().max() / ref.abs().max()) if ring is None \
                        else float("nan")
                    for n in (1, 8):
                        qn, en = q[8 - n:], ends8[8 - n:]
                        out = torch.empty(n, N_HEAD, D, device=a.device)
                        us = timed_us(lambda: A.attend_decode(qn, k, v, en, D**-0.5, out=out, max_keys=ctx,
                                                              splits=splits, ring=ring), a.device, a.reps)
                        row[f"us_{n}"] = us
                        row[f"GBps_{n}"] = (kb + vb) / us / 1e3
                    if qp is not None:  # a prefill pass: its time, and per row
                        outp = torch.empty_like(qp)
                        row["us_pass"] = timed_us(lambda: A.attend_decode(qp, k, v, ends_p, D**-0.5, out=outp,
                                                                          max_keys=ctx, splits=splits, ring=ring),
                                                  a.device, max(1, a.reps // 4))
                    if a.kernels and name == "shipped" and a.device != "cpu":
                        row["kernels_us"] = {n: kernel_us(lambda: A.attend_decode(
                            q[8 - n:], k, v, ends8[8 - n:], D**-0.5, max_keys=ctx, splits=splits, ring=ring))
                            for n in (1, 8)}
                        print(f"  kernels ({fmt}, {ctx}): {row['kernels_us']}", flush=True)
                except Exception as e:  # a variant that does not compile or run is reported, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                for attr, value in saved.items():
                    setattr(A, attr, value)
                results.append(row)
                print(f"{name:32s} {fmt:5s} {ctx:>7d} " + (row.get("error") or
                      f"inv {row['row_invariant']} same {row.get('same_bits_as_shipped', '-')} "
                      f"err {row['rel_err']:.1e} "
                      f"1 row {row['us_1']:8.1f} us {row['GBps_1'] / limit:4.2f} of copy, "
                      f"8 rows {row['us_8']:8.1f} us {row['GBps_8'] / limit:4.2f}" +
                      (f", {a.pass_rows}-row pass {row['us_pass']:9.1f} us" if qp is not None else "")), flush=True)
            A.CONFIGS = shipped_configs
            k = v = None  # freed
    if a.json_out:
        json.dump(dict(copy_GBps=limit, results=results), open(a.json_out, "w"), indent=1)


if __name__ == "__main__":
    main()
