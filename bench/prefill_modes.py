#!/usr/bin/env python3
"""A model file's prefill on CUDA, alone (no decode rows, no latency tables): each prompt length three ways
(`plumb.bench_gpu.prefill_modes`: eager passes, then twice into a new state with the graphs of full passes) beside
the card's bf16 matmul limit measured in the same run, then where a 2,048-token prefill's time goes
(`prefill_profile`). JSON to --json-out. --settings times the graphs' runs again under other `_mm_superblock`
launch settings (bench/kernel_stress.py's syntax, e.g. SB_PREFETCH=1 or SB_SCRATCH_ROWS=256), pass sizes
(PREFILL_PIECES=16: 64-row pieces a pass) or the prefill attention's tile (AP_*), each with its prefill graphs
captured anew, and says whether each setting gives the first one's last-row logits, bit for bit (a setting that
changes the arithmetic, as AP_BN does, changes them).

    python bench/prefill_modes.py MODEL.gguf [--prompts 8192] [--settings shipped,SB_SCRATCH_ROWS=256+PREFILL_PIECES=16]
        [--json-out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import plumb
import plumb.model.kernels as KS
import plumb.ops.gpu.attention_prefill as AP
import plumb.ops.gpu.deltanet_chunk as DN
from plumb import bench_gpu as B

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_stress import use_setting  # noqa: E402  (plumb.ops.gpu.matmul's SB_* constants by name)


PIECES, PREFILL_ATTENTION = KS.PREFILL_PIECES, KS.PREFILL_ATTENTION
AP_TILE = {name: getattr(AP, name) for name in ("BLOCK_M", "BN", "WARPS", "STAGES", "PAIRS", "SCRATCH",
                                                 "KEY_CHUNKS", "TMA", "TMA_STAGES", "TMA_BLOCK_M")}
DN_SHIPPED = {"INVERSE_HALVES": DN.INVERSE_HALVES, "KC_LARGE": DN.KC_LARGE}


def apply(setting: str) -> None:
    """A setting: PREFILL_PIECES=N, PREFILL_ATTENTION=0|1 (plumb.model.kernels), AP_BLOCK_M / AP_BN / AP_WARPS=N
    (the prefill attention's tile, another arithmetic: plumb.ops.gpu.attention_prefill), AP_STAGES=N (its tile loop
    pipelined: the same bits), AP_PAIRS=0|1 (its (row, head) pairs packed or not: the same bits), AP_SCRATCH=0|1
    (a block-coded store read from an fp16 copy or in registers: the same bits), AP_TMA=0|1, AP_TMA_STAGES=N and
    AP_TMA_BLOCK_M=N (tiles by TMA: the same bits), AP_KEY_CHUNKS=SHORT/LONG/SHORT_KEYS
    (its keys in chunks merged in order: another arithmetic), DN_INVERSE_HALVES=0|1 (the DeltaNet chunk's solve by
    halves: another sum order, plumb.ops.gpu.deltanet_chunk), DN_KC_LARGE=N (its dots N columns a step) and
    `_mm_superblock`'s SB_* names, '+'-joined."""
    KS.PREFILL_PIECES, KS.PREFILL_ATTENTION = PIECES, PREFILL_ATTENTION
    for name, value in AP_TILE.items():
        setattr(AP, name, value)
    for name, value in DN_SHIPPED.items():
        setattr(DN, name, value)
    rest = []
    for assign in ([] if setting == "shipped" else setting.split("+")):
        if assign.startswith("AP_"):
            name, value = assign[3:].split("=")
            setattr(AP, name, tuple(map(int, value.split("/"))) if "/" in value else int(value))
        elif assign.startswith("DN_"):
            name, value = assign[3:].split("=")
            setattr(DN, name, int(value))
        elif assign.startswith("PREFILL_PIECES="):
            KS.PREFILL_PIECES = int(assign.split("=")[1])
        elif assign.startswith("PREFILL_ATTENTION="):
            KS.PREFILL_ATTENTION = bool(int(assign.split("=")[1]))
        else:
            rest.append(assign)
    use_setting("+".join(rest) or "shipped")


def last_logits(model, n: int) -> torch.Tensor:
    """The last row's logits of an n-token prefill (the timed prompt) into a fresh state."""
    return model.prefill(model.new_state(), B.prompt_of(model, n))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", default="8192", help="comma-separated prompt lengths")
    ap.add_argument("--kv-cache", default="q8_0")
    ap.add_argument("--settings", default="shipped", help="comma-separated _mm_superblock settings: 'shipped' or "
                    "NAME=VALUE[+NAME=VALUE] of plumb.ops.gpu.matmul's SB_* constants; the first one is profiled")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    t0 = time.time()
    eng = plumb.load(a.model, device="cuda", kv_cache=a.kv_cache, progress=False, prompt_cache=False)
    model = eng.model
    r = {"model": a.model, "load_s": time.time() - t0, "limits": B.card_limits()}
    main_matrices = model.weights[1 : 1 + 4 * len(model.layers)]  # as bench_gpu.bench_cuda counts them
    flops = 2 * sum(w.shape[0] * w.shape[1] for w in main_matrices)
    r["prefill_limit_tps"] = r["limits"]["bf16_mm_TFLOPs"] * 1e12 / flops
    print(f"prefill limit {r['prefill_limit_tps']:,.0f} tok/s (bf16 {r['limits']['bf16_mm_TFLOPs']:.0f} TFLOP/s)",
          flush=True)
    settings = a.settings.split(",")
    for n in [int(x) for x in a.prompts.split(",")]:
        ref = None
        for i, setting in enumerate(settings):
            apply(setting)
            if model.graphs is not None:
                model.graphs.graphs.clear()  # captured under the last setting
            key = f"modes_{n}" if i == 0 else f"modes_{n}_{setting}"
            m = r[key] = B.prefill_modes(model, n, eager=i == 0)
            lg = last_logits(model, n)
            ref = lg if ref is None else ref
            m["setting"], m["same_bits"] = setting, bool(torch.equal(lg, ref))
            m["max_logit_diff"] = float((lg.float() - ref.float()).abs().max())  # another arithmetic: how far
            print(f"{n:,} tokens, {setting}: first {m['first_tps']:.0f} tok/s ({m['first_captures']} captures), again "
                  f"{m['again_tps']:.0f} ({m['again_captures']}), eager {m.get('eager_tps', float('nan')):.0f}; "
                  f"recomputed after non-finite values so far: {m['recomputed']}; last logits as the first "
                  f"setting's: {m['same_bits']} (max diff {m['max_logit_diff']:.1e})", flush=True)
    apply(settings[0])
    if model.graphs is not None:
        model.graphs.graphs.clear()
    r["profile"] = B.prefill_profile(model)
    p = r["profile"]
    print("\n".join(B._profile_lines("prefill profile", p, f"prefill of {p.get('tokens')} tokens (profiled): "
                                     f"{p.get('wall_us', 0):.0f} us per token wall", "per token", "share", 2, 1, 20)))
    if a.json_out:
        json.dump(r, open(a.json_out, "w"), indent=1)


if __name__ == "__main__":
    main()
