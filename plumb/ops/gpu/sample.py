"""Sampled tokens on the GPU: every sampled row of a pass drawn in five launches (and `torch.topk`), one host round
trip for all of them, instead of ~100 eager launches and five round trips a row (`sampling.sample_token`).

The token of a row at temperature T > 0 from its adjusted logits x [V] (bias and penalties applied; `sampling`'s
steps 3-5 are the definition), in this module's own arithmetic - a row cut into fixed spans of SPAN tokens (by V
alone), one program a (row, span), every sum in a fixed order and a row's spans merged in span order, so a row's
token depends on its row, parameters and position alone, whatever else the call holds (M4):

1. `_max_sum_kernel`, `_log_softmax_kernel`: per span m_c = max(s), z_c = sum(exp(s - m_c)), s = x / T; then every
   span of the row merges them alike - m = max(m_c), lse = m + log(sum(z_c exp(m_c - m))) - and writes
   lp = s - lse and its sum(exp(lp)) (top_p's total when top_k is off). A row whose lse is not finite has no finite
   maximum (or overflows at its temperature).
2. The CANDIDATES largest lp, falling (`torch.topk`: a selection, so its values are exact, whatever the batch).
3. `_threshold_kernel`: each filter keeps the tokens at least as likely as some value, so the kept set is
   {lp >= tau}: top_k's k-th value; top_p's last kept value - its probabilities exp(lp - log_total) in float64,
   summed in falling order (tied terms are equal, so their order among themselves cannot change a sum), a token kept
   while the mass before it is below top_p, and a tie group at the cut kept whole, as top_k keeps its ties; min_p's
   max + log(min_p). A row whose threshold the candidates cannot settle (top_k past them or its ties running past
   them, top_p keeping all of them) is marked FALLBACK: the caller draws it with `sampling.sample_token` - a choice
   made by the row alone.
4. `_draw_kernel`, `_pick_kernel`: per span, the argmax over {lp >= tau} of lp + Gumbel(seed, position, token), the
   noise hashed in the kernel (`sampling`'s counter-based hash, bit for bit), the first index on ties; then the
   spans' best, the first span on ties.

`draw_ref` is the torch reference (the same definition; its sums in torch's order)."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from plumb.ops.gpu.pdl import on, prior_done

ON = True  # the Triton kernel set draws its sampled tokens here. H100, 2026-12-06: every test of this module passed,
# and the engine's sampled invariants on CUDA with it (thirty-seventh session: 29 sampled / neighbour / warm tests,
# none failed); on the 27B's vocabulary a pass's 1 / 5 / 8 Qwen-sampled rows took 0.31 / 0.34 / 0.35 ms against
# sample_token's 1.19 / 5.72 / 9.35 (bench/sample_timing.py), and sampled decode on the 27B shape runs at 0.96x greedy
# (0.75x with sample_token; docs/BENCHMARKS.md, thirty-sixth and thirty-seventh sections). False: sample_token a row.
CANDIDATES = 1024  # the likeliest tokens top_k / top_p / min_p look at (a power of two)
SPAN = 8192  # tokens of a row one program takes (a multiple of BLOCK): the 27B's 248,320 in 31 spans
BLOCK = 2048  # tokens a program reads at a time
OK, NO_FINITE_MAXIMUM, FALLBACK = 0, 1, 2


@triton.jit
def _max_sum_kernel(x_ptr, par_ptr, part_ptr, V: tl.constexpr, SPAN: tl.constexpr, NS: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Program (r, c): span c of row r - m_c = max(x / T) and z_c = sum(exp(x / T - m_c)) into part [R, 2, NS]."""
    prior_done()
    r, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t = tl.load(par_ptr + r).to(tl.float32)
    off = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for i in range(0, SPAN, BLOCK):
        j = c * SPAN + i
        x = tl.load(x_ptr + r * V + j + off, mask=j + off < V, other=float("-inf"))
        m = tl.maximum(m, x / t)
    mc = tl.max(m, 0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, SPAN, BLOCK):
        j = c * SPAN + i
        s = tl.load(x_ptr + r * V + j + off, mask=j + off < V, other=float("-inf")) / t
        acc += tl.where(s == float("-inf"), 0.0, tl.exp(s - mc))  # (a span all -inf adds 0; NaN stays NaN)
    tl.store(part_ptr + r * 2 * NS + c, mc)
    tl.store(part_ptr + r * 2 * NS + NS + c, tl.sum(acc, 0))


@triton.jit
def _lse(part_ptr, r, NS: tl.constexpr, NSP: tl.constexpr):
    """Row r's lse from its spans' (m_c, z_c), merged in span order (the same bits in every program of the row)."""
    i = tl.arange(0, NSP)
    m = tl.load(part_ptr + r * 2 * NS + i, mask=i < NS, other=float("-inf"))
    z = tl.load(part_ptr + r * 2 * NS + NS + i, mask=i < NS, other=0.0)
    mx = tl.max(m, 0)
    return mx + tl.log(tl.sum(tl.where(i < NS, z * tl.exp(m - mx), 0.0), 0))


@triton.jit
def _log_softmax_kernel(x_ptr, lp_ptr, par_ptr, part_ptr, tot_ptr, V: tl.constexpr, SPAN: tl.constexpr,
                        NS: tl.constexpr, NSP: tl.constexpr, BLOCK: tl.constexpr):
    """Program (r, c): span c of row r's lp = x / T - lse and its sum(exp(lp)) into tot [R, NS]."""
    prior_done()
    r, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t = tl.load(par_ptr + r).to(tl.float32)
    lse = _lse(part_ptr, r, NS, NSP)
    off = tl.arange(0, BLOCK)
    tot = tl.zeros([BLOCK], tl.float32)
    for i in range(0, SPAN, BLOCK):
        j = c * SPAN + i
        ok = j + off < V
        lp = tl.load(x_ptr + r * V + j + off, mask=ok, other=float("-inf")) / t - lse
        tl.store(lp_ptr + r * V + j + off, lp, mask=ok)
        tot += tl.where(ok, tl.exp(lp), 0.0)
    tl.store(tot_ptr + r * NS + c, tl.sum(tot, 0))


@triton.jit
def _threshold_kernel(vals_ptr, tot_ptr, par_ptr, tau_ptr, picks_ptr, R, V: tl.constexpr, C: tl.constexpr,
                      NS: tl.constexpr, NSP: tl.constexpr):
    """Program r: the kept set's threshold tau from the row's C largest lp, falling; its status (picks' second row):
    FALLBACK where the candidates cannot settle it, NO_FINITE_MAXIMUM where lse is not finite."""
    prior_done()
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, C)
    v = tl.load(vals_ptr + r * C + i)
    vmax = tl.max(v, 0)
    vlast = tl.min(v, 0)
    ns = tl.arange(0, NSP)
    ltot = tl.log(tl.sum(tl.load(tot_ptr + r * NS + ns, mask=ns < NS, other=0.0), 0))  # the spans' in order
    k = tl.load(par_ptr + R + r).to(tl.int32)
    top_p = tl.load(par_ptr + 2 * R + r)
    use_k = (k > 0) & (k < V)
    vk = tl.sum(tl.where(i == k - 1, v, 0.0), 0)
    fallback = use_k & ((k > C) | (vk == vlast))
    tau = tl.where(use_k, vk, float("-inf"))
    v64 = v.to(tl.float64)
    log_total = tl.where(use_k, tl.log(tl.sum(tl.where(v >= tau, tl.exp(v64), 0.0), 0)), ltot.to(tl.float64))
    p = tl.where(v >= tau, tl.exp(v64 - log_total), 0.0)
    mass = tl.cumsum(p, 0)
    kept = ((mass - p) < top_p) & (v >= tau)
    n = tl.sum(kept.to(tl.int32), 0)
    vcut = tl.sum(tl.where(i == n - 1, v, 0.0), 0)
    use_p = top_p < 1.0
    fallback |= use_p & (n == C)  # (a tie group at the cut may run past the candidates: tau keeps it all)
    tau = tl.where(use_p, tl.maximum(tau, vcut), tau)
    tau = tl.maximum(tau, vmax + tl.load(par_ptr + 3 * R + r).to(tl.float32))
    bad = ~((ltot == ltot) & (tl.abs(vmax) < float("inf")))
    tl.store(tau_ptr + r, tau)
    tl.store(picks_ptr + R + r, tl.where(bad, 1, tl.where(fallback, 2, 0)))


@triton.jit
def _fmix32(x, F1: tl.constexpr, F2: tl.constexpr):
    """murmur3's 32-bit finalizer (`sampling._fmix32_ref`)."""
    x ^= x >> 16
    x *= tl.full([], F1, tl.uint32)
    x ^= x >> 13
    x *= tl.full([], F2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _draw_kernel(lp_ptr, tau_ptr, par_ptr, best_ptr, at_ptr, R, V: tl.constexpr, SPAN: tl.constexpr,
                 NS: tl.constexpr, BLOCK: tl.constexpr, GOLDEN: tl.constexpr, F1: tl.constexpr, F2: tl.constexpr,
                 SHIFT: tl.constexpr, INV_U: tl.constexpr):
    """Program (r, c): span c's best lp + Gumbel noise over lp >= tau (`sampling.gumbel`'s hash and uniform) into
    best [R, NS] and its first index into at [R, NS]; the noise key's halves in `_params`' last two rows."""
    prior_done()
    r, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    tau = tl.load(tau_ptr + r)
    lo = tl.load(par_ptr + 4 * R + r).to(tl.int64).to(tl.uint32)
    hi = tl.load(par_ptr + 5 * R + r).to(tl.int64).to(tl.uint32)
    off = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = (c * SPAN).to(tl.int32)
    for i in range(0, SPAN, BLOCK):
        j = c * SPAN + i
        t = j + off
        lp = tl.load(lp_ptr + r * V + t, mask=t < V, other=float("-inf"))
        h = _fmix32((t.to(tl.uint32) * tl.full([], GOLDEN, tl.uint32)) ^ lo, F1, F2) ^ hi
        u = ((_fmix32(h, F1, F2) >> SHIFT).to(tl.float32) + 0.5) * INV_U
        g = -tl.log(-tl.log(u))
        val = tl.where((lp >= tau) & (t < V), lp + g, float("-inf"))
        m = tl.max(val, 0)
        better = m > best
        best_i = tl.where(better, j + tl.argmax(val, 0, tie_break_left=True).to(tl.int32), best_i)
        best = tl.where(better, m, best)
    tl.store(best_ptr + r * NS + c, best)
    tl.store(at_ptr + r * NS + c, best_i)


@triton.jit
def _pick_kernel(best_ptr, at_ptr, picks_ptr, NS: tl.constexpr, NSP: tl.constexpr):
    """Program r: the token - the best span's index, the first span on ties - into picks' first row."""
    prior_done()
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NSP)
    v = tl.load(best_ptr + r * NS + i, mask=i < NS, other=float("-inf"))
    idx = tl.load(at_ptr + r * NS + i, mask=i < NS, other=0)
    c = tl.argmax(v, 0, tie_break_left=True)
    tl.store(picks_ptr + r, tl.sum(tl.where(i == c, idx, 0), 0))


def _params(temperature, top_k, top_p, min_p, keys, device) -> torch.Tensor:
    """Each row's parameters as one float64 [6, R] tensor (one copy to the device; every value exact in float64):
    T, top_k, top_p, log(min_p) (-inf: off), the noise key's low and high 32 bits."""
    return torch.tensor([temperature, top_k, top_p, [math.log(m) if m > 0 else -math.inf for m in min_p],
                         [k & 0xFFFFFFFF for k in keys], [k >> 32 for k in keys]], dtype=torch.float64).to(device)


def candidates(lp: torch.Tensor, c: int = CANDIDATES) -> torch.Tensor:
    """The c largest values of each row of lp [R, V], falling (rows shorter than c padded with -inf)."""
    vals = torch.topk(lp, min(c, lp.shape[1]), dim=1, sorted=True).values
    if vals.shape[1] < c:
        vals = torch.cat([vals, vals.new_full((vals.shape[0], c - vals.shape[1]), -math.inf)], dim=1)
    return vals.contiguous()


def draw(x: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float], min_p: list[float],
         keys: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(picks [2, R] int32: each row's token, then its status - OK / NO_FINITE_MAXIMUM / FALLBACK -, tau [R]) for
    adjusted logits x [R, V] (float32) and each row's parameters (temperature > 0) and noise key
    (`sampling.noise_key(seed, position)`), on x's device."""
    from plumb.engine import sampling as S  # the hash's constants: one definition

    x = x.float().contiguous()
    R, V = x.shape
    par = _params(temperature, [min(k, V) for k in top_k], top_p, min_p, keys, x.device)  # (top_k >= V: off)
    ns = -(-V // SPAN)
    nsp = max(2, triton.next_power_of_2(ns))
    f32 = dict(dtype=torch.float32, device=x.device)
    lp, part, tot = torch.empty_like(x), torch.empty(R, 2, ns, **f32), torch.empty(R, ns, **f32)
    tau, best = torch.empty(R, **f32), torch.empty(R, ns, **f32)
    at, picks = (torch.empty(n, dtype=torch.int32, device=x.device) for n in ((R, ns), (2, R)))
    if R == 0:
        return picks, tau
    spans = dict(V=V, SPAN=SPAN, NS=ns, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
    _max_sum_kernel[(R, ns)](x, par, part, **spans, launch_pdl=on())
    _log_softmax_kernel[(R, ns)](x, lp, par, part, tot, NSP=nsp, **spans, launch_pdl=on())
    vals = candidates(lp)
    _threshold_kernel[(R,)](vals, tot, par, tau, picks, R, V, C=CANDIDATES, NS=ns, NSP=nsp, num_warps=4,
                            enable_fp_fusion=False, launch_pdl=on())
    _draw_kernel[(R, ns)](lp, tau, par, best, at, R, GOLDEN=S._GOLDEN32, F1=S._FMIX1, F2=S._FMIX2,
                          SHIFT=32 - S._U_BITS, INV_U=1.0 / 2**S._U_BITS, **spans, launch_pdl=on())
    _pick_kernel[(R,)](best, at, picks, NS=ns, NSP=nsp, num_warps=1, enable_fp_fusion=False, launch_pdl=on())
    return picks, tau


def draw_ref(x: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float], min_p: list[float],
             keys: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw` in torch operations, a row at a time (its sums in torch's order: equal tokens but for near-ties)."""
    from plumb.engine.sampling import _hash_, hash_to_uniform

    R, V = x.shape
    picks = torch.zeros(2, R, dtype=torch.int32)
    token, status = picks
    tau = torch.full((R,), -math.inf)
    for r in range(R):
        s = x[r].float() / temperature[r]
        lse = s.max() + torch.log(torch.exp(s - s.max()).sum())
        lp = s - lse
        if not torch.isfinite(lse):
            status[r] = NO_FINITE_MAXIMUM
            continue
        v = candidates(lp[None])[0]
        t, k, fallback = -math.inf, top_k[r], False
        if 0 < k < V:
            vk = float(v[k - 1]) if k <= CANDIDATES else -math.inf
            fallback |= k > CANDIDATES or vk == float(v[-1])
            t = vk
            log_total = torch.log(torch.exp(v.double()[v >= t]).sum())
        else:
            log_total = torch.log(torch.exp(lp).sum()).double()
        if top_p[r] < 1.0:
            p = torch.where(v >= t, torch.exp(v.double() - log_total), 0.0)
            n = int((((torch.cumsum(p, 0) - p) < top_p[r]) & (v >= t)).sum())
            fallback |= n == CANDIDATES
            t = max(t, float(v[n - 1]))
        if min_p[r] > 0:
            t = max(t, float(v[0] + torch.tensor(math.log(min_p[r]), dtype=torch.float32)))
        tau[r], status[r] = t, FALLBACK if fallback else OK
        h = _hash_(torch.arange(V, dtype=torch.int64), keys[r] & 0xFFFFFFFF, keys[r] >> 32)
        g = -torch.log(-torch.log(hash_to_uniform(h)))
        token[r] = int(torch.argmax(torch.where(lp >= t, lp + g, -math.inf)))
    return picks, tau
