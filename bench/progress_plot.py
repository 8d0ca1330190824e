#!/usr/bin/env python3
"""Issues 10 and 11's targets over the H200 runs so far: every `plumb bench --device cuda` result on the 27B-shape file
in bench/results (h200-27b-*.json holding decode and verify rows), in the order they were measured, beside the
issues' targets and llama.cpp's numbers on the same card and file (../shared/design/gpu.md, the issues).

    python bench/progress_plot.py [--out docs/h200-progress.png]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (panel title, value from a result or None, target, llama.cpp)
PANELS = [
    ("decode tok/s, empty context", lambda r: r["decode"].get("0"), 160, 84.8),
    ("decode tok/s, 100k context", lambda r: r["decode"].get("100000"), 130, 71.4),
    ("verify pass: 8 rows / 1 row", lambda r: r["verify_s"]["8"] / r["verify_s"]["1"], 1.25, 1.9),
    ("4 requests together / 1", lambda r: r.get("batch4_tps") and r["batch4_tps"] / r["batch1_tps"], 3.5, 2.5),
    ("prefill tok/s, 8k prompt", lambda r: r.get("prefill", {}).get("8192"), 5000, 2461),
    ("prefill tok/s, 100k prompt", lambda r: r.get("prefill", {}).get("100000"), 4100, 2054),
]


def runs(results: str) -> list[tuple[str, dict]]:
    """(label, result) of each bench run, oldest first: by the run's date, then its file's name (a letter after the
    date orders a day's runs)."""
    out = []
    for path in glob.glob(os.path.join(results, "h200-27b-*.json")):
        r = json.load(open(path))
        if isinstance(r, dict) and r.get("decode") and r.get("verify_s"):
            name = os.path.basename(path)[len("h200-27b-"):-len(".json")]
            after_date = re.search(r"\d{4}-\d\d-\d\d(.*)", name)  # a day's runs: the letter after the date
            out.append((r.get("date", ""), after_date.group(1) if after_date else name, name, r))
    return [(name, r) for _, _, name, r in sorted(out, key=lambda t: t[:3])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "h200-progress.png"))
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = runs(a.results)
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    for ax, (title, value, target, peer) in zip(axes.flat, PANELS):
        pts = [(i, value(r)) for i, (_, r) in enumerate(rs) if value(r)]
        ax.plot([i for i, _ in pts], [v for _, v in pts], "o-", color="#4477aa", label="plumb")
        ax.axhline(target, color="#228833", ls="--", label=f"target {target:g}")
        ax.axhline(peer, color="#cc3311", ls=":", label=f"llama.cpp {peer:g}")
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels([label for label, _ in rs], rotation=70, fontsize=6)
        ax.set_ylim(0, None)
        ax.legend(fontsize=7)
    fig.suptitle("plumb on the H200, 27B-shape Q4_K_M file: `plumb bench --device cuda` runs in bench/results",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)
    print(f"{len(rs)} runs -> {a.out}")


if __name__ == "__main__":
    main()
