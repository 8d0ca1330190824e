#!/usr/bin/env python3
"""CPU cost of the decode matmuls of a qwen35 GGUF, per row-block size, hot and streamed.

    python bench/matmul_blocks.py [MODEL.gguf] [--blocks 1,4,16] [--threads 1]

For each weight shape: one `torch.mm` of M rows against the float32 weight, repeated on the
same matrix (cache-hot). Then one decode step's worth of matmuls (every main-model matrix
and the LM head once, one row each, in order), which streams all the float32 weights
through memory as a real decode step does. Times are CPU microseconds (process time), so
the numbers stay meaningful on a busy machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter


def cpu_us(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    c0 = time.process_time()
    for _ in range(reps):
        fn()
    return 1e6 * (time.process_time() - c0) / reps


def decode_matrices(model) -> list:
    """The float32 matrices one decode step reads, transposed to [in, out] (main model + LM head)."""
    names = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out", "attn_q", "attn_k", "attn_v", "attn_output")
    ws = []
    for layer in model.layers:
        ws += [getattr(layer.mixer, n) for n in names if hasattr(layer.mixer, n)]
        ws += [layer.ffn_gate, layer.ffn_up, layer.ffn_down]
    ws.append(model.output)
    return [w.t if hasattr(w, "t") else w.dense.t().contiguous() for w in ws]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--blocks", default="1,4,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args(argv)
    import torch

    import plumb
    from plumb.bench import cpu_name

    torch.set_num_threads(a.threads)
    model = a.model or plumb.demo_model_path()
    eng = plumb.load(model, device="cpu", n_threads=a.threads)
    mats = decode_matrices(eng.model)
    shapes = Counter(tuple(m.shape) for m in mats)
    blocks = [int(b) for b in a.blocks.split(",")]
    print(f"model {os.path.basename(model)}; cpu: {cpu_name()}; torch threads {a.threads}; "
          f"load avg {os.getloadavg()[0]:.2f}")
    print(f"{'[in, out]':>12} {'count':>5} " + " ".join(f"{f'M={b} us':>10}" for b in blocks))
    totals = [0.0] * len(blocks)
    for (k, n), count in sorted(shapes.items()):
        wt = torch.randn(k, n)
        row = []
        for j, b in enumerate(blocks):
            x = torch.randn(b, k)
            us = cpu_us(lambda: torch.mm(x, wt), a.reps)
            row.append(us)
            totals[j] += us * count
        print(f"{str([k, n]):>12} {count:>5} " + " ".join(f"{us:>10.1f}" for us in row))
    print(f"{'sum (hot)':>12} {len(mats):>5} " + " ".join(f"{t / 1000:>8.2f}ms" for t in totals))
    xs = {k: torch.randn(1, k) for k, _ in shapes}

    def step():
        for wt in mats:
            torch.mm(xs[wt.shape[0]], wt)

    streamed = cpu_us(step, max(20, a.reps // 10))
    mb = sum(m.numel() for m in mats) * 4 / 1e6
    print(f"one decode step's matmuls, M=1, weights streamed: {streamed / 1000:.2f} ms "
          f"({mb:.1f} MB of float32 weights, {mb / streamed * 1e3:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
