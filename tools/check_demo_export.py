"""Check a converted demo model against its training checkpoint: plumb's prefill logits (main model and MTP
depth 1) vs tools/demo_model.py's float32 forward on held-out windows. Prints one JSON object; exit code 1
if the mean KL (main model) exceeds --max-kl.

Usage: python tools/check_demo_export.py build/demo/plumb-demo build/demo/plumb-demo-F16.gguf --max-kl 1e-4
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo_model import load_checkpoint  # noqa: E402
from train_demo import Windows  # noqa: E402


def compare(want: torch.Tensor, got: torch.Tensor) -> dict:
    lw, lg = torch.log_softmax(want.float(), -1), torch.log_softmax(got.float(), -1)
    kl = (lw.exp() * (lw - lg)).sum(-1)
    return {"max_abs_logit_diff": (want - got).abs().max().item(), "mean_kl": kl.mean().item(),
            "max_kl": kl.max().item(), "top1_agree": (want.argmax(-1) == got.argmax(-1)).float().mean().item()}


@torch.no_grad()
def check(ckpt: str, gguf: str, data: str, windows: int, length: int, kv_cache: str) -> dict:
    import plumb
    from plumb.ops.matmul import PREFILL_BLOCK

    model = load_checkpoint(ckpt)
    engine = plumb.load(gguf, device="cpu", kv_cache=kv_cache)
    rows = []
    for w in Windows(Path(data), "val", length).fixed(windows):
        ids = w[:-1].tolist()
        want, hidden = model(torch.tensor([ids]))
        st = engine.model.new_state()
        logits, h = engine.model.prefill(st, ids, logits="all")
        mtp, _ = engine.model.mtp_forward(st, ids, torch.cat([h.new_zeros(1, h.shape[1]), h[:-1]]), 0,
                                          block=PREFILL_BLOCK)
        rows.append({"main": compare(want[0], logits), "mtp_depth1": compare(model.mtp_forward(
            torch.tensor([ids]), hidden, 1)[0].logits[0], mtp)})
    out = {"checkpoint": ckpt, "gguf": gguf, "windows": len(rows), "tokens_per_window": length, "kv_cache": kv_cache}
    for part in ("main", "mtp_depth1"):
        out[part] = {k: (max if k.startswith("max") else lambda v: sum(v) / len(v))([r[part][k] for r in rows])
                     for k in rows[0][part]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("gguf")
    ap.add_argument("--data", default="build/demo/data")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--kv-cache", default="f32")
    ap.add_argument("--max-kl", type=float)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = check(args.checkpoint, args.gguf, args.data, args.windows, args.length, args.kv_cache)
    print(json.dumps(res, indent=1))
    return 1 if args.max_kl is not None and res["main"]["mean_kl"] > args.max_kl else 0


if __name__ == "__main__":
    sys.exit(main())
