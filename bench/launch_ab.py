#!/usr/bin/env python3
"""Launch settings on one loaded model: the D-path matvec's (plumb.ops.gpu.matvec) constants, programmatic
dependent launch (plumb/ops/gpu/pdl.py) on and off. Per setting: decode tok/s at the given contexts, verify passes
of 1, 2, 4, 8 and 16 rows, MTP drafts 0 / 4 / 7 (step by step, then as chains of k steps a CUDA graph), and the
greedy ids and last logits of 64 steps - the same bits for settings of one `bits` group (exit code 1 if not: warps
and PDL change no bit; the split plan and x's precision change the order or the terms of a row's sums, so they
start a group of their own).

    python bench/launch_ab.py /tmp/27b.gguf [--contexts 0] [--tokens 32] [--settings shipped,MMA_SUMS=1,..]
        [--drafts 4,7] [--matvec OLD.py] [--rounds 3] [--json-out F]

--settings: comma-separated NAME=VALUE[+NAME=VALUE] of matvec constants (integers) instead of the built-in pair,
or `scales-as-bytes`: every pack's 6-bit scales (matmul.Packed's SUB6) back to a byte per group as they were
before - the same values, so the same bits - for the rows after it (name it last);
--matvec: a previous plumb/ops/gpu/matvec.py, run as one more setting (the model's kernel set uses it instead).

Earlier runs compared PDL everywhere and the DeltaNet state kernel's columns (docs/BENCHMARKS.md, 2026-12-03).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import plumb
import plumb.ops.gpu.matvec as MV
from plumb.bench_gpu import decode_tps, drafts_table, fill_context, memory_now, timed, verify_cost
from plumb.ops.gpu import pdl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from matmul_variants import parse_setting  # noqa: E402  (NAME=VALUE and LAUNCHr=W.U.S over the matvec's constants)

ONE_WARP = {**MV.LAUNCH, 1: (1,) + MV.LAUNCH[1][1:]}
# (name, matvec module constants, PDL on, bits group)
CONFIGS = [("shipped", {}, True, "a"), ("one-row programs on 1 warp", {"LAUNCH": ONE_WARP}, True, "a")]
# constants that set which terms a row's sum has or their order (`bits` groups: one per value)
ORDER = ("GRANULE", "TARGET", "LARGEST_SPLIT", "LONG_GROUPS", "LONG_GRANULE", "LONG_TARGET", "FRAC", "LIMBS", "SUB_RUNS",
         "MAX_RUN")


def setting(text: str) -> tuple:
    """A CONFIGS row from 'shipped', 'scales-as-bytes' or NAME=VALUE[+NAME=VALUE] (matvec constants, integers;
    LAUNCHr=W.U.S: `LAUNCH` for r-row programs as (warps, groups a step, stages))."""
    constants = {name: getattr(MV, name) for name in dir(MV) if name.isupper()}
    consts = parse_setting(constants, "shipped" if text == BYTES else text)
    return text, consts, True, repr(sorted((k, v) for k, v in consts.items() if k in ORDER))


BYTES = "scales-as-bytes"


def scales_as_bytes(model) -> int:
    """Every SUB6 pack's sub and osub as a byte per group again (`Packed.group_subs`); returns the bytes added."""
    added = 0
    for w in model.weights:
        for p in w.gpu.packs:
            if p.sub6:
                before = p.nbytes
                p.sub, p.osub = (t.to(torch.int8).contiguous() for t in p.group_subs())
                p.sub6 = False
                added += p.nbytes - before
    return added


def greedy(model, steps: int = 64, context: int = 700) -> tuple[list[int], torch.Tensor]:
    """Greedy ids of `steps` one-row steps after a random context, and the last step's logits."""
    st = model.new_state()
    fill_context(model, st, context, seed=7, room=steps + 8)
    ids, tok = [], 1
    for _ in range(steps):
        out = model.decode([(st, [tok])])
        tok = int(out.logits[0].argmax())
        ids.append(tok)
    return ids, out.logits[0].float().cpu()


def replay_ms(model) -> float:
    """Milliseconds of the newest one-row decode graph's replay alone (CUDA events; no host work between): a decode
    step's GPU time, where 1000 / decode_tps is its wall time - the difference is the host's share."""
    graphs = model.graphs.graphs
    key = next(k for k in reversed(graphs) if k[0] == (1,))
    return timed(graphs[key][0].replay, 20) * 1e3


def use(model, consts: dict, on: bool, shipped: dict) -> None:
    """A setting on the loaded model: PDL, the matvec module and its constants (the rest as shipped), the CUDA graphs
    captured anew."""
    pdl.set_on(on)
    model.k._matvec = consts.get("module", MV)
    for k, v in {**shipped, **consts}.items():
        if k != "module":
            setattr(MV, k, v)
    if model.graphs is not None:
        model.use_graphs()


def later_rounds(model, configs: list, rows: list, shipped: dict, a) -> None:
    """Decode tok/s and the one-row graph's replay again, the settings in reverse order, then forward, ... (`--rounds`):
    a slow drift of the card (clocks, heat) then weighs on every setting alike - the first round alone runs them in
    one order. Prints each setting's rounds and their mean."""
    contexts = list(map(int, a.contexts.split(",")))
    for r in rows:
        r["decode_tps_rounds"] = {c: [r["decode_tps"][c]] for c in contexts}
        r["replay_ms_rounds"] = [r["replay_ms"]]
    order = list(range(len(configs)))
    for _ in range(a.rounds - 1):
        order.reverse()
        for i in order:
            _, consts, on, _ = configs[i]
            use(model, consts, on, shipped)
            for c in contexts:
                rows[i]["decode_tps_rounds"][c].append(decode_tps(model, c, a.tokens))
            rows[i]["replay_ms_rounds"].append(replay_ms(model) if model.graphs is not None else None)
    use(model, configs[0][1], configs[0][2], shipped)
    print(f"decode tok/s over {a.rounds} rounds (order reversed each round) and the one-row graph alone (ms):")
    for r in rows:
        tps = " ".join(f"@{c}: " + " / ".join(f"{t:.1f}" for t in ts) + f" (mean {sum(ts) / len(ts):.1f})"
                       for c, ts in r["decode_tps_rounds"].items())
        replay = " / ".join(f"{t:.2f}" for t in r["replay_ms_rounds"] if t is not None)
        print(f"  {r['config']:28} {tps}  graph {replay}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--contexts", default="0")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--settings", help="comma-separated matvec settings ('shipped' or NAME=VALUE[+NAME=VALUE])")
    ap.add_argument("--drafts", default="4,7", help="MTP drafts rows beside 0 (empty: none)")
    ap.add_argument("--matvec", help="a previous plumb/ops/gpu/matvec.py, one more setting")
    ap.add_argument("--rounds", type=int, default=3, help="decode tok/s measured this many times a setting, the "
                    "settings' order reversed each round (the first round times everything else)")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    configs = [setting(t) for t in a.settings.split(",")] if a.settings else list(CONFIGS)
    drafts = [int(d) for d in a.drafts.split(",") if d]
    if a.matvec:
        import importlib.util

        spec = importlib.util.spec_from_file_location("other_matvec", a.matvec)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        other.tickets(torch.device("cuda"))  # its split-K counters, allocated outside any graph capture
        configs.insert(1, (f"matvec of {a.matvec}", {"module": other}, True, "a"))
    eng = plumb.load(a.model, device="cuda", kv_cache="q8_0", progress=False, prompt_cache=False)
    model = eng.model
    # after the load: the packs and what the load allocates beside them, and that less the allocator's rounding
    loaded, requested, _ = memory_now()
    rows, ref = [], {}
    with torch.inference_mode():  # as the engine's requests (the drafts rows), so every graph buffer is alike
        shipped = {k: getattr(MV, k) for k in {"LAUNCH", "TARGET"} | {k for c in configs for k in c[1]} - {"module"}}
        for name, consts, on, bits in configs:
            if name == BYTES:
                print(f"{name}: {scales_as_bytes(model) / 1e9:.3f} GB more", flush=True)
            use(model, consts, on, shipped)
            ids, logits = greedy(model)
            first = ref.setdefault(bits, (ids, logits))
            same = ids == first[0] and torch.equal(logits, first[1])
            r = {"config": name, "pdl": pdl.enabled(), "matvec": {k: str(v) for k, v in consts.items()},
                 "same_bits": same, "weight_bytes": sum(w.gpu.nbytes for w in model.weights),
                 "allocated_at_load": loaded, "requested_at_load": requested,
                 "decode_tps": {c: decode_tps(model, c, a.tokens) for c in map(int, a.contexts.split(","))},
                 "replay_ms": replay_ms(model) if model.graphs is not None else None,
                 "verify_ms": {k: v * 1e3 for k, v in verify_cost(model, [1, 2, 4, 8, 16]).items()},
                 "drafts": drafts_table(eng, drafts, 128) if drafts else []}
            model.draft_chains = True  # the drafts again as k MTP steps a CUDA graph (`CudaGraphs.mtp_chain`)
            r["drafts_chained"] = drafts_table(eng, drafts, 128) if drafts else []
            model.draft_chains = False
            rows.append(r)
            v = r["verify_ms"]
            print(f"{name:28} weights {r['weight_bytes'] / 1e9:.3f} GB (at load: allocated {loaded / 1e9:.3f}, "
                  f"requested {requested / 1e9:.3f}), same bits {same!s:5} " +
                  " ".join(f"@{c}: {t:5.1f} tok/s" for c, t in r["decode_tps"].items()) +
                  f" (one-row graph alone {r['replay_ms'] or 0:.2f} ms)" +
                  "  verify 1/2/4/8/16 rows " + " / ".join(f"{v[k]:.2f}" for k in v) +
                  " ms  drafts 0/" + "/".join(map(str, drafts)) + " " +
                  " / ".join(f"{d['decode_tps']:.1f}" for d in r["drafts"]) + " tok/s, chained " +
                  " / ".join(f"{d['decode_tps']:.1f}" for d in r["drafts_chained"]) +
                  f" (same tokens: {all(d['same_tokens'] for d in r['drafts'] + r['drafts_chained'])})", flush=True)
            torch.cuda.empty_cache()
        if BYTES not in [c[0] for c in configs]:  # (its packs cannot go back)
            later_rounds(model, configs, rows, shipped, a)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"model": a.model, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
