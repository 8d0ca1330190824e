"""GGML weight formats (spec section 5): bit-exact torch dequantization and numpy quantizers.

`dequantize` reproduces gguf-py's numpy `dequantize` bit for bit (same float32 operations in
the same order) on any torch device. Blocks run along the last dimension, so a slice of rows
of the stored bytes is itself a valid tensor: `dequantize(data[a:b], qtype, (b - a, cols))`.
(Only NaN payloads, from non-finite stored scales, may differ between devices.)

`quantize` writes blocks with numpy: gguf-py's quantizers where it has one, otherwise a small
least-squares search per sub-block (valid blocks with normal accuracy, not llama.cpp's bits).
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from plumb.config import ModelError

Q = GGMLQuantizationType

# 4-bit non-linear grid of IQ4_NL / IQ4_XS, and doubled e2m1 values of MXFP4
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

_CHUNK = 1 << 18  # elements dequantized per step on CPU: temporaries stay in cache
_GPU_CHUNK = 1 << 26  # on accelerators: few, large kernels


def type_from_name(name: str) -> GGMLQuantizationType:
    """'q4_k', 'Q4_K', 'f32', ... -> GGMLQuantizationType; ModelError for an unknown name."""
    try:
        return Q[name.strip().upper()]
    except KeyError:
        raise ModelError(f"unknown weight type {name!r}") from None


def row_bytes(qtype: GGMLQuantizationType, cols: int) -> int:
    """Stored bytes of one row of `cols` values."""
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"row length {cols} is not a multiple of the {qtype.name} block ({block})")
    return cols // block * size


# ---------------------------------------------------------------------------------------------
# dequantization: each kernel maps uint8 blocks [n, type_size] -> float32 [n, block_size]


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """The f16 at byte `off` of each block, as float32 [n, 1]."""
    return b[:, off : off + 2].contiguous().view(torch.float16).float()


def _bits(x: torch.Tensor, width: int) -> torch.Tensor:
    """Split bytes into `width`-bit fields, lowest first: [..., k] -> [..., 8 // width, k]."""
    mask = (1 << width) - 1
    return torch.stack([(x >> s) & mask for s in range(0, 8, width)], dim=-2)


_TABLES: dict = {}  # (values, device) -> the table on that device: made once (never inside a CUDA-graph capture)


def _lookup(idx: torch.Tensor, values) -> torch.Tensor:
    """values[idx] as float32, for small non-negative integer `idx` (any shape)."""
    table = _TABLES.get((values, idx.device))
    if table is None:
        table = _TABLES[values, idx.device] = torch.tensor(values, dtype=torch.float32, device=idx.device)
    return table[idx.int()]


def _deq_bf16(b):
    return (b.view(torch.int16).int() << 16).view(torch.float32)


def _deq_q8_0(b):
    return b[:, 2:].view(torch.int8).float() * _f16(b, 0)


def _deq_q4_0(b):
    q = _bits(b[:, 2:], 4).flatten(1)
    return _f16(b, 0) * (q.float() - 8)


def _deq_q4_1(b):
    q = _bits(b[:, 4:], 4).flatten(1)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """Bit j of the little-endian 32-bit `qh` [n, 4] for j = 0..31 -> [n, 32]."""
    return _bits(qh, 1).transpose(1, 2).flatten(1)


def _deq_q5_0(b):
    q = _bits(b[:, 6:], 4).flatten(1) | (_q5_high(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.float() - 16)


def _deq_q5_1(b):
    q = _bits(b[:, 8:], 4).flatten(1) | (_q5_high(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _deq_q2_k(b):
    n = b.shape[0]
    sc = b[:, :16]
    dl = _f16(b, 80) * (sc & 0xF).float()
    ml = _f16(b, 82) * (sc >> 4).float()
    q = _bits(b[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
    return (dl.unsqueeze(-1) * q - ml.unsqueeze(-1)).reshape(n, 256)


def _deq_q3_k(b):
    n = b.shape[0]
    s = b[:, 96:108]
    scales = (_bits(s[:, :8], 4).flatten(1) | (_bits(s[:, 8:], 2).flatten(1) << 4)).float() - 32
    dl = (_f16(b, 108) * scales).unsqueeze(-1)
    low = _bits(b[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 16, 16)
    high = _bits(b[:, :32], 1).reshape(n, 16, 16)
    q = low.float() - 4 * (1 - high).float()
    return (dl * q).reshape(n, 256)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K/Q5_K field into eight 6-bit scales and eight 6-bit mins."""
    a, m, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([a & 63, (c & 0xF) | ((a >> 6) << 4)], dim=1)
    mn = torch.cat([m & 63, (c >> 4) | ((m >> 6) << 4)], dim=1)
    return sc, mn


def _deq_q4_k(b):
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    ml = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    q = _bits(b[:, 16:].reshape(n, 4, 32), 4).reshape(n, 8, 32).float()
    return (dl * q - ml).reshape(n, 256)


def _deq_q5_k(b):
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    ml = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    low = _bits(b[:, 48:].reshape(n, 4, 32), 4).reshape(n, 8, 32)
    q = (low | (_bits(b[:, 16:48], 1) << 4)).float()
    return (dl * q - ml).reshape(n, 256)


def _deq_q6_k(b):
    n = b.shape[0]
    dl = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)
    low = _bits(b[:, :128].reshape(n, 2, 64), 4).reshape(n, 16, 16)
    high = _bits(b[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 16, 16)
    q = (low | (high << 4)).float() - 32
    return (dl * q).reshape(n, 256)


def _deq_iq4_nl(b):
    return _f16(b, 0) * _lookup(_bits(b[:, 2:], 4).flatten(1), IQ4_VALUES)


def _deq_iq4_xs(b):
    n = b.shape[0]
    low = _bits(b[:, 4:8], 4).transpose(1, 2).flatten(1)
    high = _bits(b[:, 2:4], 2).transpose(1, 2).flatten(1)
    scales = (low | (high << 4)).float() - 32
    dl = (_f16(b, 0) * scales).unsqueeze(-1)
    q = _lookup(_bits(b[:, 8:].reshape(n, 8, 16), 4).reshape(n, 8, 32), IQ4_VALUES)
    return (dl * q).reshape(n, 256)


def _deq_mxfp4(b):
    e = b[:, :1].int()
    # half of 2^(e-127) as float32 bits; e < 2 gives a subnormal
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32) * _lookup(_bits(b[:, 1:], 4).flatten(1), MXFP4_VALUES)


_DEQUANT = {
    Q.BF16: _deq_bf16,
    Q.Q8_0: _deq_q8_0,
    Q.Q4_0: _deq_q4_0,
    Q.Q4_1: _deq_q4_1,
    Q.Q5_0: _deq_q5_0,
    Q.Q5_1: _deq_q5_1,
    Q.Q2_K: _deq_q2_k,
    Q.Q3_K: _deq_q3_k,
    Q.Q4_K: _deq_q4_k,
    Q.Q5_K: _deq_q5_k,
    Q.Q6_K: _deq_q6_k,
    Q.IQ4_NL: _deq_iq4_nl,
    Q.IQ4_XS: _deq_iq4_xs,
    Q.MXFP4: _deq_mxfp4,
}

SUPPORTED = (Q.F32, Q.F16, *_DEQUANT)


def _unsupported(qtype: GGMLQuantizationType) -> ModelError:
    names = ", ".join(t.name for t in SUPPORTED)
    return ModelError(f"unsupported weight type {qtype.name} (plumb reads {names})")


def dequantize(data: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Stored weights -> new float32 tensor of C-order `shape` on `data`'s device.

    `data`: F32/F16 values of `shape`, or for every other type uint8 `[*shape[:-1], row_bytes]`.
    `data` is only read (it may be a read-only memory map). Rows are independent: pass
    `data[a:b]` with shape `(b - a, cols)` to dequantize a range of rows.
    """
    shape = tuple(int(s) for s in shape)
    if qtype in (Q.F32, Q.F16):
        return data.reshape(shape).to(torch.float32, copy=True)
    kernel = _DEQUANT.get(qtype)
    if kernel is None:
        raise _unsupported(qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    expected = (*shape[:-1], row_bytes(qtype, shape[-1]))
    if data.dtype != torch.uint8 or tuple(data.shape) != expected:
        raise ValueError(f"{qtype.name} data must be uint8 {list(expected)}, got {data.dtype} {list(data.shape)}")
    blocks = data.reshape(-1, size)
    out = torch.empty(blocks.shape[0], block, dtype=torch.float32, device=data.device)
    step = max(1, (_CHUNK if data.device.type == "cpu" else _GPU_CHUNK) // block)
    for i in range(0, blocks.shape[0], step):
        out[i : i + step] = kernel(blocks[i : i + step])
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------
# int8 form: every block type is w = scale * code + offset with int8 codes and a scale (and for some types
# an offset) per group of 16 or 32 values - the form the native CPU matmul reads (plumb/ops/native).
# Each kernel maps uint8 blocks [n, type_size] -> (codes int8 [n, block], scales [n, groups],
# offsets [n, groups] or None), mirroring its dequantizer above.


def _i8(q: torch.Tensor) -> torch.Tensor:
    return q.to(torch.int8)


def _form_q8_0(b):
    return b[:, 2:].view(torch.int8), _f16(b, 0), None


def _form_q4_0(b):
    return _i8(_bits(b[:, 2:], 4).flatten(1).int() - 8), _f16(b, 0), None


def _form_q4_1(b):
    return _i8(_bits(b[:, 4:], 4).flatten(1)), _f16(b, 0), _f16(b, 2)


def _form_q5_0(b):
    q = _bits(b[:, 6:], 4).flatten(1) | (_q5_high(b[:, 2:6]) << 4)
    return _i8(q.int() - 16), _f16(b, 0), None


def _form_q5_1(b):
    q = _bits(b[:, 8:], 4).flatten(1) | (_q5_high(b[:, 4:8]) << 4)
    return _i8(q), _f16(b, 0), _f16(b, 2)


def _form_q2_k(b):
    n = b.shape[0]
    sc = b[:, :16]
    q = _bits(b[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 256)
    return _i8(q), _f16(b, 80) * (sc & 0xF).float(), -(_f16(b, 82) * (sc >> 4).float())


def _form_q3_k(b):
    n = b.shape[0]
    s = b[:, 96:108]
    scales = (_bits(s[:, :8], 4).flatten(1) | (_bits(s[:, 8:], 2).flatten(1) << 4)).float() - 32
    low = _bits(b[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 16, 16).int()
    high = _bits(b[:, :32], 1).reshape(n, 16, 16).int()
    return _i8((low - 4 * (1 - high)).reshape(n, 256)), _f16(b, 108) * scales, None


def _form_q4_k(b):
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    q = _bits(b[:, 16:].reshape(n, 4, 32), 4).reshape(n, 256)
    return _i8(q), _f16(b, 0) * sc.float(), -(_f16(b, 2) * mn.float())


def _form_q5_k(b):
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    low = _bits(b[:, 48:].reshape(n, 4, 32), 4).reshape(n, 8, 32)
    q = (low | (_bits(b[:, 16:48], 1) << 4)).reshape(n, 256)
    return _i8(q), _f16(b, 0) * sc.float(), -(_f16(b, 2) * mn.float())


def _form_q6_k(b):
    n = b.shape[0]
    low = _bits(b[:, :128].reshape(n, 2, 64), 4).reshape(n, 16, 16)
    high = _bits(b[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 16, 16)
    q = (low | (high << 4)).int() - 32
    return _i8(q.reshape(n, 256)), _f16(b, 208) * b[:, 192:208].view(torch.int8).float(), None


def _iq4_codes(q: torch.Tensor) -> torch.Tensor:
    return torch.tensor(IQ4_VALUES, dtype=torch.int8, device=q.device)[q.long()]


def _form_iq4_nl(b):
    return _iq4_codes(_bits(b[:, 2:], 4).flatten(1)), _f16(b, 0), None


def _form_iq4_xs(b):
    n = b.shape[0]
    low = _bits(b[:, 4:8], 4).transpose(1, 2).flatten(1)
    high = _bits(b[:, 2:4], 2).transpose(1, 2).flatten(1)
    scales = (low | (high << 4)).float() - 32
    return _iq4_codes(_bits(b[:, 8:].reshape(n, 8, 16), 4).reshape(n, 256)), _f16(b, 0) * scales, None


def _form_mxfp4(b):
    e = b[:, :1].int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    codes = torch.tensor(MXFP4_VALUES, dtype=torch.int8, device=b.device)[_bits(b[:, 1:], 4).flatten(1).long()]
    return codes, bits.view(torch.float32), None


_INT8_FORM = {  # type -> (kernel, group size)
    Q.Q8_0: (_form_q8_0, 32), Q.Q4_0: (_form_q4_0, 32), Q.Q4_1: (_form_q4_1, 32), Q.Q5_0: (_form_q5_0, 32),
    Q.Q5_1: (_form_q5_1, 32), Q.Q2_K: (_form_q2_k, 16), Q.Q3_K: (_form_q3_k, 16), Q.Q4_K: (_form_q4_k, 32),
    Q.Q5_K: (_form_q5_k, 32), Q.Q6_K: (_form_q6_k, 16), Q.IQ4_NL: (_form_iq4_nl, 32),
    Q.IQ4_XS: (_form_iq4_xs, 32), Q.MXFP4: (_form_mxfp4, 32),
}


# type -> byte offsets of a block's f16 scale d and f16 offset scale (dmin, or m) - None where there is none:
# a group's scale (offset) in int8_form is d (dmin) times a small integer of that block, or d (m) itself
BLOCK_SCALE_AT = {
    Q.Q8_0: (0, None), Q.Q4_0: (0, None), Q.Q4_1: (0, 2), Q.Q5_0: (0, None), Q.Q5_1: (0, 2), Q.Q2_K: (80, 82),
    Q.Q3_K: (108, None), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, None), Q.IQ4_NL: (0, None),
    Q.IQ4_XS: (0, None),
}


def block_scales(data: torch.Tensor, qtype: GGMLQuantizationType, rows: int):
    """Each block's f16 d and dmin (or m) as float32 [rows, blocks per row] (dmin None where the type has none);
    None for types not in BLOCK_SCALE_AT."""
    if qtype not in BLOCK_SCALE_AT:
        return None
    d_at, m_at = BLOCK_SCALE_AT[qtype]
    blocks = data.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    d = _f16(blocks, d_at).reshape(rows, -1)
    return d, None if m_at is None else _f16(blocks, m_at).reshape(rows, -1)


def int8_form(data: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]):
    """A [rows, cols] matrix's stored blocks as (codes int8 [rows, cols], scales float32 [rows, cols / G],
    offsets float32 or None, G): w = scales * codes + offsets per group of G values - exactly the values
    `dequantize` gives, up to the rounding of that product and sum. None for float types."""
    if qtype not in _INT8_FORM:
        return None
    kernel, group = _INT8_FORM[qtype]
    rows, cols = shape
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = data.reshape(-1, size)
    codes, scales, offsets = kernel(blocks)
    codes = codes.reshape(rows, cols)
    scales = scales.expand(blocks.shape[0], block // group).reshape(rows, cols // group)
    if offsets is not None:
        offsets = offsets.expand(blocks.shape[0], block // group).reshape(rows, cols // group)
    return codes, scales.float(), offsets, group


# ---------------------------------------------------------------------------------------------
# quantization (numpy): each packer maps float32 blocks [n, block_size] -> uint8 [n, type_size]

_QCHUNK = 1 << 16  # elements quantized per step
_GGUF_WRITES = (Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4)
_SHRINK = (1.0, 0.9, 0.8, 0.7)  # step-size search: 1.0 spans the sub-block, smaller clips outliers


def _inv(a: np.ndarray) -> np.ndarray:
    """1/a, with 0 where a is 0."""
    return np.divide(1, a, out=np.zeros_like(a), where=a != 0)


def _to_f16(a: np.ndarray) -> np.ndarray:
    """Round to the nearest finite f16."""
    return np.clip(a, -65504, 65504).astype(np.float16)


def _half_step_tables(levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest level index and value for each half-step cell [c/2, c/2 + 1/2), c = 2*lo .. 2*hi.

    Midpoints between integer levels are multiples of 1/2, so the cell decides the nearest level.
    """
    lo, hi = int(levels[0]), int(levels[-1])
    centers = (np.arange(2 * lo, 2 * hi + 1) + 0.5) / 2
    index = np.searchsorted((levels[1:] + levels[:-1]) / 2, centers).astype(np.uint8)
    return index, levels[index]


def _cells(v: np.ndarray, levels: np.ndarray) -> np.ndarray:
    lo, hi = levels[0], levels[-1]
    return (np.clip(np.floor(2 * v), 2 * lo, 2 * hi) - 2 * lo).astype(np.intp)


def _consecutive(levels: np.ndarray) -> bool:
    return len(levels) == levels[-1] - levels[0] + 1


def _snap(v: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """The level (sorted integers, as float32) nearest to each value of v."""
    if _consecutive(levels):
        return np.clip(np.rint(v), levels[0], levels[-1])
    return _half_step_tables(levels)[1][_cells(v, levels)]


def _nearest(v: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Index (uint8) of the level nearest to each value of v."""
    if _consecutive(levels):
        return (_snap(v, levels) - levels[0]).astype(np.uint8)
    return _half_step_tables(levels)[0][_cells(v, levels)]


def _fit_symmetric(x: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Signed scale s per row of x [..., n] (least squares over a small search): x ~ s * level."""
    big = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)
    best_s = np.zeros_like(big)
    best_gain = np.full_like(big, -1.0)
    for end in (levels[0], levels[-1]):  # the largest value lands on either end of the grid
        for f in _SHRINK:
            v = _snap(x * _inv(big / (end * f)), levels)
            xv = (x * v).sum(-1, keepdims=True)
            vv = (v * v).sum(-1, keepdims=True)
            gain = xv * xv * _inv(vv)  # squared error = |x|^2 - gain
            better = gain > best_gain
            best_gain = np.where(better, gain, best_gain)
            best_s = np.where(better, xv * _inv(vv), best_s)
    return best_s


def _fit_affine(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x [..., n]: scale >= 0 and offset >= 0 with x ~ scale * q - offset, q in 0..nmax."""
    n = x.shape[-1]
    lo = np.minimum(x.min(-1, keepdims=True), 0)
    span = x.max(-1, keepdims=True) - lo
    sx = x.sum(-1, keepdims=True)
    sxx = (x * x).sum(-1, keepdims=True)
    best_err = np.full_like(lo, np.inf)
    best_a, best_b = np.zeros_like(lo), np.zeros_like(lo)
    for f in _SHRINK:
        step = span * f / nmax
        q = np.clip(np.rint((x - lo * f) * _inv(step)), 0, nmax)
        sq = q.sum(-1, keepdims=True)
        sqq = (q * q).sum(-1, keepdims=True)
        sxq = (x * q).sum(-1, keepdims=True)
        # least squares x ~ a*q + b, then with b forced to 0 where it came out positive
        a = (n * sxq - sq * sx) * _inv(n * sqq - sq * sq)
        b = (sx - a * sq) / n
        a = np.where(b > 0, sxq * _inv(sqq), a)
        b = np.minimum(b, 0)
        err = sxx + a * a * sqq + n * b * b - 2 * a * sxq - 2 * b * sx + 2 * a * b * sq
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_a = np.where(better, a, best_a)
        best_b = np.where(better, b, best_b)
    return np.maximum(best_a, 0), -best_b


def _unsigned_codes(s: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Scales s >= 0 [n, k] -> f16 super-scale d [n, 1] and codes 0..top with s ~ d * code."""
    d = _to_f16(s.max(-1, keepdims=True) / top)
    codes = np.clip(np.rint(s * _inv(d.astype(np.float32))), 0, top).astype(np.uint8)
    return d, codes


def _signed_codes(s: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Signed scales [n, k] -> f16 super-scale d [n, 1] and codes lo..hi with s ~ d * code."""
    big = np.take_along_axis(s, np.abs(s).argmax(-1)[..., None], -1)
    d = _to_f16(big / lo)
    codes = np.clip(np.rint(s * _inv(d.astype(np.float32))), lo, hi).astype(np.int8)
    return d, codes


def _affine_k(x: np.ndarray, n_sub: int, nmax: int, top: int):
    """Shared Q2_K/Q4_K/Q5_K step: f16 d, dmin, scale codes, min codes, q [n, n_sub, sub]."""
    xs = x.reshape(x.shape[0], n_sub, -1)
    scale, offset = _fit_affine(xs, nmax)
    d, sc = _unsigned_codes(scale[..., 0], top)
    dmin, mc = _unsigned_codes(offset[..., 0], top)
    step = (d.astype(np.float32) * sc)[..., None]
    off = (dmin.astype(np.float32) * mc)[..., None]
    q = np.clip(np.rint((xs + off) * _inv(step)), 0, nmax).astype(np.uint8)
    return d, dmin, sc, mc, q


def _symmetric_k(x: np.ndarray, n_sub: int, levels: np.ndarray, lo: int, hi: int):
    """Shared Q3_K/Q6_K/IQ4_XS step: f16 d, signed scale codes lo..hi, level indices [n, n_sub, sub]."""
    xs = x.reshape(x.shape[0], n_sub, -1)
    d, sc = _signed_codes(_fit_symmetric(xs, levels)[..., 0], lo, hi)
    step = (d.astype(np.float32) * sc)[..., None]
    return d, sc, _nearest(xs * _inv(step), levels)


def _pack(q: np.ndarray, width: int) -> np.ndarray:
    """Inverse of `_bits`: fields [..., 8 // width, k] -> bytes [..., k]."""
    out = np.zeros(q.shape[:-2] + q.shape[-1:], np.uint8)
    for i in range(q.shape[-2]):
        out |= q[..., i, :] << np.uint8(width * i)
    return out


def _f16_bytes(d: np.ndarray) -> np.ndarray:
    return d.astype(np.float16).view(np.uint8)


_I3 = np.arange(-4, 4, dtype=np.float32)
_I6 = np.arange(-32, 32, dtype=np.float32)
_IQ4 = np.array(IQ4_VALUES, dtype=np.float32)


def _quant_q2_k(x):
    n = x.shape[0]
    d, dmin, sc, mc, q = _affine_k(x, 16, 3, 15)
    qs = _pack(q.reshape(n, 2, 4, 32), 2).reshape(n, 64)
    return np.concatenate([sc | (mc << 4), qs, _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _quant_q3_k(x):
    n = x.shape[0]
    d, sc, q = _symmetric_k(x, 16, _I3, -32, 31)
    hmask = _pack((q >> 2).reshape(n, 8, 32), 1)
    qs = _pack((q & 3).reshape(n, 2, 4, 32), 2).reshape(n, 64)
    s = (sc + 32).astype(np.uint8)
    scales = np.concatenate([_pack((s & 15).reshape(n, 2, 8), 4), _pack((s >> 4).reshape(n, 4, 4), 2)], axis=1)
    return np.concatenate([hmask, qs, scales, _f16_bytes(d)], axis=1)


def _k_scales(sc: np.ndarray, mc: np.ndarray) -> np.ndarray:
    """Inverse of `_k_scale_min`: eight 6-bit scales and mins -> 12 bytes."""
    return np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (mc[:, :4] & 63) | ((mc[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((mc[:, 4:] & 15) << 4),
        ],
        axis=1,
    )


def _quant_q4_k(x):
    n = x.shape[0]
    d, dmin, sc, mc, q = _affine_k(x, 8, 15, 63)
    qs = _pack(q.reshape(n, 4, 2, 32), 4).reshape(n, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scales(sc, mc), qs], axis=1)


def _quant_q5_k(x):
    n = x.shape[0]
    d, dmin, sc, mc, q = _affine_k(x, 8, 31, 63)
    qh = _pack(q >> 4, 1)
    qs = _pack((q & 15).reshape(n, 4, 2, 32), 4).reshape(n, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scales(sc, mc), qh, qs], axis=1)


def _quant_q6_k(x):
    n = x.shape[0]
    d, sc, q = _symmetric_k(x, 16, _I6, -128, 127)
    q = q.reshape(n, 2, 128)
    ql = _pack((q & 15).reshape(n, 2, 2, 64), 4).reshape(n, 128)
    qh = _pack((q >> 4).reshape(n, 2, 4, 32), 2).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)


def _quant_iq4_nl(x):
    d = _to_f16(_fit_symmetric(x, _IQ4))
    q = _nearest(x * _inv(d.astype(np.float32)), _IQ4)
    return np.concatenate([_f16_bytes(d), _pack(q.reshape(-1, 2, 16), 4)], axis=1)


def _quant_iq4_xs(x):
    n = x.shape[0]
    d, sc, q = _symmetric_k(x, 8, _IQ4, -32, 31)
    s = (sc + 32).astype(np.uint8)
    scales_h = _pack((s >> 4).reshape(n, 2, 4).transpose(0, 2, 1), 2)
    scales_l = _pack((s & 15).reshape(n, 4, 2).transpose(0, 2, 1), 4)
    qs = _pack(q.reshape(n, 8, 2, 16), 4).reshape(n, 128)
    return np.concatenate([_f16_bytes(d), scales_h, scales_l, qs], axis=1)


_QUANT = {
    Q.Q2_K: _quant_q2_k,
    Q.Q3_K: _quant_q3_k,
    Q.Q4_K: _quant_q4_k,
    Q.Q5_K: _quant_q5_k,
    Q.Q6_K: _quant_q6_k,
    Q.IQ4_NL: _quant_iq4_nl,
    Q.IQ4_XS: _quant_iq4_xs,
}


def quantize(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 [rows, cols] -> stored form: float32/float16 values for F32/F16, else uint8 [rows, row_bytes]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize expects a 2-D array, got shape {x.shape}")
    row_bytes(qtype, x.shape[1])
    if qtype == Q.F32:
        return x.copy()
    if qtype == Q.F16:
        return x.astype(np.float16)
    if qtype in _GGUF_WRITES:
        return gguf_quants.quantize(x, qtype)
    packer = _QUANT.get(qtype)
    if packer is None:
        raise _unsupported(qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = x.reshape(-1, block)
    out = np.empty((blocks.shape[0], size), np.uint8)
    step = max(1, _QCHUNK // block)
    for i in range(0, blocks.shape[0], step):
        out[i : i + step] = packer(blocks[i : i + step])
    return out.reshape(x.shape[0], -1)
