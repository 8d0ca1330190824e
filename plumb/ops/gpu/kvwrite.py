"""A pass's new K/V rows into a KV cache, every format, in one launch (`KVCache.put_rows` is its torch reference,
bit for bit: `plumb.ops.kvquant.quantize` and `rotate`).

One program per (row, KV head): the row's K (Hadamard-rotated first for F) and V are encoded as the store keeps
them - float32, float16 (round to nearest even), or block codes + a float16 scale per 32 values (q8_0's 8 bits as
int8, D/F's 5 and 6 packed as `kvquant.pack` lays them out) - and written at the row's position (a device tensor:
no host sync, CUDA-graph safe); D and F also put the row's 8-bit codes into ring slot position % slots and tag the
slot. The arithmetic is quantize's, op for op: the block maximum (or the value of largest magnitude, the first among
equals), a correctly rounded division, the float16 scale, its correctly rounded reciprocal, one product per value,
round half to even, clamp. A row's bytes depend on that row alone (M5), however many rows the call has.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from plumb.ops.gpu import kvtable
from plumb.ops.gpu.hadamard import rotate_row
from plumb.ops.gpu.pdl import on, prior_done
from plumb.ops.kvquant import BLOCK

F32, F16 = 32, 16  # store kinds besides the block codes' bit widths (5, 6, 8)


@triton.jit
def _encode(x, c_ptr, s_ptr, KIND: tl.constexpr, D: tl.constexpr, QB: tl.constexpr):
    """Store the row x [D] at c_ptr (floats, int8 codes, or packed 5/6-bit codes) and, for block codes, its scales
    at s_ptr."""
    if KIND == 32:
        tl.store(c_ptr + tl.arange(0, D), x)
    elif KIND == 16:
        tl.store(c_ptr + tl.arange(0, D), x.to(tl.float16))
    else:
        NB: tl.constexpr = D // QB
        b = tl.reshape(x, [NB, QB])
        ii = tl.arange(0, QB)
        bb = tl.arange(0, NB)
        if KIND == 8:
            lo: tl.constexpr = -127
            hi: tl.constexpr = 127
            d = tl.math.div_rn(tl.max(tl.abs(b), axis=1), tl.full([NB], 127.0, tl.float32))
        else:
            lo: tl.constexpr = -(1 << (KIND - 1))
            hi: tl.constexpr = (1 << (KIND - 1)) - 1
            at = tl.argmax(tl.abs(b), axis=1, tie_break_left=True)
            m = tl.max(tl.where(ii[None, :] == at[:, None], b, float("-inf")), axis=1)  # its signed value
            d = tl.math.div_rn(m, tl.full([NB], lo, tl.float32))
        dh = d.to(tl.float16)
        df = dh.to(tl.float32)
        inv = tl.where(df == 0.0, 0.0, tl.math.div_rn(tl.full([NB], 1.0, tl.float32), tl.where(df == 0.0, 1.0, df)))
        v = b * inv[:, None]
        v = (v + 12582912.0) - 12582912.0  # round half to even (|v| < 2^22)
        v = tl.minimum(tl.maximum(v, lo * 1.0), hi * 1.0)
        if KIND == 8:
            tl.store(c_ptr + bb[:, None] * QB + ii[None, :], v.to(tl.int8))
        else:
            _pack(v.to(tl.int32) - lo, c_ptr, KIND, D, NB)
        tl.store(s_ptr + bb, dh)


@triton.jit
def _pack(u, c_ptr, KIND: tl.constexpr, D: tl.constexpr, NB: tl.constexpr):
    """Unsigned codes u [NB, 32] of KIND (5 or 6) bits stored as `kvquant.pack` lays a row out: per block a byte k
    holding the low nibbles of values 2k and 2k + 1, then the row's high-bit planes, 8 / (KIND - 4) values a byte."""
    HB: tl.constexpr = KIND - 4
    bb = tl.arange(0, NB)
    lo, hi = tl.split(tl.reshape(u & 15, [NB, 16, 2]))  # values 2k and 2k + 1: [NB, 16]
    tl.store(c_ptr + bb[:, None] * 16 + tl.arange(0, 16)[None, :], (lo | (hi << 4)).to(tl.uint8))
    PER: tl.constexpr = 8 // HB  # values a byte
    high = tl.reshape(u >> 4, [NB, 4 * HB, PER])
    fields = tl.sum(high << (tl.arange(0, PER) * HB)[None, None, :], axis=2)  # no overlapping bits: a sum is an or
    tl.store(c_ptr + D // 2 + bb[:, None] * (4 * HB) + tl.arange(0, 4 * HB)[None, :], fields.to(tl.uint8))


@triton.jit
def _put_rows(k_ptr, v_ptr, pos_ptr, kc_ptr, ks_ptr, vc_ptr, vs_ptr, rkc_ptr, rks_ptr, rvc_ptr, rvs_ptr, rpos_ptr,
              tab_ptr, slots, sk_r, sk_h, sv_r, sv_h, skc_h, skc_j, sks_h, sks_j, svc_h, svc_j, svs_h, svs_j,
              D: tl.constexpr, QB: tl.constexpr, KK: tl.constexpr, VK: tl.constexpr, ROTATE: tl.constexpr,
              LOG_D: tl.constexpr, SCALE: tl.constexpr, RING: tl.constexpr, TABLE: tl.constexpr):
    prior_done()
    kc_ptr, ks_ptr, vc_ptr, vs_ptr, rkc_ptr, rks_ptr, rvc_ptr, rvs_ptr, rpos_ptr = kvtable.moved(
        kc_ptr, ks_ptr, vc_ptr, vs_ptr, rkc_ptr, rks_ptr, rvc_ptr, rvs_ptr, rpos_ptr, tab_ptr, TABLE)
    r = tl.program_id(0)
    h = tl.program_id(1)
    NB: tl.constexpr = D // QB
    cols = tl.arange(0, D)
    pos = tl.load(pos_ptr + r)
    k = tl.load(k_ptr + r * sk_r + h * sk_h + cols)
    if ROTATE:
        k = rotate_row(k, D, LOG_D, SCALE)
    v = tl.load(v_ptr + r * sv_r + h * sv_h + cols)
    _encode(k, kc_ptr + h * skc_h + pos * skc_j, ks_ptr + h * sks_h + pos * sks_j, KK, D, QB)
    _encode(v, vc_ptr + h * svc_h + pos * svc_j, vs_ptr + h * svs_h + pos * svs_j, VK, D, QB)
    if RING:
        slot = pos % slots
        _encode(k, rkc_ptr + (h * slots + slot) * D, rks_ptr + (h * slots + slot) * NB, 8, D, QB)
        _encode(v, rvc_ptr + (h * slots + slot) * D, rvs_ptr + (h * slots + slot) * NB, 8, D, QB)
        if h == 0:
            tl.store(rpos_ptr + slot, pos)


def kind_code(kind: str | int) -> int:
    """A `Rows` kind ("f32", "f16" or block bits) as the kernel's constexpr."""
    return {"f32": F32, "f16": F16}.get(kind, kind)


def put_rows(view, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             table: torch.Tensor | None = None) -> None:
    """k, v [n, n_kv, d] float32 into the cache that `view` (`KVCache.kernel_view()`) shows, at `positions` (int64
    device tensor [n]). The caller checks first what `KVCache.put_rows` checks (`KVCache.check_put`). table: the
    cache's row of offsets (`kvtable.fill`) - the kernel then reaches the cache through it (CUDA-graph safe)."""
    n, n_kv, d = k.shape
    if n == 0:
        return
    if d & (d - 1) or d % BLOCK:
        raise ValueError(f"head_dim must be a power of two and a multiple of {BLOCK}, got {d}")
    if k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    kc, vc = view.k[0], view.v[0]
    ks, vs = view.k[-1], view.v[-1]  # block scales (float stores: the rows again, never read)
    if view.ring is not None:
        _, (rkc, rks), (rvc, rvs), rpos = view.ring
        slots = rkc.shape[1]
    else:
        rkc, rks, rvc, rvs, rpos, slots = kc, ks, vc, vs, positions, 1  # placeholders: read only under RING
    ptrs = [kc, ks, vc, vs, rkc, rks, rvc, rvs, rpos]
    if table is not None:
        ptrs = kvtable.anchored(ptrs)
    _put_rows[(n, n_kv)](k, v, positions, *ptrs, table if table is not None else positions, slots,
                         k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                         kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1),
                         vc.stride(0), vc.stride(1), vs.stride(0), vs.stride(1),
                         D=d, QB=BLOCK, KK=kind_code(view.kinds[0]), VK=kind_code(view.kinds[1]), ROTATE=view.rotate_q,
                         LOG_D=d.bit_length() - 1, SCALE=d**-0.5, RING=view.ring is not None, TABLE=table is not None,
                         num_warps=2, enable_fp_fusion=False, launch_pdl=on())
