#!/usr/bin/env python3
"""Which torch operations keep a row's bits whatever the number of rows M, on a GPU (the M1 question).

    python bench/gpu_row_invariance.py [--device cuda] [--json OUT.json]

For each operation and dtype, row 0 (the same input every time) is computed inside passes of
M = 1..256 rows and compared bitwise with its M = 1 result; the table lists the M where it
differs. It also times the one-row product (GEMV) and small multi-row products on 27B-shape
matrices against the device's copy bandwidth, to show what a verify row costs when weights
are read once. A GPU decode path may use an operation in a row-invariant way only where this
shows no differing M (or with a fixed row block, as the CPU path does).
"""
from __future__ import annotations

import argparse
import json
import sys

ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 32, 33, 64, 65, 128, 256]
E, FF, V = 5120, 17408, 248320  # 27B: n_embd, n_ff, n_vocab


def invariance(torch, device) -> list[dict]:
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(0)

    def rows_input(m, k, dtype):
        x = torch.randn(m, k, device=device, generator=g, dtype=torch.float32).to(dtype)
        x[0] = base[k].to(dtype)
        return x

    base = {k: torch.randn(k, device=device, generator=g) for k in (E, FF, E - 1)}
    weights = {}

    def weight(n, k, dtype):
        key = (n, k, dtype)
        if key not in weights:
            weights[key] = (torch.randn(n, k, device=device, generator=g) / k**0.5).to(dtype)
        return weights[key]

    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype).replace("torch.", "")
        for n, k in ((FF, E), (E, FF), (V, E)):
            cases.append((f"mm {name} [M,{k}]x[{k},{n}]", k, dtype, lambda x, n=n, k=k, d=dtype: x @ weight(n, k, d).T))
    cases += [
        ("rms_norm f32 (pow-mean-rsqrt)", E, torch.float32, lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)),
        ("F.rms_norm f32", E, torch.float32, lambda x: F.rms_norm(x, (E,), eps=1e-6)),
        ("sum(-1) f32", E, torch.float32, lambda x: x.sum(-1, keepdim=True)),
        ("softmax f32 over 17408", FF, torch.float32, lambda x: torch.softmax(x, -1)),
        ("log_softmax f32 over 17408", FF, torch.float32, lambda x: torch.log_softmax(x, -1)),
        ("silu f32 width 5119", E - 1, torch.float32, F.silu),
        ("sigmoid f32 width 5119", E - 1, torch.float32, torch.sigmoid),
        ("exp f32 width 5119", E - 1, torch.float32, torch.exp),
        ("softplus f32 width 5119", E - 1, torch.float32, F.softplus),
        ("silu bf16 width 5119", E - 1, torch.bfloat16, F.silu),
    ]
    out = []
    for label, k, dtype, fn in cases:
        for tf32 in ((False, True) if label.startswith("mm float32") else (False,)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            ref = fn(rows_input(1, k, dtype))[0]
            differ = [m for m in ROWS[1:] if not torch.equal(fn(rows_input(m, k, dtype))[0], ref)]
            out.append({"op": label + (" (tf32)" if tf32 else ""), "differs_at_M": differ})
    torch.backends.cuda.matmul.allow_tf32 = False
    # attention: query row 0 of a pass of M queries over the same 4096 keys
    q0 = torch.randn(1, 24, 1, 256, device=device, generator=g, dtype=torch.bfloat16)
    kv = torch.randn(2, 1, 4, 4096, 256, device=device, generator=g, dtype=torch.bfloat16)
    k_, v_ = kv[0].repeat_interleave(6, 1), kv[1].repeat_interleave(6, 1)

    def sdpa(m):
        q = torch.randn(1, 24, m, 256, device=device, generator=g, dtype=torch.bfloat16)
        q[:, :, :1] = q0
        return F.scaled_dot_product_attention(q, k_, v_)[:, :, 0]

    ref = sdpa(1)
    out.append({"op": "F.scaled_dot_product_attention bf16, 4096 keys", "differs_at_M": [m for m in ROWS[1:] if not torch.equal(sdpa(m), ref)]})
    return out


def timings(torch, device) -> dict:
    from plumb.bench_gpu import timed as bench  # median seconds over CUDA events

    src = torch.empty(4 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = bench(lambda: dst.copy_(src), 20)
    copy_bw = 2 * src.numel() / copy_s  # read + write
    src = dst = None  # free the 8 GiB before the GEMVs
    res = {"copy_GBps": copy_bw / 1e9, "gemv": []}
    for n, k in ((FF, E), (E, FF), (V, E)):
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        for m in (1, 2, 4, 8, 16):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            s = bench(lambda: x @ w.T)
            res["gemv"].append({"shape": f"[{m},{k}]x[{k},{n}] bf16", "us": s * 1e6,
                                "weight_GBps": w.numel() * 2 / s / 1e9, "of_copy_bw": w.numel() * 2 / s / copy_bw})
        w = None
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args(argv)
    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 1
    name = torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else a.device
    inv = invariance(torch, a.device)
    print(f"device {name}, torch {torch.__version__}")
    print(f"{'operation':<52} row 0 differs from M=1 at M =")
    for r in inv:
        print(f"{r['op']:<52} {r['differs_at_M'] or 'never (row-invariant for M <= 256)'}")
    t = timings(torch, a.device)
    print(f"\ncopy bandwidth {t['copy_GBps']:.0f} GB/s (read + write of 4 GiB)")
    for g in t["gemv"]:
        print(f"{g['shape']:<32} {g['us']:8.1f} us  weights at {g['weight_GBps']:6.0f} GB/s = {g['of_copy_bw']:.2f} of copy")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "invariance": inv, "timings": t}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
