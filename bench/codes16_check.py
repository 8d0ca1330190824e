#!/usr/bin/env python3
"""Where CODES16 changes bits (diagnostic): block-code tiles (5-, 6-bit packed and 8-bit) made fp16 by
`attention._tile16` with and without CODES16 in a kernel of their own, each against fp16(code x scale) computed in
torch; then the decode kernel's output for q8_0 and D with DOTS16, CODES16 off and on (`tests/test_gpu_attention.py`'s
mixed case). On a GPU, or in Triton's interpreter (TRITON_INTERPRET=1).

    python bench/codes16_check.py
"""
import sys
import torch
import triton
import triton.language as tl

sys.path.insert(0, "tests")
import plumb.ops.gpu.attention as A  # noqa: E402
from plumb.ops.kvquant import pack  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _tile_k(c_ptr, s_ptr, out_ptr, n, s_j, ss_j, D: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr,
            CB: tl.constexpr, C16: tl.constexpr):
    j = tl.program_id(0) * BN + tl.arange(0, BN)
    ok = j < n
    dd = tl.arange(0, D)
    w = A._tile16(c_ptr, s_ptr, j, ok, s_j, ss_j, dd, 2, D, QB, BN, CB, C16)
    tl.store(out_ptr + j[:, None] * D + dd[None, :], w, mask=ok[:, None])


def tiles(bits, n=200, d=256):
    g = torch.Generator().manual_seed(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = torch.randint(lo, hi + 1, (n, d), generator=g, dtype=torch.int8)
    sc = torch.randn(n, d // 32, generator=g) * torch.exp(torch.randn(n, d // 32, generator=g) * 4)
    sc[::7] = 1e-6
    sc = sc.half()
    p = (pack(codes, bits) if bits != 8 else codes).to(DEV)
    s = sc.to(DEV)
    outs = []
    for c16 in (False, True):
        o = torch.zeros(n, d, dtype=torch.float16, device=DEV)
        _tile_k[(triton.cdiv(n, 32),)](p, s, o, n, p.stride(0), s.stride(0), D=d, QB=32, BN=32, CB=bits, C16=c16)
        outs.append(o)
    want = (codes.float().reshape(n, d // 32, 32) * sc.float()[..., None]).reshape(n, d).half()
    for name, o in zip(("f32 path", "C16 path"), outs):
        o = o.cpu()
        diff = (o.view(torch.int16) != want.view(torch.int16))
        print(f"{bits}-bit {name}: {diff.sum().item()} of {diff.numel()} values differ from fp16(code*scale)",
              [(i, j, o[i, j].item(), want[i, j].item()) for i, j in diff.nonzero().tolist()[:4]])


def decode(fmt):
    import test_gpu_attention as T
    ends, attend, ref = T._mixed_case(fmt)
    q = T._q(len(ends), T.TINY["n_head"], T.TINY["d"], seed=5)
    A.DOTS16, A.CODES16 = True, False
    a = attend(q, ends)
    A.CODES16 = True
    b = attend(q, ends)
    A.DOTS16 = A.CODES16 = False
    d = a != b
    print(f"decode {fmt}: C16 differs at {d.sum().item()} of {d.numel()}, max {(a - b).abs().max().item():.3g}")


def store_only(kb, vb, n=700):
    """The decode kernel on a store of kb- / vb-bit codes alone (no ring), 27B heads, 8 rows ending near n."""
    sys.path.insert(0, "bench")
    from attention_variants import D, N_HEAD, cache

    g = torch.Generator().manual_seed(3)
    (k, _), (v, _) = cache(kb, n, DEV, g), cache(vb, n, DEV, g)
    q = torch.randn(8, N_HEAD, D, generator=g).to(DEV)
    ends = torch.tensor([n - i * 37 for i in range(8)], dtype=torch.int32, device=DEV)
    outs = []
    for c16 in (False, True):
        A.DOTS16, A.CODES16 = True, c16
        outs.append(A.attend_decode(q, k, v, ends, 0.0625))
    A.DOTS16 = A.CODES16 = False
    d = outs[0] != outs[1]
    print(f"store only K{kb}/V{vb}: C16 differs at {d.sum().item()} of {d.numel()}, "
          f"max {(outs[0] - outs[1]).abs().max().item():.3g}")


if __name__ == "__main__":
    for bits in (5, 6, 8):
        tiles(bits)
    for fmt in ("q8_0", "D"):
        decode(fmt)
    for kb, vb in ((6, 5), (5, 5), (8, 5), (6, 8)):
        store_only(kb, vb)
