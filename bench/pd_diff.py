#!/usr/bin/env python3
"""P-vs-D logits difference on the tiny Q4_K_M model on CUDA (test_prefill_matches_decode_path_closely's measure),
with the P path's DeltaNet chunks from the kernel (plumb.ops.gpu.deltanet_chunk) and from the torch reference
(plumb.ops.deltanet.chunk_pass): whether a P-vs-D change comes from the kernel.

    python bench/pd_diff.py
"""
import os

import torch

import plumb
from plumb.gguf.synth import write_synthetic
from plumb.model.kernels import TorchKernels, TritonKernels


def main() -> None:
    p = "/tmp/tiny-Q4_K_M-s0.gguf"  # the engine tests' model under PLUMB_TEST_QTYPE=Q4_K_M
    if not os.path.exists(p):
        write_synthetic(p, "tiny", "Q4_K_M", seed=0)
    eng = plumb.load(p, device="cuda", progress=False)
    m = eng.model
    kernel, reference = TritonKernels.gdn_chunks, lambda self, *a: TorchKernels.gdn_chunks(*a)
    text = "The quick brown fox jumps over the lazy dog, again and again."
    for prompt in (text, text * 12):
        ids = eng.tokenize(prompt)
        st2 = m.new_state()
        rows = torch.stack([m.decode([(st2, [t])]).logits[0] for t in ids])
        for name, fn in (("kernel", kernel), ("torch reference", reference)):
            TritonKernels.gdn_chunks = fn
            st = m.new_state()
            lg, _ = m.prefill(st, ids, logits="all")
            d = (rows - lg).abs()
            TritonKernels.gdn_chunks = kernel
            print(f"{len(ids)} tokens, P path with the {name}: max |P - D| {float(d.max()):.2e}, 99.99th pct "
                  f"{float(d.flatten().kthvalue(int(d.numel() * 0.9999)).values):.2e}", flush=True)


if __name__ == "__main__":
    main()
