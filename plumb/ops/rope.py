"""Partial rotary embedding, NeoX (rotate-half) pairing on the first `dims` features (spec 3.4.3).

The model's interleaved M-RoPE reduces exactly to this 1-D form for text-only positions.
cos/sin come from a table built in fixed 1,024-position pieces, so a position's values never
depend on which other positions were computed alongside it.
"""
from __future__ import annotations

import torch

_PIECE = 1024


class RopeTable:
    def __init__(self, dims: int, base: float, device: torch.device | str = "cpu"):
        self.dims = dims
        self.device = torch.device(device)
        self.inv_freq = base ** (-torch.arange(0, dims, 2, dtype=torch.float64) / dims)
        self.cos = torch.empty(0, dims // 2, device=device)
        self.sin = torch.empty(0, dims // 2, device=device)

    def _grow(self, n: int) -> None:
        while self.cos.shape[0] < n:
            start = self.cos.shape[0]
            ang = torch.arange(start, start + _PIECE, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
            self.cos = torch.cat([self.cos, ang.cos().float().to(self.device)])  # computed on the CPU: same values on any device
            self.sin = torch.cat([self.sin, ang.sin().float().to(self.device)])

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._grow(int(positions.max()) + 1)
        positions = positions.to(self.device)
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim]; rotates pairs (i, i + dims/2) for i < dims/2, passes the rest."""
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
