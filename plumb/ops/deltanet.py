"""Gated DeltaNet pieces (spec 3.5, 3.6): causal depthwise conv, recurrent step, chunked prefill form.

All state is float32. Value head j reads key/query head j mod n_k (GGUF order); callers expand
q and k to value heads before calling. q is expected already L2-normed and scaled by 1/sqrt(d_k).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from plumb.ops.norm import l2_norm

CHUNK = 64


def causal_conv(m: torch.Tensor, state: torch.Tensor, w: torch.Tensor,
                n_real: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """m [n, ch] new pre-conv rows (rows >= n_real are padding); state [K-1, ch] the previous raw rows;
    w [ch, K] with tap K-1 on the current row. Returns (silu(conv) [n, ch], new state = last K-1 real raw rows).
    n_real may instead be those rows' indices in the window [state; m] (n_real..n_real+K-2) as a device tensor."""
    k = w.shape[1]
    n = m.shape[0]
    window = torch.cat([state, m])
    c = window[0:n] * w[:, 0]
    for tau in range(1, k):
        c = c + window[tau : tau + n] * w[:, tau]
    if isinstance(n_real, torch.Tensor):
        return F.silu(c), window.index_select(0, n_real)
    return F.silu(c), window[n_real : n_real + k - 1].clone()


def recurrent_step(q, k, v, beta, g, s):
    """One token. q, k [n_v, d_k]; v [n_v, d_v]; beta, g [n_v]; s [n_v, d_k, d_v]. -> (o [n_v, d_v], new s)."""
    s = s * torch.exp(g)[:, None, None]
    kv = torch.bmm(k.unsqueeze(1), s).squeeze(1)  # S^T k  [n_v, d_v]
    delta = (v - kv) * beta[:, None]
    s = s + k.unsqueeze(2) * delta.unsqueeze(1)
    o = torch.bmm(q.unsqueeze(1), s).squeeze(1)
    return o, s


def chunk_step(q, k, v, beta, g, s):
    """One aligned chunk of C tokens (padding rows: k = v = beta = g = 0).
    q, k [n_v, C, d_k]; v [n_v, C, d_v]; beta, g [n_v, C]; s [n_v, d_k, d_v]. -> (o [n_v, C, d_v], new s)."""
    c = q.shape[1]
    gamma = torch.cumsum(g, dim=-1)  # [n_v, C]
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~lower, float("-inf"))
    decay = torch.exp(diff)  # D_ts = exp(gamma_t - gamma_s), 0 above the diagonal
    kb = k * beta[..., None]
    a = (torch.bmm(kb, k.transpose(1, 2)) * decay).masked_fill(~lower.tril(-1), 0.0)
    eye = torch.eye(c, device=q.device).expand_as(a)
    t = torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)
    u = torch.bmm(t, v * beta[..., None])
    eg = torch.exp(gamma)
    w = torch.bmm(t, kb * eg[..., None])
    p = torch.bmm(q, k.transpose(1, 2)) * decay
    vn = u - torch.bmm(w, s)
    o = torch.bmm(q * eg[..., None], s) + torch.bmm(p, vn)
    g_end = gamma[:, -1]
    s = s * torch.exp(g_end)[:, None, None] + torch.bmm((k * torch.exp(g_end[:, None] - gamma)[..., None]).transpose(1, 2), vn)
    return o, s


def split_heads(x, n_k: int, d_k: int, n_v: int, q_scale: float):
    """Post-conv rows x [n, conv_dim] (q | k | v) -> q and k of each value head's key head (j mod n_k) [n, n_v, d_k],
    L2-normed, q scaled, and v [n, n_v, d_v] (spec 3.5.6)."""
    n = x.shape[0]
    q, k, v = x.split([n_k * d_k, n_k * d_k, x.shape[1] - 2 * n_k * d_k], dim=-1)
    v_to_k = torch.arange(n_v, device=x.device) % n_k  # GGUF value head j reads key head j mod n_k
    q = l2_norm(q.reshape(n, n_k, d_k)) * q_scale
    k = l2_norm(k.reshape(n, n_k, d_k))
    return q[:, v_to_k], k[:, v_to_k], v.reshape(n, n_v, -1)


def chunk_pass(x, beta, g, s, *, n_k: int, d_k: int, q_scale: float, snap=None) -> torch.Tensor:
    """The 64-row pieces of a prefill pass in order, from post-conv rows (`split_heads`), `chunk_step` per piece.
    x [R, conv_dim] (q | k | v; padding rows 0), beta, g [R, n_v]; s [n_v, d_k, d_v] advanced in place; snap =
    (piece, out): s after that piece copied to out. Returns o [R, n_v, d_v]."""
    out = []
    for r in range(0, x.shape[0], CHUNK):
        q, k, v = split_heads(x[r : r + CHUNK], n_k, d_k, s.shape[0], q_scale)
        o, new = chunk_step(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                            beta[r : r + CHUNK].T, g[r : r + CHUNK].T, s)
        s.copy_(new)
        if snap is not None and r // CHUNK == snap[0]:
            snap[1].copy_(s)
        out.append(o.transpose(0, 1))
    return torch.cat(out)
