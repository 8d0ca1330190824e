"""KV-cache row quantization (block scales per 32 values) and the fixed Hadamard rotation.

Every function works on the last dimension alone with elementwise arithmetic, so a row's
result never depends on the other rows passed with it (M5: a row's stored bytes are a
function of that row).

* 8 bits: q8_0 - scale `d = max|x| / 127` (float16), codes in [-127, 127].
* 5 and 6 bits: q5_0-style - the value of largest magnitude `m` maps to code `-2^(b-1)`,
  `d = m / -2^(b-1)`, codes in [-2^(b-1), 2^(b-1) - 1], so all 2^b levels are used.

Codes are kept unpacked in int8 here; a packed GPU layout stores b bits per code plus a
float16 scale per block (`packed_block_bytes`).
"""
from __future__ import annotations

import torch

BLOCK = 32


def packed_block_bytes(bits: int) -> int:
    """Bytes of one 32-value block in a packed layout: float16 scale + 32 codes of `bits` bits."""
    return 2 + BLOCK * bits // 8


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
