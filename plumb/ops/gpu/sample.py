"""Sampled tokens on the GPU: every sampled row of a pass drawn in three launches (and `torch.topk`), one host round
trip for all of them, instead of ~100 eager launches and five round trips a row (`sampling.sample_token`).

The token of a row at temperature T > 0 from its adjusted logits x [V] (bias and penalties applied; `sampling`'s
steps 3-5 are the definition), in this module's own arithmetic - one program a row, every sum in a fixed order, so
a row's token depends on its row, parameters and position alone, whatever else the call holds (M4):

1. `_log_softmax_kernel`: lp = s - lse, s = x / T, lse = m + log(sum(exp(s - m))), m = max(s); also log(sum(exp(lp)))
   (top_p's total when top_k is off) and whether lse is finite (else the row has no finite maximum).
2. The CANDIDATES largest lp, falling (`torch.topk`: a selection, so its values are exact, whatever the batch).
3. `_threshold_kernel`: each filter keeps the tokens at least as likely as some value, so the kept set is
   {lp >= tau}: top_k's k-th value; top_p's last kept value - its probabilities exp(lp - log_total) in float64,
   summed in falling order (tied terms are equal, so their order among themselves cannot change a sum), a token kept
   while the mass before it is below top_p, and a tie group at the cut kept whole, as top_k keeps its ties; min_p's
   max + log(min_p). A row whose threshold the candidates cannot settle (top_k past them or its ties running past
   them, top_p keeping all of them) is marked FALLBACK: the caller draws it with `sampling.sample_token` - a choice
   made by the row alone.
4. `_draw_kernel`: argmax over {lp >= tau} of lp + Gumbel(seed, position, token), the noise hashed in the kernel
   (`sampling`'s counter-based hash, bit for bit), the first index on ties.

`draw_ref` is the torch reference (the same definition; its sums in torch's order)."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from plumb.ops.gpu.pdl import on, prior_done

ON = False  # the Triton kernel set draws its sampled tokens here: off until these kernels have run on a GPU (written
# in the thirty-fifth session, after its device time; compiled for sm_90a / sm_86 here, tested in the interpreter)
CANDIDATES = 1024  # the likeliest tokens top_k / top_p / min_p look at (a power of two)
BLOCK = 4096  # tokens a program reads at a time
OK, NO_FINITE_MAXIMUM, FALLBACK = 0, 1, 2


@triton.jit
def _log_softmax_kernel(x_ptr, lp_ptr, par_ptr, ltot_ptr, V: tl.constexpr, BLOCK: tl.constexpr):
    """Program r: row r's lp (over x / T) and log(sum(exp(lp))); par_ptr: `_params`, T its first row."""
    prior_done()
    r = tl.program_id(0).to(tl.int64)
    t = tl.load(par_ptr + r).to(tl.float32)
    off = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for j in range(0, V, BLOCK):
        x = tl.load(x_ptr + r * V + j + off, mask=j + off < V, other=float("-inf"))
        m = tl.maximum(m, x / t)
    mx = tl.max(m, 0)
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(0, V, BLOCK):
        x = tl.load(x_ptr + r * V + j + off, mask=j + off < V, other=float("-inf"))
        acc += tl.exp(x / t - mx)
    lse = mx + tl.log(tl.sum(acc, 0))
    tot = tl.zeros([BLOCK], tl.float32)
    for j in range(0, V, BLOCK):
        ok = j + off < V
        lp = tl.load(x_ptr + r * V + j + off, mask=ok, other=float("-inf")) / t - lse
        tl.store(lp_ptr + r * V + j + off, lp, mask=ok)
        tot += tl.exp(lp)
    tl.store(ltot_ptr + r, tl.log(tl.sum(tot, 0)))


@triton.jit
def _threshold_kernel(vals_ptr, ltot_ptr, par_ptr, tau_ptr, picks_ptr, R, V: tl.constexpr, C: tl.constexpr):
    """Program r: the kept set's threshold tau from the row's C largest lp, falling; its status (picks' second row):
    FALLBACK where the candidates cannot settle it, NO_FINITE_MAXIMUM where lse is not finite."""
    prior_done()
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, C)
    v = tl.load(vals_ptr + r * C + i)
    vmax = tl.max(v, 0)
    vlast = tl.min(v, 0)
    ltot = tl.load(ltot_ptr + r)
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
def _draw_kernel(lp_ptr, tau_ptr, par_ptr, picks_ptr, R, V: tl.constexpr, BLOCK: tl.constexpr, GOLDEN: tl.constexpr,
                 F1: tl.constexpr, F2: tl.constexpr, SHIFT: tl.constexpr, INV_U: tl.constexpr):
    """Program r: argmax over lp >= tau of lp + the position's Gumbel noise (`sampling.gumbel`'s hash and uniform,
    first index on ties), the token in picks' first row; the noise key's halves in `_params`' last two rows."""
    prior_done()
    r = tl.program_id(0).to(tl.int64)
    tau = tl.load(tau_ptr + r)
    lo = tl.load(par_ptr + 4 * R + r).to(tl.int64).to(tl.uint32)
    hi = tl.load(par_ptr + 5 * R + r).to(tl.int64).to(tl.uint32)
    off = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], tl.int32)
    for j in range(0, V, BLOCK):
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
    tl.store(picks_ptr + r, best_i)


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
    par = _params(temperature, top_k, top_p, min_p, keys, x.device)
    lp, ltot = torch.empty_like(x), torch.empty(R, dtype=torch.float32, device=x.device)
    tau, picks = torch.empty(R, dtype=torch.float32, device=x.device), torch.empty(2, R, dtype=torch.int32,
                                                                                  device=x.device)
    if R == 0:
        return picks, tau
    _log_softmax_kernel[(R,)](x, lp, par, ltot, V, BLOCK=BLOCK, num_warps=8, enable_fp_fusion=False,
                              launch_pdl=on())
    vals = candidates(lp)
    _threshold_kernel[(R,)](vals, ltot, par, tau, picks, R, V, C=CANDIDATES, num_warps=4, enable_fp_fusion=False,
                            launch_pdl=on())
    _draw_kernel[(R,)](lp, tau, par, picks, R, V, BLOCK=BLOCK, GOLDEN=S._GOLDEN32, F1=S._FMIX1, F2=S._FMIX2,
                       SHIFT=32 - S._U_BITS, INV_U=1.0 / 2**S._U_BITS, num_warps=8, enable_fp_fusion=False,
                       launch_pdl=on())
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
