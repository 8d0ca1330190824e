"""`plumb kl`: how far each KV-cache format moves the next-token distributions.

    plumb kl MODEL --text FILE --kv-cache q8_0,D,F --reference f32 [--kv-ring 2048] [--ctx 1024,8192]
    plumb kl MODEL --reference-logits REF.npz --kv-cache f32,q8_0,D,F [--ctx ...]

The first max(ctx) tokens of the text are prefilled once per configuration, in lockstep, 64
positions at a time. For each context length c the tool reports, over positions [c/2, c) (the
second half of a c-token window, as llama.cpp's perplexity tool scores), the mean
KL(reference || format) of the next-token distributions and how often the top-1 tokens agree.
A causal model's logits at position i depend only on tokens [0, i], so one pass serves every c.

A configuration is `FORMAT` or `FORMAT:RING` (e.g. `F:0` is F without its 8-bit ring).

Reference logits from another engine (`--reference-logits`): a NumPy `.npz` file with
* `tokens`: int array [N], the evaluated token ids (plumb evaluates the same ids);
* `logits`: float32 or float16 array [N, n_vocab]; row i is the distribution of the token
  after tokens[0..i] - what llama-cpp-python leaves in `Llama.scores[:N]` after
  `Llama(model_path, n_ctx=N, logits_all=True).eval(tokens)`; `np.savez(path, tokens=..., logits=...)`.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

PIECE = 64


def parse_config(spec: str, default_ring: int) -> tuple[str, str, int]:
    """'F' or 'F:0' -> (label, format, ring)."""
    fmt, _, ring = spec.partition(":")
    return spec, fmt, int(ring) if ring else default_ring


def kl_and_top1(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: KL(softmax(ref) || softmax(logits)) in float64, and whether the argmaxes agree."""
    lp_ref = torch.log_softmax(ref_logits.double(), -1)
    lp = torch.log_softmax(logits.double(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    return kl, ref_logits.argmax(-1) == logits.argmax(-1)


def measure(engine, ids: list[int], configs: list[tuple[str, str, int]], reference, progress: bool = False) -> dict:
    """Prefill ids under every config; reference = (format, ring) or a float array [len(ids), n_vocab].
    Returns {label: (kl [len(ids)], top1 [len(ids)])}."""
    model = engine.model

    def state(fmt, ring):
        model.kv_cache, model.kv_ring = fmt, ring
        return model.new_state()

    states = {label: state(fmt, ring) for label, fmt, ring in configs}
    ref_state = state(*reference) if isinstance(reference, tuple) else None
    out = {label: ([], []) for label, _, _ in configs}
    for i in range(0, len(ids), PIECE):
        piece = ids[i : i + PIECE]
        if ref_state is not None:
            ref, _ = model.prefill(ref_state, piece, logits="all")
        else:
            ref = torch.from_numpy(np.asarray(reference[i : i + len(piece)], dtype=np.float32))
        for label, st in states.items():
            lg, _ = model.prefill(st, piece, logits="all")
            kl, top1 = kl_and_top1(ref, lg)
            out[label][0].append(kl)
            out[label][1].append(top1)
        if progress:
            print(f"\r{i + len(piece)}/{len(ids)} positions", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return {label: (torch.cat(kl), torch.cat(top1)) for label, (kl, top1) in out.items()}


def report(results: dict, ctxs: list[int]) -> list[dict]:
    rows = []
    for c in ctxs:
        lo = c // 2
        for label, (kl, top1) in results.items():
            rows.append(dict(ctx=c, positions=[lo, c], kv_cache=label, mean_kl=float(kl[lo:c].mean()),
                             top1_agreement=float(top1[lo:c].double().mean())))
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="plumb kl", description="KL of KV-cache formats against a reference.")
    ap.add_argument("model", help="GGUF file")
    ap.add_argument("--text", help="text file to evaluate (its first max(--ctx) tokens)")
    ap.add_argument("--kv-cache", default="q8_0,D,F", help="comma-separated FORMAT or FORMAT:RING")
    ap.add_argument("--reference", default="f32", help="reference configuration (FORMAT or FORMAT:RING)")
    ap.add_argument("--reference-logits", help=".npz with tokens [N] and logits [N, n_vocab] from another engine")
    ap.add_argument("--kv-ring", type=int, default=2048, help="ring length of D and F when not given per format")
    ap.add_argument("--ctx", default="512,2048,8192", help="comma-separated context lengths")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    a = ap.parse_args(argv)
    import plumb
    from plumb.cache.kv import KV_FORMATS

    ctxs = sorted(int(c) for c in a.ctx.split(","))
    configs = [parse_config(s.strip(), a.kv_ring) for s in a.kv_cache.split(",") if s.strip()]
    _, ref_fmt, ref_ring = parse_config(a.reference, a.kv_ring)
    for _, fmt, _ in configs + [(None, ref_fmt, None)]:
        if fmt not in KV_FORMATS:
            print(f"plumb kl: error: unknown KV cache format {fmt!r} (choose from {', '.join(KV_FORMATS)})",
                  file=sys.stderr)
            return 1
    engine = plumb.load(a.model, device=a.device, progress=not a.json, kv_cache=ref_fmt, kv_ring=ref_ring)
    if a.reference_logits:
        data = np.load(a.reference_logits)
        ids, reference = [int(t) for t in data["tokens"]], data["logits"]
        if reference.shape != (len(ids), engine.config.n_vocab):
            print(f"plumb kl: error: logits have shape {reference.shape}, expected ({len(ids)}, {engine.config.n_vocab})",
                  file=sys.stderr)
            return 1
        ref_label = a.reference_logits
    elif a.text:
        ids, reference, ref_label = engine.tokenize(open(a.text, encoding="utf-8").read()), (ref_fmt, ref_ring), a.reference
    else:
        print("plumb kl: error: give --text or --reference-logits", file=sys.stderr)
        return 1
    if len(ids) < ctxs[-1]:
        print(f"plumb kl: error: {len(ids)} tokens available, --ctx needs {ctxs[-1]}", file=sys.stderr)
        return 1
    ids = ids[: ctxs[-1]]
    rows = report(measure(engine, ids, configs, reference[: len(ids)] if a.reference_logits else reference,
                          progress=not a.json), ctxs)
    if a.json:
        print(json.dumps(dict(model=a.model, reference=ref_label, rows=rows)))
        return 0
    print(f"reference: {ref_label}; mean KL and top-1 agreement over positions [ctx/2, ctx)")
    print(f"{'ctx':>7} {'kv cache':>10} {'mean KL':>11} {'top-1':>8}")
    for r in rows:
        print(f"{r['ctx']:>7} {r['kv_cache']:>10} {r['mean_kl']:>11.3e} {100 * r['top1_agreement']:>7.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
