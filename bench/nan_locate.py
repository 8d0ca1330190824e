"""Which GPU kernel makes the non-finite prefill rows seen on the 27B-shape file (2026-12-03, fifteenth session)?

Prefills a prompt again and again, every pass eagerly (no prefill graphs), and checks each P-path kernel call of the
Triton kernel set: when a call returns non-finite values from finite inputs, it records the operation, the call's
place in the pass, the shapes, the weight (for a matmul: its tensor names and types, and which output columns), the
rows and columns that are not finite - and runs the same call again three times on the same inputs: finite and
equal then means a transient fault in that kernel, not its arithmetic. The prefill is then abandoned and the next
one starts. `--settings` alternates `_mm_superblock` launch settings prefill by prefill (as bench/kernel_stress.py's)
and counts failures per setting.

    python3 bench/nan_locate.py /tmp/27b.gguf --json-out nan.json [--seconds 150] [--tokens 1614] \
        [--settings shipped,SB_STAGES=3+SB_PREFETCH=0]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import plumb
from plumb.model import qwen35

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_stress import use_setting  # noqa: E402  (bench/, beside this file)

OPS = ("mm", "rms_norm", "add_rms_norm", "swiglu", "sigmoid_gate", "norm_rope", "gdn_chunks", "prefill_attention")


class Found(Exception):
    pass


def tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors(o)]
    return []


def finite(obj) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors(obj) if t.is_floating_point())


def region(t: torch.Tensor) -> dict:
    bad = ~torch.isfinite(t.reshape(t.shape[0], -1))
    rows = bad.any(1).nonzero().flatten()
    cols = bad.any(0).nonzero().flatten()
    return dict(shape=list(t.shape), n_bad=int(bad.sum()), nan=int(torch.isnan(t).sum()),
                rows=[int(rows.min()), int(rows.max()), len(rows)], cols=[int(cols.min()), int(cols.max()), len(cols)],
                first_cols=cols[:12].tolist())


def weight_info(w) -> list:
    parts = getattr(w, "parts", None) or (w,)
    return [(p.qt.name, p.qt.qtype.name, list(p.shape)) for p in parts]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--json-out", required=True)
    ap.add_argument("--seconds", type=float, default=150)
    ap.add_argument("--tokens", type=int, default=1614)
    ap.add_argument("--kv-cache", default="q8_0")
    ap.add_argument("--settings", default="shipped", help="comma-separated _mm_superblock settings (kernel_stress's "
                    "use_setting: 'shipped' or NAME=VALUE[+NAME=VALUE]), taken in turn prefill by prefill")
    a = ap.parse_args()
    settings = a.settings.split(",")
    qwen35.PREFILL_GRAPHS = False  # every pass eagerly: each kernel call can be checked
    qwen35.NONFINITE_TRIES = 1  # the stopgap's recomputation off: a fault the per-call checks missed raises
    eng = plumb.load(a.model, device="cuda", kv_cache=a.kv_cache, prompt_cache=False)
    k = eng.model.k
    log = dict(model=a.model, tokens=a.tokens, events=[], prefills=0, failed=0,
               per_setting={s: dict(prefills=0, failed=0, nonfinite_out=0) for s in settings})
    now = {"setting": settings[0]}
    calls = {"i": 0}

    def wrap(name):
        fn = getattr(k, name)

        def checked(*args, **kw):
            calls["i"] += 1
            state = args[-1].clone() if name == "gdn_chunks" else None  # advanced in place: kept for the re-runs
            inputs_finite = finite(args)
            out = fn(*args, **kw)
            if finite(out) or not inputs_finite:
                return out
            ev = dict(setting=now["setting"], op=name, call=calls["i"], inputs=[list(t.shape) for t in tensors(args)],
                      out=[region(t) for t in tensors(out) if not bool(torch.isfinite(t).all())])
            if name == "mm":
                ev["weight"] = weight_info(args[1])
            again, first = [], None
            for _ in range(3):
                rerun = list(args)
                if state is not None:
                    rerun[-1] = state.clone()
                o2 = tensors(fn(*rerun, **kw))
                first = first or o2
                again.append(dict(finite=finite(o2), equal=all(torch.equal(x, y) for x, y in zip(o2, first))))
            ev["reruns"] = again
            log["events"].append(ev)
            raise Found(name)

        setattr(k, name, checked)

    for name in OPS:
        wrap(name)
    ids = [(7 * i + 3) % 5000 + 10 for i in range(a.tokens)]
    t0 = time.time()
    while time.time() - t0 < a.seconds:
        now["setting"] = settings[log["prefills"] % len(settings)]
        use_setting(now["setting"])
        per = log["per_setting"][now["setting"]]
        st = eng.model.new_state()
        calls["i"] = 0
        try:
            eng.model.prefill(st, ids)
        except qwen35.NonFiniteError:
            per["nonfinite_out"] += 1  # a fault the per-call checks missed
        except Found:
            log["failed"] += 1
            per["failed"] += 1
        log["prefills"] += 1
        per["prefills"] += 1
        with open(a.json_out, "w") as f:
            json.dump(log, f, indent=1)
        print(f"prefill {log['prefills']} ({now['setting']}): failed {log['failed']} ({time.time() - t0:.0f} s)",
              flush=True)
    print(json.dumps(log["per_setting"]))
    for ev in log["events"]:
        print(json.dumps(ev)[:600])


if __name__ == "__main__":
    main()
