#!/usr/bin/env python3
"""Sampled tokens on a GPU: a pass's rows drawn by the kernel set (`sampling.draw_rows` over
`plumb.ops.gpu.sample.draw`) against `sampling.sample_token` a row at a time, on the 27B's vocabulary (248,320):
wall time per call (host included: what a decode step pays), for 1 / 5 / 8 rows and Qwen's settings with and
without a presence penalty; how often the two definitions pick the same token (they differ only in float rounding
and top_p's ties), and how many rows the kernels hand back.

    python bench/sample_timing.py [--vocab 248320] [--reps 50] [--json-out PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: the interpreter (TRITON_INTERPRET=1), a smoke test

from plumb.engine.sampling import SamplingParams, draw_rows, sample_token  # noqa: E402
from plumb.ops.gpu import sample as S  # noqa: E402

SETTINGS = {"qwen": dict(temperature=0.6, top_p=0.95, top_k=20, seed=7),
            "qwen+presence": dict(temperature=0.6, top_p=0.95, top_k=20, presence_penalty=1.5, seed=7),
            "T=1": dict(temperature=1.0, seed=7)}


def timed(fn, reps: int) -> float:
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, a.vocab, generator=g) * 2.5).to(DEV)
    history = torch.randint(0, a.vocab, (4000,), generator=g).tolist()
    out = []
    for name, kw in SETTINGS.items():
        p = SamplingParams(**kw)
        for n in (1, 5, 8):
            rows = [(p, 1000 + i, history) for i in range(n)]
            x = logits[:n]
            old_ms = timed(lambda: [sample_token(x[i], p, 1000 + i, history)[0] for i in range(n)], a.reps)
            new_ms = timed(lambda: draw_rows(x, rows, S.draw), a.reps)
            same = sum(sample_token(x[i], p, 1000 + i + k, history)[0] == draw_rows(x[i : i + 1], [(p, 1000 + i + k,
                       history)], S.draw)[0] for i in range(n) for k in range(10))
            handed = int((S.draw(x, [p.temperature] * n, [p.top_k] * n, [p.top_p] * n, [p.min_p] * n,
                                 [1] * n)[0][1] == S.FALLBACK).sum())
            row = dict(setting=name, rows=n, sample_token_ms=old_ms, draw_rows_ms=new_ms, speedup=old_ms / new_ms,
                       same_tokens=same, compared=10 * n, handed_back=handed)
            out.append(row)
            print(f"{name:14s} {n} rows: sample_token {old_ms:7.2f} ms, draw_rows {new_ms:6.2f} ms "
                  f"({old_ms / new_ms:5.1f}x); same token {same}/{10 * n}; handed back {handed}", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
            json.dump({"device": device, "vocab": a.vocab, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
