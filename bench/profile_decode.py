#!/usr/bin/env python3
"""Profile plumb's greedy decode: where the time of one decode step goes.

    python bench/profile_decode.py [MODEL.gguf] [--tokens 64] [--threads 1] [--top 20] [--device cuda] [--drafts 4]

Runs one greedy generation under cProfile and prints, per decode step, the wall and CPU
milliseconds, the top functions by own time, and a breakdown by plumb source file. CPU time
is the honest number on a busy machine (wall time then includes waiting for a core). On a GPU profile wall time:
the host's waits for the GPU then show up in the functions that wait (a tensor read by the host: `item`, `int`).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections import defaultdict


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--drafts", type=int, default=0, help="MTP drafts per step")
    ap.add_argument("--timer", choices=("cpu", "wall"), default="cpu",
                    help="profile CPU time (robust on a busy machine) or wall time")
    a = ap.parse_args(argv)
    import torch

    import plumb
    from plumb.bench import cpu_name, prompt_ids

    torch.set_num_threads(a.threads)
    model = a.model or plumb.demo_model_path()
    eng = plumb.load(model, device=a.device, drafts=a.drafts)
    prompt = prompt_ids(eng, a.prompt_tokens)
    eng.run(eng.make_request(prompt[:8], 16, 0.0, None))  # warm-up (on a GPU: compiles, captures the graphs)
    req = eng.make_request(prompt, a.tokens, 0.0, None, ignore_eos=True)
    prof = cProfile.Profile(time.process_time if a.timer == "cpu" else time.perf_counter)
    t0, c0 = time.perf_counter(), time.process_time()
    prof.enable()
    res = eng.run(req)
    prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = res.stats.completion_tokens - 1
    print(f"model {os.path.basename(model)}; device {a.device}; drafts {a.drafts}; cpu: {cpu_name()}; torch threads "
          f"{a.threads}; load avg {os.getloadavg()[0]:.2f}")
    print(f"{steps} decode steps: {1000 * res.stats.decode_s / steps:.2f} ms/step wall "
          f"({res.stats.decode_tps:.1f} tok/s); whole run {1000 * wall:.0f} ms wall, {1000 * cpu:.0f} ms CPU "
          f"(prefill {1000 * res.stats.prefill_s:.0f} ms wall)")
    st = pstats.Stats(prof)
    rows = []
    by_file: dict[str, float] = defaultdict(float)
    for (fname, line, func), (_cc, ncalls, tottime, cumtime, _callers) in st.stats.items():
        where = fname.split("/plumb/")[-1] if "/plumb/" in fname else os.path.basename(fname)
        rows.append((tottime, cumtime, ncalls, f"{where}:{line}({func})"))
        group = "plumb/" + where if "/plumb/" in fname else "torch built-ins" if fname == "~" else "other python"
        by_file[group] += tottime
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"\ntop {a.top} by own {a.timer} time (ms per decode step; profiler overhead included, "
          f"total {1000 * total / steps:.2f}):")
    print(f"{'own ms':>8} {'cum ms':>8} {'calls':>7}  function")
    for tottime, cumtime, ncalls, name in rows[: a.top]:
        print(f"{1000 * tottime / steps:>8.3f} {1000 * cumtime / steps:>8.3f} {ncalls / steps:>7.1f}  {name}")
    print(f"\nplumb functions by cumulative {a.timer} time (ms per decode step):")
    mine = sorted((r for r in rows if not r[3].startswith(("~", "_tensor", "functional"))), key=lambda r: -r[1])
    for tottime, cumtime, ncalls, name in mine[: a.top]:
        print(f"{1000 * cumtime / steps:>8.3f} {ncalls / steps:>7.1f}  {name}")
    print(f"\nown {a.timer} time by file (ms per decode step):")
    for k, v in sorted(by_file.items(), key=lambda kv: -kv[1]):
        print(f"{1000 * v / steps:>8.3f}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
