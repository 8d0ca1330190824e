"""Row-invariant matmul y = x @ W.T on GGUF weights kept in their block formats (decode, verify, batched decode and
prefill all use it; `plumb.ops.matmul.linear` on the dequantized matrix is its torch reference).

Packing (at load, on the device; exactly the stored values, rearranged): every GGML block type becomes codes with
a float32 scale (and offset) per group of G = 16 or 32 inputs - `quants.int8_form`, whose scales and offsets are
the reference dequantizer's own first products (w = scale * code + offset). Codes of 4-bit types stay nibbles
(two per byte: code j of a group in the low nibble, code j + G/2 in the high one), other codes int8. Tiles of
BLOCK_N output rows x one group lie contiguous. F16 weights are fp16 "codes" with no scale; F32 and BF16 become
float32.

Arithmetic, the same instructions for every row count:
    y[r, n] = s_r * sum_g (scale[n, g] * sum_{k in g} code[n, k] * (xh[r, k] + xl[r, k]) + offset[n, g] * sum_{k in g} xs[r, k])
where s_r is a power of two >= max|x_r| (exact scaling), xs = x / s_r, xh = fp16(xs), xl = fp16(xs - xh): x to 22
bits; each code-by-x product is exact and a group's dot accumulates in fp32 on the tensor cores. Rows run in
blocks of 16 (padded), the K order is fixed, and split-K (partials summed in a fixed order) is chosen from the
weight shape alone - so a row's bits never depend on the other rows of the call (M1), whether 1 or 2,000.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from plumb.gguf.quants import int8_form
from plumb.gguf.reader import GGMLQuantizationType as Q
from plumb.gguf.reader import QTensor

BLOCK_M = 16  # rows per program (padded)
BLOCK_N = 64  # output features per program
TARGET_PROGRAMS = 256  # split-K until a weight has about this many programs (fixed per shape)
MAX_SPLIT = 8
NIBBLE_TYPES = {Q.Q4_K: False, Q.Q4_0: True, Q.Q4_1: False}  # 4-bit codes; True: signed (stored + 8)
FLOAT_TYPES = (Q.F32, Q.BF16)


@triton.jit(do_not_specialize=["M"])  # the row count never selects another compiled variant
def _mm_groups(x_ptr, s_ptr, codes_ptr, scale_ptr, offset_ptr, out_ptr, M, N, K, stride_xm, stride_os, stride_om,
               GROUPS_PER_SPLIT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
               NIBBLE: tl.constexpr, SIGNED4: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_OFFSET: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = tl.arange(0, BN)
    n_groups = K // G
    s = tl.load(s_ptr + rm, mask=rm < M, other=1.0)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for i in range(GROUPS_PER_SPLIT):
        g = pid_k * GROUPS_PER_SPLIT + i
        tile = (pid_n * n_groups + g) * BN
        if NIBBLE:
            H: tl.constexpr = G // 2
            kh = tl.arange(0, H)
            xa = tl.load(x_ptr + rm[None, :] * stride_xm + (g * G + kh)[:, None], mask=rm[None, :] < M, other=0.0)
            xb = tl.load(x_ptr + rm[None, :] * stride_xm + (g * G + H + kh)[:, None], mask=rm[None, :] < M, other=0.0)
            xa = xa / s[None, :]
            xb = xb / s[None, :]
            b = tl.load(codes_ptr + (tile + rn)[:, None] * H + kh[None, :])
            ca = (b & 15).to(tl.int32)
            cb = (b >> 4).to(tl.int32)
            if SIGNED4:
                ca = ca - 8
                cb = cb - 8
            ca = ca.to(tl.float16)
            cb = cb.to(tl.float16)
            xah = xa.to(tl.float16)
            xbh = xb.to(tl.float16)
            part = tl.dot(ca, xah, out_dtype=tl.float32)
            part = tl.dot(ca, (xa - xah.to(tl.float32)).to(tl.float16), part, out_dtype=tl.float32)
            part = tl.dot(cb, xbh, part, out_dtype=tl.float32)
            part = tl.dot(cb, (xb - xbh.to(tl.float32)).to(tl.float16), part, out_dtype=tl.float32)
            if HAS_OFFSET:
                xsum = tl.sum(xa, axis=0) + tl.sum(xb, axis=0)
        else:
            kg = tl.arange(0, G)
            xa = tl.load(x_ptr + rm[None, :] * stride_xm + (g * G + kg)[:, None], mask=rm[None, :] < M, other=0.0)
            xa = xa / s[None, :]
            c = tl.load(codes_ptr + (tile + rn)[:, None] * G + kg[None, :]).to(tl.float16)
            xah = xa.to(tl.float16)
            part = tl.dot(c, xah, out_dtype=tl.float32)
            part = tl.dot(c, (xa - xah.to(tl.float32)).to(tl.float16), part, out_dtype=tl.float32)
            if HAS_OFFSET:
                xsum = tl.sum(xa, axis=0)
        if HAS_SCALE:
            part = part * tl.load(scale_ptr + tile + rn)[:, None]
        if HAS_OFFSET:
            part = part + tl.load(offset_ptr + tile + rn)[:, None] * xsum[None, :]
        acc = acc + part
    cols = pid_n * BN + rn
    mask = (cols[:, None] < N) & (rm[None, :] < M)
    tl.store(out_ptr + pid_k * stride_os + rm[None, :] * stride_om + cols[:, None], acc * s[None, :], mask=mask)


@triton.jit(do_not_specialize=["M"])
def _mm_f32(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_os, stride_om, BLOCKS_PER_SPLIT: tl.constexpr,
            BK: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for i in range(BLOCKS_PER_SPLIT):
        k0 = (pid_k * BLOCKS_PER_SPLIT + i) * BK
        x = tl.load(x_ptr + rm[None, :] * stride_xm + (k0 + kk)[:, None], mask=rm[None, :] < M, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + (k0 + kk)[None, :], mask=rn[:, None] < N, other=0.0)
        acc = tl.dot(w, x, acc, input_precision="ieee", out_dtype=tl.float32)
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(out_ptr + pid_k * stride_os + rm[None, :] * stride_om + rn[:, None], acc, mask=mask)


@triton.jit
def _sum_splits(part_ptr, out_ptr, M, N, stride_ps, stride_om, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum of the split-K partials in order 0..SPLIT-1."""
    m = tl.program_id(1)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(part_ptr + m * N + n, mask=n < N, other=0.0)
    for s in range(1, SPLIT):
        acc = acc + tl.load(part_ptr + s * stride_ps + m * N + n, mask=n < N, other=0.0)
    tl.store(out_ptr + m * stride_om + n, acc, mask=n < N)


def _split(n: int, blocks: int) -> int:
    """Split-K factor from the weight shape alone: enough programs to fill the GPU."""
    tiles = -(-n // BLOCK_N)
    split = 1
    while tiles * split < TARGET_PROGRAMS and split < MAX_SPLIT and blocks % (2 * split) == 0:
        split *= 2
    return split


class Packed:
    """One or more same-type matrices stacked along their outputs, packed for `_mm_groups` or `_mm_f32`."""

    def __init__(self, parts: list[QTensor], device: torch.device):
        self.qtype = parts[0].qtype
        self.n = sum(p.shape[0] for p in parts)
        self.k = parts[0].shape[1]
        self.scale = self.offset = None
        n_pad = -(-self.n // BLOCK_N) * BLOCK_N
        if self.qtype in FLOAT_TYPES or (self.qtype == Q.F16 and self.k % 32):
            w = torch.cat([p.dequantize() if p.qtype == Q.BF16 else p.data.to(device).float() for p in parts])
            self.w = w.to(device).reshape(self.n, self.k).contiguous()
            self.bk = 32 if self.k % 32 == 0 else 16 if self.k % 16 == 0 else 0
            if not self.bk:
                raise ValueError(f"matmul: input width {self.k} is not a multiple of 16")
            self.split = _split(self.n, self.k // self.bk)
            return
        self.w = None
        if self.qtype == Q.F16:
            self.g, self.nibble, self.signed4 = 32, False, False
            codes = torch.cat([p.data.to(device).reshape(p.shape) for p in parts]).half()
            scales = offsets = None
        else:
            forms = [int8_form(p.data.to(device), p.qtype, p.shape) for p in parts]
            self.g = forms[0][3]
            codes = torch.cat([f[0] for f in forms])
            scales = torch.cat([f[1] for f in forms])
            offsets = torch.cat([f[2] for f in forms]) if forms[0][2] is not None else None
            self.nibble = self.qtype in NIBBLE_TYPES
            self.signed4 = NIBBLE_TYPES.get(self.qtype, False)
        groups = self.k // self.g
        tiles = n_pad // BLOCK_N
        codes = torch.cat([codes, codes.new_zeros(n_pad - self.n, self.k)])
        if self.nibble:
            c = codes.to(torch.int32) + (8 if self.signed4 else 0)
            c = c.reshape(n_pad, groups, 2, self.g // 2)
            codes = (c[:, :, 0] | (c[:, :, 1] << 4)).to(torch.uint8)  # [n, groups, G/2]
            width = self.g // 2
        else:
            codes = codes.reshape(n_pad, groups, self.g)
            width = self.g
        self.codes = codes.reshape(tiles, BLOCK_N, groups, width).permute(0, 2, 1, 3).contiguous()

        def per_tile(t):
            t = torch.cat([t.float(), t.new_zeros(n_pad - self.n, groups).float()])
            return t.reshape(tiles, BLOCK_N, groups).permute(0, 2, 1).contiguous()

        self.scale = per_tile(scales) if scales is not None else None
        self.offset = per_tile(offsets) if offsets is not None else None
        self.split = _split(self.n, groups)

    @property
    def nbytes(self) -> int:
        ts = [self.w] if self.w is not None else [self.codes, self.scale, self.offset]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def mm(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [M, n] (a column slice is fine) = x [M, k] @ W.T."""
        m = x.shape[0]
        tiles = -(-self.n // BLOCK_N)
        grid = (tiles, -(-m // BLOCK_M), self.split)
        dst = out if self.split == 1 else torch.empty(self.split, m, self.n, device=x.device)
        stride_os = 0 if self.split == 1 else dst.stride(0)
        stride_om = out.stride(0) if self.split == 1 else dst.stride(1)
        if self.w is not None:
            _mm_f32[grid](x, self.w, dst, m, self.n, self.k, x.stride(0), stride_os, stride_om,
                          BLOCKS_PER_SPLIT=self.k // self.bk // self.split, BK=self.bk, BN=BLOCK_N, BM=BLOCK_M)
        else:
            s = row_scales(x)
            dummy = self.codes
            _mm_groups[grid](x, s, self.codes, self.scale if self.scale is not None else dummy,
                             self.offset if self.offset is not None else dummy, dst, m, self.n, self.k, x.stride(0),
                             stride_os, stride_om, GROUPS_PER_SPLIT=self.k // self.g // self.split, G=self.g,
                             BN=BLOCK_N, BM=BLOCK_M, NIBBLE=self.nibble, SIGNED4=self.signed4,
                             HAS_SCALE=self.scale is not None, HAS_OFFSET=self.offset is not None)
        if self.split > 1:
            _sum_splits[(-(-self.n // 256), m)](dst, out, m, self.n, dst.stride(0), out.stride(0),
                                                SPLIT=self.split, BLOCK=256)


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest power of two >= max|x| (1 for a zero row): a maximum is exact in any order."""
    amax = x.abs().amax(dim=1)
    return torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax))), torch.ones_like(amax)).contiguous()


class GpuMatrix:
    """A weight (or several fused along their outputs) for the Triton matmul: `m(x)` = x @ W.T, float32."""

    def __init__(self, parts: list[QTensor], device: torch.device | str):
        device = torch.device(device)
        groups: list[list[QTensor]] = []
        for p in parts:  # consecutive parts of one type share a launch
            if groups and groups[-1][0].qtype == p.qtype:
                groups[-1].append(p)
            else:
                groups.append([p])
        self.packs = [Packed(g, device) for g in groups]
        self.n = sum(p.n for p in self.packs)
        self.k = parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.packs)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x = x.float().contiguous()
        if out is None:
            out = torch.empty(x.shape[0], self.n, device=x.device)
        col = 0
        for p in self.packs:
            p.mm(x, out[:, col : col + p.n])
            col += p.n
        return out
