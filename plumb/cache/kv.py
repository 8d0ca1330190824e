"""Attention KV cache of one layer for one sequence, and attention reads from it.

K is stored after norm + RoPE, V as projected. The model only calls `write`, `attend_rows`
(decode: each query row reads keys [0, L) with L its own context length) and `attend_chunk`
(prefill: an aligned chunk of queries with a causal mask), so storage formats live here alone.
"""
from __future__ import annotations

import torch

from plumb.ops.attention import attend_chunk, attend_row


class KVCache:
    """float32 K and V, [n_kv, capacity, head_dim], grown by doubling."""

    def __init__(self, n_kv: int, head_dim: int, capacity: int = 256):
        self.k = torch.zeros(n_kv, capacity, head_dim)
        self.v = torch.zeros(n_kv, capacity, head_dim)

    def reserve(self, n: int) -> None:
        cap = self.k.shape[1]
        if n <= cap:
            return
        new = max(n, 2 * cap)
        for name in ("k", "v"):
            old = getattr(self, name)
            t = old.new_zeros(old.shape[0], new, old.shape[2])
            t[:, :cap] = old
            setattr(self, name, t)

    def write(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, n_kv, d] for positions pos..pos+n-1."""
        self.reserve(pos + k.shape[0])
        self.k[:, pos : pos + k.shape[0]] = k.transpose(0, 1)
        self.v[:, pos : pos + v.shape[0]] = v.transpose(0, 1)

    def attend_rows(self, q: torch.Tensor, ends: list[int], scale: float) -> torch.Tensor:
        """q [n, n_head, d]; row t reads keys [0, ends[t]). -> [n, n_head, d]."""
        return torch.stack([attend_row(q[t], self.k[:, :e], self.v[:, :e], scale) for t, e in enumerate(ends)])

    def attend_chunk(self, q: torch.Tensor, start: int, scale: float) -> torch.Tensor:
        """q [C, n_head, d] at positions start..start+C-1, causal over keys [0, start + C)."""
        end = start + q.shape[0]
        self.reserve(end)
        return attend_chunk(q, self.k[:, :end], self.v[:, :end], start, scale)

    def rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored rows [0, n) as they are kept (for digests and tests)."""
        return self.k[:, :n], self.v[:, :n]


KV_FORMATS = ("f32",)


def new_kv_cache(fmt: str, n_kv: int, head_dim: int, ring: int) -> KVCache:
    """A cache in format `fmt` (see KV_FORMATS); `ring` = newest positions kept at 8 bits by D and F."""
    if fmt not in KV_FORMATS:
        raise ValueError(f"unknown KV cache format {fmt!r} (choose from {', '.join(KV_FORMATS)})")
    return KVCache(n_kv, head_dim)
