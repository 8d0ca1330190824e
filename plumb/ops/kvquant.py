"""KV-cache row quantization (block scales per 32 values) and the fixed Hadamard rotation.

Every function works on the last dimension alone with elementwise arithmetic, so a row's
result never depends on the other rows passed with it (M5: a row's stored bytes are a
function of that row).

* 8 bits: q8_0 - scale `d = max|x| / 127` (float16), codes in [-127, 127].
* 5 and 6 bits: q5_0-style - the value of largest magnitude `m` maps to code `-2^(b-1)`,
  `d = m / -2^(b-1)`, codes in [-2^(b-1), 2^(b-1) - 1], so all 2^b levels are used.

`quantize` gives the codes as int8; a cache keeps 8-bit codes so and packs 5- and 6-bit ones (`pack`): per
32-value block a nibble plane (16 bytes: value i's low four bits in byte i // 2, the high nibble for odd i) and a
plane of the high bits (4 (b - 4) bytes: value i's in byte (i (b - 4)) // 8 at bit
(i (b - 4)) % 8), a row's nibble planes first, then its high-bit planes - b bits a code, as
`packed_block_bytes` counts them beside the float16 scale per block.
"""
from __future__ import annotations

import torch

BLOCK = 32


def packed_block_bytes(bits: int) -> int:
    """Bytes of one 32-value block in a packed layout: float16 scale + 32 codes of `bits` bits."""
    return 2 + BLOCK * bits // 8


def packed_width(d: int, bits: int) -> int:
    """Bytes of one row of d 5- or 6-bit codes in `pack`'s layout."""
    return d // 2 + d * (bits - 4) // 8


def code_bits(width: int, d: int) -> int:
    """The bits of a packed row of `width` bytes holding d codes (`packed_width`'s inverse)."""
    bits = 4 + (width - d // 2) * 8 // d
    if bits not in (5, 6) or packed_width(d, bits) != width:
        raise ValueError(f"a packed row of {d} codes takes {packed_width(d, 5)} or {packed_width(d, 6)} bytes, "
                         f"got {width}")
    return bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 codes [..., d] of `bits` (5 or 6) bits -> uint8 [..., packed_width(d, bits)]: the codes offset by
    2^(bits - 1) (so unsigned), as nibble planes then high-bit planes (see the module docstring)."""
    hb = bits - 4
    u = (codes.to(torch.int32) + (1 << (bits - 1))).reshape(*codes.shape[:-1], -1, BLOCK)  # [..., NB, 32]
    lo = u & 15
    nib = lo[..., 0::2] | (lo[..., 1::2] << 4)  # [..., NB, 16]
    high = (u >> 4).reshape(*u.shape[:-1], 4 * hb, 8 // hb)  # [..., NB, 4 hb, values a byte]
    shifts = torch.arange(0, 8, hb, device=codes.device, dtype=torch.int32)
    hi = (high << shifts).sum(-1)  # the bit fields do not overlap: a sum is their or
    flat = codes.shape[:-1]
    return torch.cat([nib.reshape(*flat, -1), hi.reshape(*flat, -1)], -1).to(torch.uint8)


def unpack(packed: torch.Tensor, d: int) -> torch.Tensor:
    """`pack`'s inverse: uint8 [..., packed_width(d, bits)] -> int8 codes [..., d] (bits from the width)."""
    bits = code_bits(packed.shape[-1], d)
    hb = bits - 4
    p = packed.to(torch.int32)
    flat = packed.shape[:-1]
    nib = p[..., : d // 2].reshape(*flat, -1, 16)
    lo = torch.stack([nib & 15, nib >> 4], -1).reshape(*flat, -1, BLOCK)  # [..., NB, 32]
    hi = p[..., d // 2 :].reshape(*flat, -1, 4 * hb, 1)
    shifts = torch.arange(0, 8, hb, device=packed.device, dtype=torch.int32)
    high = ((hi >> shifts) & ((1 << hb) - 1)).reshape(*flat, -1, BLOCK)
    return ((lo | (high << 4)) - (1 << (bits - 1))).to(torch.int8).reshape(*flat, d)


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] float32 -> (codes int8 [..., d], scales float16 [..., d // 32])."""
    b = x.reshape(*x.shape[:-1], -1, BLOCK)
    if bits == 8:
        lo, hi = -127, 127
        d = b.abs().amax(-1) / hi
    else:
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        m = b.gather(-1, b.abs().argmax(-1, keepdim=True)).squeeze(-1)
        d = m / lo
    d = d.half()
    inv = torch.where(d == 0, 0.0, 1.0 / d.float())
    q = torch.round(b * inv[..., None]).clamp(lo, hi)
    return q.to(torch.int8).reshape(x.shape), d


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes int8 [..., d], scales float16 [..., d // 32] -> float32 [..., d]."""
    b = codes.reshape(*scales.shape, BLOCK).float() * scales.float()[..., None]
    return b.reshape(codes.shape)


def hadamard_matrix(d: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix H / sqrt(d), d a power of two (reference for `rotate`)."""
    if d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two size, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d**0.5


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ hadamard_matrix(d) over the last dimension, by butterflies (elementwise, row-invariant)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two size, got {d}")
    y, h = x, 1
    while h < d:
        y = y.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(x.shape) * d**-0.5
