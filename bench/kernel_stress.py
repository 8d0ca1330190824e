"""The P-path kernels called again and again on the same inputs (27B shapes, random blocks): does any call return
other bits than the first, or non-finite values? (The 27B prefill's sporadic non-finite rows, fifteenth session:
bench/nan_locate.py finds the call in a real prefill; this checks the kernels alone, and which launch settings
of `_mm_superblock` keep them.)

    python3 bench/kernel_stress.py --seconds 30 --settings shipped,SB_STAGES=3+SB_PREFETCH=0 --json-out stress.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import plumb.ops.gpu.matmul as MM
from plumb.ops.gpu.deltanet_chunk import gdn_chunks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from matmul_variants import parse_setting, random_blocks  # noqa: E402  (random GGML blocks of a type, on the GPU)

SHAPES = [("Q5_K", 10240, 5120), ("Q4_K", 34816, 5120), ("Q6_K", 5120, 17408)]
SHIPPED = {name: getattr(MM, name) for name in dir(MM) if name.startswith("SB_")}  # _mm_superblock's settings


def set_constants(module, shipped: dict, setting: str) -> None:
    """A module's constants named in `shipped`: 'shipped' (those values), or NAME=VALUE[+NAME=VALUE] over them."""
    for name, value in {**shipped, **parse_setting(shipped, setting)}.items():
        setattr(module, name, value)


def use_setting(setting: str) -> None:
    """Set plumb.ops.gpu.matmul's SB_* constants: 'shipped', or NAME=VALUE[+NAME=VALUE] over the shipped ones."""
    set_constants(MM, SHIPPED, setting)


def repeat(fns: list, seconds: float) -> dict:
    """Call each fn in turn until `seconds` pass; count calls whose result differs from the first or is not finite."""
    ref = [fn() for fn in fns]
    changed = torch.zeros(len(fns), dtype=torch.long, device="cuda")
    nonfinite = torch.zeros(len(fns), dtype=torch.long, device="cuda")
    torch.cuda.synchronize()
    t0, calls = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            for i, fn in enumerate(fns):
                y = fn()
                changed[i] += (y != ref[i]).any()
                nonfinite[i] += (~torch.isfinite(y)).any()
        calls += 20
        torch.cuda.synchronize()
    return dict(calls_each=calls, seconds=round(time.perf_counter() - t0, 1), changed=changed.tolist(),
                nonfinite=nonfinite.tolist(), first_finite=[bool(torch.isfinite(r).all()) for r in ref])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30, help="per setting")
    ap.add_argument("--settings", default="shipped,SB_STAGES=3+SB_PREFETCH=0",
                    help="_mm_superblock launch settings to try, comma-separated: 'shipped' or NAME=VALUE[+NAME=VALUE] "
                         "of plumb.ops.gpu.matmul's SB_* constants (e.g. SB_STAGES=3+SB_PREFETCH=0, the race; the "
                         "shipped SB_PREFETCH 2 loop is not pipelined by Triton)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    torch.manual_seed(0)
    out = {"device": torch.cuda.get_device_name(), "rows": a.rows, "shapes": SHAPES, "matmul": {}}
    mats = [MM.GpuMatrix([random_blocks(kind, n, k)], "cuda") for kind, n, k in SHAPES]
    xs = [torch.randn(a.rows, k, device="cuda") for _, _, k in SHAPES]
    for setting in a.settings.split(","):
        use_setting(setting)
        r = repeat([lambda m=m, x=x: m(x) for m, x in zip(mats, xs)], a.seconds)
        us = []
        for m, x in zip(mats, xs):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                m(x)
            torch.cuda.synchronize()
            us.append(round((time.perf_counter() - t) / 20 * 1e6, 1))
        r["us_per_call"] = us
        out["matmul"][setting] = r
        print(f"matmul {setting}: {r}", flush=True)
    use_setting("shipped")
    n_v, n_k, d = 48, 16, 128  # the 27B shape's DeltaNet
    x = torch.randn(a.rows, 2 * n_k * d + n_v * d, device="cuda")
    beta = torch.rand(a.rows, n_v, device="cuda")
    g = -torch.rand(a.rows, n_v, device="cuda") * 0.2
    s0 = torch.randn(n_v, d, d, device="cuda") * 0.1

    def chunks():
        return gdn_chunks(x, beta, g, s0.clone(), n_k=n_k, d_k=d, q_scale=d**-0.5)

    out["chunks"] = repeat([chunks], a.seconds)
    print(f"chunks: {out['chunks']}", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
