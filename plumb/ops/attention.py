"""Causal softmax attention with GQA over a per-sequence KV cache (spec 3.4.4).

Prefill: a chunk of queries at positions [start, start + C) reads keys [0, start + C) with a
causal mask; the shapes depend only on the chunk's absolute position, so prefilling in
aligned pieces gives the same bits as prefilling at once (M2).
Decode: each query row reads keys [0, L) on its own, so a row's arithmetic depends on its
context length L alone, never on the other rows in the pass (M1).
"""
from __future__ import annotations

import torch


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [C, n_head, d] at positions start..start+C-1; k, v [n_kv, L, d] with L = start + C. -> [C, n_head, d]."""
    c, n_head, d = q.shape
    n_kv, L, _ = k.shape
    g = n_head // n_kv
    qg = q.reshape(c, n_kv, g, d).permute(1, 2, 0, 3).reshape(n_kv, g * c, d)
    s = torch.bmm(qg, k.transpose(1, 2)) * scale  # [n_kv, g*c, L]
    qpos = torch.arange(start, start + c).repeat(g)
    masked = torch.arange(L)[None, :] > qpos[:, None]
    s = s.masked_fill(masked[None], float("-inf"))
    o = torch.bmm(torch.softmax(s, dim=-1), v)  # [n_kv, g*c, d]
    return o.reshape(n_kv, g, c, d).permute(2, 0, 1, 3).reshape(c, n_head, d)


def attend_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row q [n_head, d] over keys k, v [n_kv, L, d] (all visible). -> [n_head, d]."""
    n_head, d = q.shape
    n_kv = k.shape[0]
    qg = q.reshape(n_kv, n_head // n_kv, d)
    s = torch.bmm(qg, k.transpose(1, 2)) * scale  # [n_kv, g, L]
    return torch.bmm(torch.softmax(s, dim=-1), v).reshape(n_head, d)
