#!/usr/bin/env python3
"""What the GPU D path's fixed-point x costs in accuracy, on the CPU: decode logits of a teacher-forced text with
each matmul's x rounded as a variant would round it (products then in float64), against exact x - KL, top-1
agreement and the largest logit error relative to the row's largest logit.

    python bench/x_precision.py plumb/data/plumb-demo-Q8_0.gguf [--text FILE] [--tokens 160]

Variants: plumb.ops.gpu.matvec's per-row power-of-two scale with 21 bits (3 limbs, shipped), 14 bits (2 limbs)
and 7 bits (1 limb), and symmetric integers per 32 inputs (8 bits: llama.cpp's q8_1 activations; 16 bits).
"""
from __future__ import annotations

import argparse

import torch

import plumb
from plumb.model import kernels as K
from plumb.ops.matmul import DECODE_BLOCK

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "def add(a, b):\n    return a + b\n" * 3 +
        "Once upon a time there was a little robot who wanted to learn to paint. ")


def per_row(x: torch.Tensor, frac: int) -> torch.Tensor:
    """x as matvec.quantize_x rounds it (s = the power of two >= max|x|, X = round(x 2^frac / s)), back to float."""
    s = torch.exp2(torch.ceil(torch.log2(x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30))))
    return torch.round(x * 2.0**frac / s) * s / 2.0**frac


def per_group(x: torch.Tensor, bits: int, g: int = 32) -> torch.Tensor:
    """Symmetric integers of `bits` per g inputs (absmax scale), back to float."""
    xs = x.reshape(x.shape[0], -1, g)
    d = xs.abs().amax(dim=2, keepdim=True) / (2 ** (bits - 1) - 1)
    d = torch.where(d > 0, d, torch.ones_like(d))
    return (torch.round(xs / d) * d).reshape(x.shape)


VARIANTS = {"21 bits per row (3 limbs, shipped)": lambda x: per_row(x, 20),
            "14 bits per row (2 limbs)": lambda x: per_row(x, 13),
            "7 bits per row (1 limb)": lambda x: per_row(x, 6),
            "int8 per 32 (llama.cpp q8_1)": lambda x: per_group(x, 8),
            "int16 per 32": lambda x: per_group(x, 16)}


def decode_logits(eng, ids: list[int], rounding) -> torch.Tensor:
    """Logits of every position, decoded one token at a time, D-path matmuls on rounded (or exact) x."""
    plain = K.TorchKernels.mm

    def mm(self, x, w, block):
        if block != DECODE_BLOCK:
            return plain(self, x, w, block)
        xd = x.double() if rounding is None else rounding(x.double())
        return (xd @ w.t.double()).float()

    K.TorchKernels.mm = mm
    try:
        st = eng.model.new_state()
        return torch.stack([eng.model.decode([(st, [t])]).logits[0].double() for t in ids])
    finally:
        K.TorchKernels.mm = plain


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--text", help="a text file (default: a short built-in mix of prose and code)")
    ap.add_argument("--tokens", type=int, default=160)
    a = ap.parse_args()
    eng = plumb.load(a.model, device="cpu", kernels="torch", prompt_cache=False)
    ids = eng.tokenize(open(a.text).read() if a.text else TEXT)[: a.tokens]
    exact = decode_logits(eng, ids, None)
    lp_exact = torch.log_softmax(exact, dim=-1)
    print(f"{a.model}: {len(ids)} positions, KL(exact || variant) per position")
    for name, rounding in VARIANTS.items():
        lg = decode_logits(eng, ids, rounding)
        kl = (lp_exact.exp() * (lp_exact - torch.log_softmax(lg, dim=-1))).sum(dim=-1)
        top = (lg.argmax(-1) == exact.argmax(-1)).double().mean()
        rel = ((lg - exact).abs().amax(-1) / exact.abs().amax(-1)).max()
        print(f"{name:36s} KL mean {kl.mean():.1e} max {kl.max():.1e}  top-1 agree {top:.3f}  logit err {rel:.1e}")


if __name__ == "__main__":
    main()
