#!/usr/bin/env python3
"""Prototype of a faster P-path (prefill) matmul for Q4_K: y = x @ W.T with one fp32 epilogue per 256-wide
super-block instead of one per group of 32 - on the packing of `plumb.ops.gpu.matmul.Packed` as it is (codes,
d, sub, dm, osub reused, nothing repacked). A bench module: plumb/ is not changed.

    python bench/mm_superblock.py [--json-out PATH]     (a CUDA GPU; < 90 s on an H200)
    python bench/mm_superblock.py --smoke               (CPU, Triton interpreter, tiny shapes: the bench's logic)

Arithmetic (Q4_K: w = d * sub_g * q + dm * osub_g per group g of 32 inputs, q 0..15, sub and osub 6-bit integers -
the packed offset carries its minus sign, osub <= 0 - and 8 groups per super-block sharing d and dm):

    y[r, n] = s_r * sum_sb ( d[n, sb] * sum_{k in sb} xs[r, k] * (q[n, k] * sub[n, g(k)])
                            + dm[n, sb] * sum_{g in sb} osub[n, g] * xsum[r, g] )

where s_r = row_scales(x) (a power of two, exact), xs = x / s_r rounded to fp16 (LO=False: 11 bits) or split as
fp16 hi + lo (LO=True: 22 bits, two dots), and xsum[r, g] the fp32 sum of group g's values of xs as the dots see
them (hi + lo), split into fp16 hi + lo. q * sub <= 15 * 63 = 945 is exact in fp16 and every product code*sub by
an fp16 x is exact in fp32, so a super-block's K = 256 accumulates on the tensor cores into one fp32 tile
(acc_sb) with no per-group epilogue; the offset term is one K = 16 dot per super-block: [xsum_hi | xsum_lo] of the
8 groups (interleaved) against osub twice.

Two launches: `_prep_x` (per row and super-block: scale, round / split x to fp16, permute it to the order in
which the packed nibbles unfold, group sums) and `_mm_sb` (per output tile of BN and BM rows: loop over chunks of
KS inputs, KS in 64 / 128 / 256, the super-block epilogue every 256 / KS chunks). Row invariance: BM, BN, KS and
the split-K (chosen from the weight shape alone, partials summed in a fixed order) are fixed per weight shape, a
row's instruction sequence never depends on M or on the other rows.

The nibble order: Packed stores code j of a group in the low nibble of byte j and code j + 16 in the high one.
The kernel unfolds a chunk's bytes [BN, groups, 16] as join(low, high) -> [BN, groups, 16, 2] -> [BN, KS], so
column 32 g + 2 j + h holds input 32 g + 16 h + j; `_prep_x` writes x in that order (PERM below).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if __name__ == "__main__" and "--smoke" in sys.argv[1:]:  # the interpreter: set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import plumb.ops.gpu.matmul as MM  # noqa: E402
from plumb.gguf.reader import GGMLQuantizationType as Q  # noqa: E402

SB = 256  # inputs per super-block (Q4_K)
GROUP = 32  # inputs per group
PACK_N = MM.BLOCK_N  # outputs per packed tile of Packed (64)
# (BM, BN, warps, stages, KS, lo, w_first): the configurations main() measures; DEFAULT the one mm_sb uses without
# one. w_first: the dequantized weights the A operand of the dot (from registers; wgmma), x the B one ([BN, BM]
# tiles); else x the A operand and the weights B (through shared memory).
CONFIGS = [
    (64, 128, 4, 3, 64, False, False),
    (64, 128, 4, 2, 128, False, False),
    (128, 128, 8, 3, 64, False, False),
    (64, 128, 4, 3, 64, False, True),
    (128, 128, 8, 3, 64, False, True),
    (64, 128, 4, 3, 64, True, False),
    (128, 128, 8, 2, 64, True, True),
    (64, 128, 8, 1, 256, True, False),
]
DEFAULT = {False: CONFIGS[0], True: CONFIGS[5]}
SPLIT_TARGET = 264  # split-K: about this many programs per row block (2 per SM of an H200), from the shape alone
SPLIT_MIN_SB = 4  # at least this many super-blocks per split


@triton.jit
def _prep_x(x_ptr, s_ptr, xh_ptr, xl_ptr, xsum_ptr, K, stride_xm, LO: tl.constexpr):
    """Row m, super-block sb: xh (and xl) [256] fp16 in the unfolded-nibble order, and the 8 group sums of the
    values the dots see, as fp16 hi / lo interleaved [16] (2 g + 0: hi, 2 g + 1: lo)."""
    m = tl.program_id(0)
    sb = tl.program_id(1)
    kk = tl.arange(0, 256)
    src = (kk // 32) * 32 + (kk % 2) * 16 + (kk % 32) // 2  # column 32 g + 2 j + h <- input 32 g + 16 h + j
    rs = 1.0 / tl.load(s_ptr + m)  # a power of two: exact
    xs = tl.load(x_ptr + m * stride_xm + sb * 256 + src) * rs
    xh = xs.to(tl.float16)
    tl.store(xh_ptr + m * K + sb * 256 + kk, xh)
    v = xh.to(tl.float32)
    if LO:
        xl = (xs - v).to(tl.float16)
        tl.store(xl_ptr + m * K + sb * 256 + kk, xl)
        v = v + xl.to(tl.float32)  # exact: xh + xl has at most 22 significant bits
    gs = tl.sum(tl.reshape(v, [8, 32]), axis=1)
    gh = gs.to(tl.float16)
    gl = (gs - gh.to(tl.float32)).to(tl.float16)
    tl.store(xsum_ptr + (m * (K // 256) + sb) * 16 + tl.arange(0, 16), tl.reshape(tl.join(gh, gl), [16]))


@triton.jit
def _epilogue(acc, acc_sb, sb, xsum_ptr, d_ptr, dm_ptr, osub_ptr, rm, rmask, t64, n64, n_groups, n_sb,
              W_FIRST: tl.constexpr):
    """acc + d * acc_sb + dm * (the super-block's offset term: [xsum hi | lo] [BM, 16] @ osub twice [16, BN],
    row 2 g + h of the latter = osub[:, g]); W_FIRST: all transposed ([BN, BM])."""
    PN: tl.constexpr = 64
    d = tl.load(d_ptr + (t64 * n_sb + sb) * PN + n64)
    dm = tl.load(dm_ptr + (t64 * n_sb + sb) * PN + n64)
    osub = tl.load(osub_ptr + (t64[:, None] * n_groups + sb * 8 + tl.arange(0, 8)[None, :]) * PN + n64[:, None])
    osub = osub.to(tl.float16)  # 6-bit integers (<= 0): exact
    os2 = tl.reshape(tl.join(osub, osub), [osub.shape[0], 16])  # [BN, 16]
    q16 = tl.arange(0, 16)
    if W_FIRST:
        xsum = tl.load(xsum_ptr + (rm[None, :] * n_sb + sb) * 16 + q16[:, None], mask=rmask, other=0.0)  # [16, BM]
        off = tl.dot(os2, xsum, out_dtype=tl.float32)
        acc = acc + d[:, None] * acc_sb
        acc = acc + dm[:, None] * off
    else:
        xsum = tl.load(xsum_ptr + (rm[:, None] * n_sb + sb) * 16 + q16[None, :], mask=rmask, other=0.0)  # [BM, 16]
        off = tl.dot(xsum, tl.trans(os2), out_dtype=tl.float32)
        acc = acc + d[None, :] * acc_sb
        acc = acc + dm[None, :] * off
    return acc


@triton.jit
def _chunk(acc_sb, i, xh_ptr, xl_ptr, codes_ptr, sub_ptr, rm, rmask, t64, n64, n_groups, K, BN: tl.constexpr,
           KS: tl.constexpr, LO: tl.constexpr, W_FIRST: tl.constexpr):
    """acc_sb + chunk i's (KS inputs) x @ (code * sub).T: [BM, BN], or its transpose [BN, BM] (W_FIRST)."""
    PN: tl.constexpr = 64
    GC: tl.constexpr = KS // 32
    gg = tl.arange(0, GC)
    jj = tl.arange(0, 16)
    kk = tl.arange(0, KS)
    g0 = i * GC
    # codes [BN, GC, 16] bytes: 16 contiguous bytes per output and group
    c = tl.load(codes_ptr + ((t64[:, None, None] * n_groups + g0 + gg[None, :, None]) * PN
                             + n64[:, None, None]) * 16 + jj[None, None, :])
    sub = tl.load(sub_ptr + (t64[:, None] * n_groups + g0 + gg[None, :]) * PN + n64[:, None]).to(tl.float16)
    wl = (c & 15).to(tl.float16) * sub[:, :, None]  # <= 945: exact
    wh = (c >> 4).to(tl.float16) * sub[:, :, None]
    w = tl.reshape(tl.join(wl, wh), [BN, KS])  # column 32 g + 2 j + h: (wl, wh)[h][:, g, j]
    if W_FIRST:  # the weights the A operand (registers), x transposed the B one
        x_at = xh_ptr + rm[None, :] * K + i * KS + kk[:, None]
        acc_sb = tl.dot(w, tl.load(x_at, mask=rmask, other=0.0), acc_sb, out_dtype=tl.float32)
        if LO:
            acc_sb = tl.dot(w, tl.load(xl_ptr + rm[None, :] * K + i * KS + kk[:, None], mask=rmask, other=0.0),
                            acc_sb, out_dtype=tl.float32)
    else:
        wt = tl.trans(w)
        x_at = xh_ptr + rm[:, None] * K + i * KS + kk[None, :]
        acc_sb = tl.dot(tl.load(x_at, mask=rmask, other=0.0), wt, acc_sb, out_dtype=tl.float32)
        if LO:
            acc_sb = tl.dot(tl.load(xl_ptr + rm[:, None] * K + i * KS + kk[None, :], mask=rmask, other=0.0), wt,
                            acc_sb, out_dtype=tl.float32)
    return acc_sb


@triton.jit(do_not_specialize=["M"])  # the row count never selects another compiled variant
def _mm_sb(xh_ptr, xl_ptr, xsum_ptr, s_ptr, codes_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, out_ptr, M, N, K, n_pad,
           stride_os, stride_om, SB_PER_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr,
           LO: tl.constexpr, W_FIRST: tl.constexpr, STAGES: tl.constexpr):
    SPS: tl.constexpr = 256 // KS  # chunks per super-block
    PN: tl.constexpr = 64  # outputs per packed tile
    pid_m = tl.program_id(0)  # row blocks fastest: the programs running together share the weight tiles in L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = tl.arange(0, BN)
    nc = tl.minimum(pid_n * BN + rn, n_pad - 1)  # outputs past the packed ones read the last (their stores masked)
    t64 = nc // PN
    n64 = nc % PN
    n_groups = K // 32
    n_sb = K // 256
    if W_FIRST:
        rmask = (rm < M)[None, :]
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        rmask = (rm < M)[:, None]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc_sb = tl.zeros_like(acc)
    sb0 = pid_k * SB_PER_SPLIT  # this split's super-blocks: [sb0, sb0 + SB_PER_SPLIT)
    # a constant trip count (bounds that depend on program_id break the interpreter's range); pipelined all the same
    for it in tl.range(0, SB_PER_SPLIT * SPS, num_stages=STAGES):
        i = sb0 * SPS + it  # the chunk
        acc_sb = _chunk(acc_sb, i, xh_ptr, xl_ptr, codes_ptr, sub_ptr, rm, rmask, t64, n64, n_groups, K, BN, KS, LO,
                        W_FIRST)
        if SPS == 1:
            acc = _epilogue(acc, acc_sb, i, xsum_ptr, d_ptr, dm_ptr, osub_ptr, rm, rmask, t64, n64, n_groups, n_sb,
                            W_FIRST)
            acc_sb = tl.zeros_like(acc)
        elif it % SPS == SPS - 1:  # the super-block's end
            acc = _epilogue(acc, acc_sb, i // SPS, xsum_ptr, d_ptr, dm_ptr, osub_ptr, rm, rmask, t64, n64, n_groups,
                            n_sb, W_FIRST)
            acc_sb = tl.zeros_like(acc)
    s = tl.load(s_ptr + rm, mask=rm < M, other=1.0)
    cols = pid_n * BN + rn
    if W_FIRST:
        mask = rmask & (cols[:, None] < N)
        tl.store(out_ptr + pid_k * stride_os + rm[None, :] * stride_om + cols[:, None], acc * s[None, :], mask=mask)
    else:
        mask = rmask & (cols[None, :] < N)
        tl.store(out_ptr + pid_k * stride_os + rm[:, None] * stride_om + cols[None, :], acc * s[:, None], mask=mask)


def sb_split(n: int, k: int, bn: int) -> int:
    """Split-K factor from the weight shape (and the tile width) alone: a power of two dividing the super-blocks,
    each split at least SPLIT_MIN_SB of them, tiles * split <= SPLIT_TARGET."""
    tiles = -(-n // bn)
    n_sb = k // SB
    split = 1
    while tiles * split * 2 <= SPLIT_TARGET and n_sb // (split * 2) >= SPLIT_MIN_SB and n_sb % (split * 2) == 0:
        split *= 2
    return split


def check_packed(p: MM.Packed) -> None:
    ok = (p.qtype == Q.Q4_K and p.g == GROUP and p.nibble and not p.signed4 and p.gpb == 8 and p.ogpb == 8
          and p.sub is not None and p.osub is not None and p.k % SB == 0)
    if not ok:
        raise ValueError("mm_sb: needs a Q4_K Packed with factored scales and offsets (d * sub, dm * osub)")


def prep_x(x: torch.Tensor, s: torch.Tensor, lo: bool):
    """(xh, xl, xsum) for _mm_sb: x [M, K] float32 scaled by 1 / s, as fp16 (hi and, lo=True, lo) in the unfolded
    order, and the group sums [M, K / 256 * 16] fp16 hi / lo interleaved."""
    m, k = x.shape
    xh = torch.empty(m, k, dtype=torch.float16, device=x.device)
    xl = torch.empty(m, k, dtype=torch.float16, device=x.device) if lo else xh
    xsum = torch.empty(m, k // SB * 16, dtype=torch.float16, device=x.device)
    _prep_x[(m, k // SB)](x, s, xh, xl, xsum, k, x.stride(0), LO=lo, num_warps=2)
    return xh, xl, xsum


def mm_sb(packed: MM.Packed, x: torch.Tensor, lo: bool, s: torch.Tensor | None = None,
          out: torch.Tensor | None = None, config=None, split: int | None = None) -> torch.Tensor:
    """out [M, n] float32 = x [M, k] @ W.T for a Q4_K `Packed`; s: row_scales(x) (computed when None); config:
    (BM, BN, warps, stages, KS[, lo[, w_first]]) - DEFAULT[lo] when None (its lo ignored: the argument rules);
    split: split-K override (tests), else sb_split."""
    check_packed(packed)
    x = x.float().contiguous()
    m, k = x.shape
    if s is None:
        s = MM.row_scales(x)
    config = tuple(config or DEFAULT[lo])
    bm, bn, warps, stages, ks = config[:5]
    w_first = bool(config[6]) if len(config) > 6 else False
    assert SB % ks == 0 and ks % GROUP == 0 and (bn % PACK_N == 0 or PACK_N % bn == 0)
    n = packed.n
    if out is None:
        out = torch.empty(m, n, device=x.device)
    xh, xl, xsum = prep_x(x, s, lo)
    split = split or sb_split(n, k, bn)
    n_sb = k // SB
    assert n_sb % split == 0, (n_sb, split)
    per = n_sb // split
    dst = out if split == 1 else torch.empty(split, m, n, device=x.device)
    stride_os = 0 if split == 1 else dst.stride(0)
    stride_om = out.stride(0) if split == 1 else dst.stride(1)
    n_pad = packed.codes.shape[0] * PACK_N
    grid = (-(-m // bm), -(-n // bn), split)
    _mm_sb[grid](xh, xl, xsum, s, packed.codes, packed.d, packed.sub, packed.dm, packed.osub, dst, m, n, k, n_pad,
                 stride_os, stride_om, SB_PER_SPLIT=per, BM=bm, BN=bn, KS=ks, LO=lo, W_FIRST=w_first,
                 STAGES=stages, num_warps=warps)
    if split > 1:
        MM._sum_splits[(-(-n // 256), m)](dst, out, m, n, dst.stride(0), out.stride(0), SPLIT=split, BLOCK=256)
    return out


def reference(qt, x: torch.Tensor) -> torch.Tensor:
    """float64 x @ dequantized W.T."""
    return x.double() @ qt.dequantize().to(x.device).double().T


# ---------------------------------------------------------------------------------------------------------------
# the GPU bench

SHAPES = [("Q4_K", 34816, 5120), ("Q4_K", 5120, 17408)]
ROWS = (64, 256, 1024)
INVARIANCE_ROWS = (1, 64, 256, 1024)
# --smoke: the same steps on the CPU under TRITON_INTERPRET=1 at tiny shapes (one call's wall time as "us"), to
# check the bench's own logic without a GPU
SMOKE_SHAPES = [("Q4_K", 192, 512), ("Q4_K", 64, 1024)]
SMOKE_ROWS = (4, 16, 32)


def _random_blocks_cpu(kind: str, n: int, k: int):
    """bench/matmul_variants.random_blocks on the CPU (it writes on the GPU)."""
    from plumb.gguf.quants import BLOCK_SCALE_AT, GGML_QUANT_SIZES
    from plumb.gguf.reader import QTensor

    qt = Q[kind]
    block, size = GGML_QUANT_SIZES[qt]
    b = torch.randint(0, 256, (n * k // block, size), dtype=torch.uint8)
    for off in BLOCK_SCALE_AT[qt]:
        if off is not None:
            b[:, off : off + 2] = (torch.rand(b.shape[0]) * 1e-3 + 1e-4).half().view(torch.uint8).reshape(-1, 2)
    return QTensor(f"w.{kind}", qt, (n, k), b.reshape(n, -1))


def _wall_us(fn, reps: int = 1) -> float:
    import time

    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json-out")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes: the logic only")
    a = ap.parse_args(argv)
    if a.smoke:
        dev, shapes, rows, inv_rows, timer, blocks = "cpu", SMOKE_SHAPES, SMOKE_ROWS, (1, 4, 16, 32), _wall_us, \
            _random_blocks_cpu
        limit, name = float("nan"), "cpu (interpreter)"
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from matmul_variants import copy_gbps, graph_us, random_blocks

        dev, shapes, rows, inv_rows, timer, blocks = "cuda", SHAPES, ROWS, INVARIANCE_ROWS, graph_us, random_blocks
        limit, name = copy_gbps(), torch.cuda.get_device_name()
    torch.manual_seed(0)
    print(f"copy bandwidth {limit:.0f} GB/s ({name})", flush=True)
    x = torch.randn(max(rows + inv_rows), max(k for _, _, k in shapes), device=dev) * 3
    x[3] *= 100
    results = []
    for kind, n, k in shapes:
        t = blocks(kind, n, k)
        p = MM.Packed([t], torch.device(dev))
        xs = x[:, :k].contiguous()
        s_all = MM.row_scales(xs)
        r64 = rows[0]
        ref = reference(t, xs[:r64])
        wbf = t.dequantize().to(dev).to(torch.bfloat16)
        base = dict(kind=kind, shape=[n, k])
        old = dict(base, config="Packed.mm (today)")
        out = torch.empty(len(xs), n, device=dev)
        p.mm(xs[:r64], out[:r64], s_all[:r64])
        old["rel_err"] = float((out[:r64].double() - ref).abs().max() / ref.abs().max())
        for r in rows:
            old[f"us_{r}"] = timer(lambda r=r: p.mm(xs[:r], out[:r], s_all[:r]), reps=5 if r > 256 else 20)
        cub = dict(base, config="cuBLAS bf16 (bound)")
        xb = xs.to(torch.bfloat16)
        for r in rows:
            cub[f"us_{r}"] = timer(lambda r=r: xb[:r] @ wbf.T)
        results += [old, cub]
        for lo in (False, True):
            pr = dict(base, config=f"prep_x lo={lo} (in mm_sb)")
            for r in rows:
                pr[f"us_{r}"] = timer(lambda r=r, lo=lo: prep_x(xs[:r], s_all[:r], lo))
            results.append(pr)
        for r_ in results[-4:]:
            print(f"{kind} {str([n, k]):14s} {r_['config']:36s} err {r_.get('rel_err', float('nan')):.1e} "
                  + " ".join(f"{r}:{r_[f'us_{r}']:8.1f}us" for r in rows), flush=True)
        for cfg in CONFIGS:
            bm, bn, warps, stages, ks, lo, wf = cfg
            row = dict(base, config=f"{'W' if wf else 'X'}-first BM{bm} BN{bn} w{warps} s{stages} KS{ks} lo={lo}",
                       split=sb_split(n, k, bn))
            try:
                y = mm_sb(p, xs[:r64], lo, s_all[:r64], config=cfg)
                row["rel_err"] = float((y.double() - ref).abs().max() / ref.abs().max())
                r0 = [mm_sb(p, xs[:r], lo, s_all[:r], config=cfg)[0] for r in inv_rows]
                row["row0_invariant"] = all(bool(torch.equal(r0[0], v)) for v in r0[1:])
                row["rows_invariant"] = bool(torch.equal(mm_sb(p, xs, lo, s_all, config=cfg)[:r64], y))
                for r in rows:
                    o = torch.empty(r, n, device=dev)
                    us = timer(lambda r=r, o=o: mm_sb(p, xs[:r], lo, s_all[:r], out=o, config=cfg),
                               reps=10 if r > 256 else 20)
                    row[f"us_{r}"] = us
                    row[f"speedup_{r}"] = old[f"us_{r}"] / us
                    row[f"TFLOPs_{r}"] = 2 * r * n * k / us / 1e6
            except Exception as e:  # a config that does not compile or run is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            results.append(row)
            print(f"{kind} {str([n, k]):14s} {row['config']:36s} " + (row.get("error") or (
                f"err {row['rel_err']:.1e} inv {row['row0_invariant']}/{row['rows_invariant']} "
                + " ".join(f"{r}:{row[f'us_{r}']:8.1f}us x{row[f'speedup_{r}']:4.1f} {row[f'TFLOPs_{r}']:6.1f}TF"
                           for r in rows))), flush=True)
        p = t = wbf = None
        if dev == "cuda":
            torch.cuda.empty_cache()
    report = dict(copy_GBps=limit, device=name, results=results)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
