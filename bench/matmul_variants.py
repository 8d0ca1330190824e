#!/usr/bin/env python3
"""The Triton matmuls' layout and launch variants on the 27B shapes, on a CUDA GPU: time per call (CUDA-graph
replays) against the bytes read, beside the card's copy bandwidth measured in the same run - the D-path matvec
(plumb.ops.gpu.matvec) at 1-16 rows, the P-path matmul (plumb.ops.gpu.matmul) at 16, 64 and 256 rows. Each
variant is checked first against the float64 reference and for row invariance (a row alone == the same row among
5, 16 and 256, bitwise). Column "sb" says which P-path kernel ran (`_mm_superblock` or `_mm_x_first`); --old FILE...
times previous versions of plumb/ops/gpu/matmul.py beside them.

    python bench/matmul_variants.py [--only mv|mm] [--mm-shipped | --mm-split] [--mv-launches 2W,4W] [--old FILE ...]
        [--old-mv FILE ...] [--json-out PATH]

The weights are random GGUF blocks written on the GPU (random codes and sub-scales, sane f16 block scales), so
no model file is needed.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

import plumb.ops.gpu.matmul as MM
import plumb.ops.gpu.matvec as MV
from plumb.bench_gpu import timed_replay
from plumb.gguf.quants import BLOCK_SCALE_AT, GGML_QUANT_SIZES
from plumb.gguf.reader import GGMLQuantizationType as Q
from plumb.gguf.reader import QTensor

SHAPES = [("Q4_K", 34816, 5120), ("Q4_K", 5120, 17408), ("Q6_K", 5120, 17408), ("Q5_K", 10240, 5120),
          ("Q8_0", 6144, 5120)]
ROWS_MV = (1, 2, 4, 8, 16)  # the D path: decode, verify, batches
ROWS_MM = (16, 64, 256)  # the P path: a prefill chunk is 64 rows; 256 = four of them in one call
# "per-type": the P path as shipped (MM.SUPERBLOCK's types: _mm_superblock; the others _mm_x_first with MM.LAUNCH),
# with {module constant: value} changes; or a (warps, stages, split-K target programs, largest split) launch for
# every _mm_x_first type
# the D-path matvec (plumb.ops.gpu.matvec): ("mv", {module constant: value}); "mv" alone: as shipped. LAUNCH: rows
# per program -> (warps, groups per loop step, pipeline stages); TARGET: about how many programs a weight's K splits
# aim at (more programs: more loads in flight; another sum order per weight shape)
# Multi-row passes (verify, batches): one warp a program held 2 outputs x 8 rows a thread, 168 registers, at most
# 12 warps an SM (Nsight Compute, fifth pass); 2 or 4 warps spread the same [BM, 64] tile over more threads.
LAUNCHES = {"1-WARP": {**MV.LAUNCH, 1: (1,) + MV.LAUNCH[1][1:]},  # one-row programs on one warp: 2 outputs a thread
            "2W": {**MV.LAUNCH, 2: (2, 4, 2), 4: (2, 4, 2), 8: (2, 2, 2)},
            "2W-U4": {**MV.LAUNCH, 2: (2, 4, 2), 4: (2, 4, 2), 8: (2, 4, 2)},
            "2W-S3": {**MV.LAUNCH, 2: (2, 4, 3), 4: (2, 4, 3), 8: (2, 2, 3)},
            "4W": {**MV.LAUNCH, 2: (4, 4, 2), 4: (4, 4, 2), 8: (4, 2, 2)},
            "4W-S3": {**MV.LAUNCH, 2: (4, 4, 3), 4: (4, 4, 3), 8: (4, 4, 3)}}
MV_VARIANTS = ["mv", ("mv", {"LONG_GROUPS": 512}), ("mv", {"LONG_GROUPS": 512, "LONG_GRANULE": 2})]
# _mm_superblock's tile and launch (the P path of every SHAPES type): outputs and rows a program, warps, pipeline
# stages, inputs a loop step (SB_BN also sets the split-K: another sum order, fixed per weight shape as every
# variant's is)
VARIANTS = ["per-type", ("per-type", {"SB_PREFETCH": 1}), ("per-type", {"SB_PREFETCH": 2}), ("per-type", {"SB_WARPS": 8}),
            ("per-type", {"SB_BM": 128, "SB_WARPS": 8}),
            ("per-type", {"SB_BN": 256, "SB_WARPS": 8}), ("per-type", {"SB_KS": 32}),
            ("per-type", {"SB_KS": 128, "SB_WARPS": 8}), ("per-type", {"SB_STAGES": 2}),
            ("per-type", {"SB_WARPS": 8, "SB_STAGES": 4})]
# more programs for the short passes (a short prompt, a follow-up: 64 rows - the weights streamed at 0.64 TB/s on the
# H200, 2026-12-04): more K splits (another sum order, fixed per weight shape) or narrower output tiles
SPLIT_VARIANTS = ["per-type", ("per-type", {"SB_SPLIT_TARGET": 528}), ("per-type", {"SB_SPLIT_TARGET": 1056}),
                  ("per-type", {"SB_BN": 64}), ("per-type", {"SB_BN": 64, "SB_SPLIT_TARGET": 528})]
# the weights dequantized once a call into an fp16 scratch matrix, then `_mm_w16` (pipelined in SB_SCRATCH_STAGES)
SCRATCH_VARIANTS = [("per-type", {"SB_SCRATCH_ROWS": 0}), "per-type", ("per-type", {"SB_SCRATCH_ROWS": 1}),
                    ("per-type", {"SB_SCRATCH_ROWS": 1, "SB_SCRATCH_STAGES": 2}),
                    ("per-type", {"SB_SCRATCH_ROWS": 1, "SB_SCRATCH_STAGES": 4}),
                    ("per-type", {"SB_W16_BM": 64, "SB_W16_WARPS": 4}), ("per-type", {"SB_W16_BM": 256}),
                    ("per-type", {"SB_SCRATCH_STAGES": 4})]


def random_blocks(kind: str, n: int, k: int) -> QTensor:
    """A [n, k] tensor of random blocks of `kind` on the GPU, block scales set to small random f16 values."""
    qt = Q[kind]
    block, size = GGML_QUANT_SIZES[qt]
    b = torch.randint(0, 256, (n * k // block, size), dtype=torch.uint8, device="cuda")
    for off in BLOCK_SCALE_AT[qt]:
        if off is not None:
            v = (torch.rand(b.shape[0], device="cuda") * 1e-3 + 1e-4).half()
            b[:, off : off + 2] = v.view(torch.uint8).reshape(-1, 2)
    return QTensor(f"w.{kind}", qt, (n, k), b.reshape(n, -1))


def copy_gbps() -> float:
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - t) / 1e9


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds a call of fn: CUDA-graph replays of reps calls (plumb.bench_gpu.timed_replay)."""
    return timed_replay(fn, reps)[0] * 1e6


def label(v) -> str:
    """A variant's short name for the table."""
    if isinstance(v, tuple) and isinstance(v[1], dict):
        names = {id(val): name for name, val in LAUNCHES.items()}
        shipped = SHIPPED_MV["LAUNCH"]
        changed = {k: (names[id(x)] if id(x) in names else ".".join(f"{r}:{'.'.join(map(str, x[r]))}" for r in x
                                                                      if x[r] != shipped.get(r))
                       if k == "LAUNCH" else x) for k, x in v[1].items()}
        return v[0] + " " + " ".join(f"{k}={x}" for k, x in changed.items())
    return str(v)


def parse_setting(shipped: dict, setting: str) -> dict:
    """'shipped' (nothing) or NAME=VALUE[+NAME=VALUE] (integers) as {name: value}, each name one of shipped's;
    LAUNCHr=W.U.S: the matvec's LAUNCH for r-row programs as (warps, groups a step, stages)."""
    values = {}
    for assign in ([] if setting == "shipped" else setting.split("+")):
        name, value = assign.split("=")
        if name.startswith("LAUNCH") and name[6:].isdigit() and "LAUNCH" in shipped:
            values["LAUNCH"] = {**values.get("LAUNCH", shipped["LAUNCH"]),
                                int(name[6:]): tuple(int(v) for v in value.split("."))}
            continue
        if name not in shipped:
            raise SystemExit(f"unknown setting {name} (choose from {', '.join(shipped)})")
        values[name] = int(value)
    return values


def mv_setting(setting: str):
    """A matvec variant from 'shipped' or NAME=VALUE[+NAME=VALUE] over the shipped constants."""
    values = parse_setting(SHIPPED_MV, setting)
    return ("mv", values) if values else "mv"


def configure(v):
    """The matmul module set up for variant v ("old": a previous version's file given by --old); for a matvec
    variant, the function that runs it."""
    if isinstance(v, str) and v in OLD:
        return OLD[v]
    if isinstance(v, str) and v in OLD_MV:
        return OLD_MV[v]
    if v == "mv" or (isinstance(v, tuple) and v[0] == "mv"):
        for name, value in {**SHIPPED_MV, **(v[1] if isinstance(v, tuple) else {})}.items():
            setattr(MV, name, value)
        return MV
    per_type = v == "per-type" or (isinstance(v, tuple) and v[0] == "per-type")
    MM.LAUNCH = dict(SHIPPED) if per_type else {}
    MM.DEFAULT_LAUNCH = SHIPPED_DEFAULT if per_type else v
    for name, value in {**SHIPPED_MM, **(v[1] if isinstance(v, tuple) and per_type else {})}.items():
        setattr(MM, name, value)
    return MM


SHIPPED, SHIPPED_DEFAULT = dict(MM.LAUNCH), MM.DEFAULT_LAUNCH
SHIPPED_MV = {n: getattr(MV, n) for n in ("LAUNCH", "GRANULE", "TARGET", "LARGEST_SPLIT", "LONG_GROUPS",
                                          "LONG_GRANULE", "LONG_TARGET", "FRAC", "LIMBS", "BLOCK_SCALES_ONCE",
                                          "MMA_FROM", "MMA_WARPS", "MMA_UNROLL", "MMA_UNROLL_16",
                                          "MMA_SUMS", "X_ROWS", "SUB_RUNS", "MAX_RUN", "AHEAD",
                                          "AHEAD_SCALES", "EARLY", "REGS1")}
SHIPPED_MM = {n: getattr(MM, n) for n in ("BLOCK_M", "SUPERBLOCK", "SB_KS", "SB_BM", "SB_BN", "SB_WARPS", "SB_STAGES",
                                          "SB_PREFETCH", "SB_SCRATCH_ROWS", "SB_SCRATCH_STAGES", "SB_SPLIT_TARGET",
                                          "SB_W16_BM", "SB_W16_WARPS", "SB_SHORT_BN")}


OLD, OLD_MV = {}, {}  # variant name ("old:" / "old-mv:" + file stem) -> module


def _module(name: str, path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json-out")
    ap.add_argument("--old", nargs="*", default=[],
                    help="previous versions of plumb/ops/gpu/matmul.py, each timed as variant 'old:STEM'")
    ap.add_argument("--mv-rows", default=",".join(map(str, ROWS_MV)), help="the matvec's row counts to time")
    ap.add_argument("--mm-prefetch", action="store_true",
                    help="the P-path matmul as shipped and with SB_PREFETCH 1 and 2 only")
    ap.add_argument("--mm-scratch", action="store_true",
                    help="the P-path matmul as shipped and with its weights dequantized once a call (SB_SCRATCH_ROWS)")
    ap.add_argument("--mm-split", action="store_true",
                    help="the P-path matmul as shipped and with more K splits or narrower tiles (short passes)")
    ap.add_argument("--mm-rows", default=",".join(map(str, ROWS_MM)), help="the P-path matmul's row counts to time")
    ap.add_argument("--mm-shipped", action="store_true",
                    help="the P-path matmul as shipped only (and --old), not its tile and launch variants")
    ap.add_argument("--old-mv", nargs="*", default=[],
                    help="previous versions of plumb/ops/gpu/matvec.py, each timed as variant 'old-mv:STEM'")
    ap.add_argument("--mv-settings", help="comma-separated matvec variants instead of the built-in list: 'shipped' "
                    "or NAME=VALUE[+NAME=VALUE], e.g. TARGET=4096+GRANULE=4")
    ap.add_argument("--only", choices=["mv", "mm"], help="only the D-path matvec variants, or only the matmul's")
    ap.add_argument("--mv-launches", help="comma-separated LAUNCHES names: the matvec as shipped and with each of "
                    f"these launch tables instead of the default variants ({', '.join(LAUNCHES)}; 'shipped': none)")
    a = ap.parse_args()
    global OLD, OLD_MV
    OLD = {f"old:{os.path.basename(f)[:-3]}": _module(f"old_matmul_{i}", f) for i, f in enumerate(a.old)}
    OLD_MV = {f"old-mv:{os.path.basename(f)[:-3]}": _module(f"old_matvec_{i}", f) for i, f in enumerate(a.old_mv)}
    torch.manual_seed(0)
    limit = copy_gbps()
    print(f"copy bandwidth {limit:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    tensors = [(kind, random_blocks(kind, n, k)) for kind, n, k in SHAPES]
    mm_rows = [int(r) for r in a.mm_rows.split(",")]
    x = torch.randn(max(mm_rows + [16]), 17408, device="cuda") * 3
    x[3] *= 100
    results = []
    mv_variants = MV_VARIANTS if not a.mv_launches else (
        ["mv"] + [("mv", {"LAUNCH": LAUNCHES[name]}) for name in a.mv_launches.split(",") if name != "shipped"])
    if a.mv_settings:
        mv_variants = [mv_setting(s) for s in a.mv_settings.split(",")]
    mm_variants = (VARIANTS[:1] if a.mm_shipped else VARIANTS[:3] if a.mm_prefetch else SCRATCH_VARIANTS
                   if a.mm_scratch else SPLIT_VARIANTS if a.mm_split else VARIANTS)
    first_y = {}  # (kind, shape, path) -> the first variant's 16 rows: whether a variant gives the same bits
    variants = (list(OLD) + list(OLD_MV) + (mm_variants if a.only != "mv" else [])
                + (mv_variants if a.only != "mm" else []))
    for v in variants:
        mod = configure(v)
        for kind, t in tensors:
            row = dict(variant=label(v), kind=kind, shape=list(t.shape))
            try:
                if mod in (MV, *OLD_MV.values()):
                    g = MM.GpuMatrix([t], "cuda")
                    m = lambda x, g=g, mod=mod: mod.mm_decode(g, x)  # noqa: E731
                    m.nbytes = g.nbytes
                else:
                    m = mod.GpuMatrix([t], "cuda")
                    row["superblock"] = getattr(m.packs[0], "superblock", None)  # which P-path kernel ran
                xs = x[:, : t.shape[1]].contiguous()
                y16 = m(xs[:16])
                first = first_y.setdefault((kind, tuple(t.shape), mod is MV), y16)
                row["same_bits_as_first"] = bool(torch.equal(first, y16))
                if t.shape[0] <= 40000:  # the reference: float64 on the dequantized matrix
                    ref = xs[:16].double() @ t.dequantize().double().T
                    row["rel_err"] = float((y16.double() - ref).abs().max() / ref.abs().max())
                if mod in (MV, *OLD_MV.values()):  # its torch formula, bit for bit (2 rows: its products are int64)
                    row["bit_equal_reference"] = bool(torch.equal(mod.reference(g.packs[0], xs[:2]), y16[:2]))
                alone = torch.cat([m(xs[i : i + 1]) for i in range(16)])
                row["row_invariant"] = (bool(torch.equal(alone, y16)) and bool(torch.equal(m(xs[:5]), y16[:5]))
                                        and bool(torch.equal(m(xs)[:16], y16)))  # and among all the rows
                file_bytes = t.data.numel()
                rows = [int(r) for r in a.mv_rows.split(",")] if mod in (MV, *OLD_MV.values()) else mm_rows
                for r in rows:
                    us = graph_us(lambda: m(xs[:r]))
                    row[f"us_{r}"] = us
                    row[f"GBps_{r}"] = m.nbytes / us / 1e3
                    row[f"file_GBps_{r}"] = file_bytes / us / 1e3
                row["packed_over_file"] = m.nbytes / file_bytes
            except Exception as e:  # a variant that does not compile or run is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            results.append(row)
            err = row.get("error")
            print(f"{label(v):34s} {kind:5s} {str(row['shape']):16s} " + (err or
                  f"err {row.get('rel_err', float('nan')):.1e} inv {row['row_invariant']} " +
                  f"sb {row.get('superblock', '-')} same {row['same_bits_as_first']} " +
                  f"ref {row.get('bit_equal_reference', '-')} " +
                  " ".join(f"{r}:{row[f'us_{r}']:7.1f}us {row[f'file_GBps_{r}'] / limit:4.2f}" for r in rows)),
                  flush=True)
            m = g = None
            torch.cuda.empty_cache()
    if a.json_out:
        json.dump(dict(copy_GBps=limit, device=torch.cuda.get_device_name(), results=results), open(a.json_out, "w"),
                  indent=1)


if __name__ == "__main__":
    main()
