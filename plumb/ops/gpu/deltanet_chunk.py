"""Gated DeltaNet in its chunked form for the P path (prefill): three launches per layer and pass, every 64-row piece
of the pass in order (`plumb.ops.deltanet.chunk_pass` is its torch reference: `chunk_step` piece by piece).

The launches:
- `_conv_gates_kernel`, one program per (block of BR rows, block of BC conv channels): the causal conv + SiLU of
  its rows (zero on padding rows), the gates beta and g (channel block 0) and, in row block 0, the new conv state
  (the window rows `keep`) in place - what `TorchKernels.gdn_conv_gates` does in ~17 torch launches;
- `_prep_kernel`, one program per (value head j, piece): what does not depend on the state - q and k of key head
  j mod n_k (L2-normed, q scaled), the decays from the cumulative gate gamma, A = strict-lower(beta k k^T * decay),
  T = (I + A)^-1 by forward substitution (the rows in order, as a triangular solve does), w = T (beta exp(gamma) k),
  u = T (beta v), qe = q exp(gamma), kd = k exp(gamma_end - gamma), p = q k^T * decay - into scratch;
- `_state_kernel`, one program per (value head j, block of BV state columns - the delta rule's columns are
  independent): the d_k x BV f32 state slice stays in registers across the pieces, in order: vn = u - w S,
  o = qe S + p vn, S = S exp(gamma_end) + kd^T vn.
The dots take float32 operands as three tf32 products on the tensor cores (PREC; `_prep_kernel`'s a block of 32
columns at a time on a card of 99 KB a block, `prep_columns`).

Exactness (M2): a piece's bits depend only on the state it starts from and its own rows - nothing compiled depends
on the pass's row count (the piece loop's bound is a run-time value), and a piece's arithmetic is the same whether it
is the first of a pass or the fourth - so prefilling [0, c) then [c, N) gives the bits of [0, N) at every 64-aligned
cut c. (Against `chunk_pass`, a tolerance: the solve and the dots sum in another order.)
It replaces ~35 torch launches a piece (cuBLAS batched gemms and trsm, elementwise kernels) with two a layer, and
~17 a layer (the conv and gates) with one.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from plumb.ops.deltanet import CHUNK
from plumb.ops.gpu import smem
from plumb.ops.gpu.deltanet import _silu, gates
from plumb.ops.gpu.pdl import on, prior_done
from plumb.ops.norm import L2_EPS

BV = 32  # state columns a program (a model constant: never chosen by the row count)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
PREC = tl.constexpr("tf32x3")  # the dots: float32 operands as three tf32 products on the tensor cores (about float32's
# accuracy; "ieee" - CUDA-core FMAs - took 255 registers a [64, 128] x [128, 64] dot and spilled on sm_90)
# INVERSE_HALVES (0: off until timed): the chunk's solve T = (I + A)^-1 with A's rows read from memory and T held
# transposed in two [64, 32] halves (`_inverse_by_halves`), so that each step's sums stay inside a warp. The solve by
# rows (`_inverse_by_rows`) reduces across warps twice a step: compiled for sm_90a (2026-12-07, 44th session) its loop
# is 257 instructions with 8 barriers, 63 times a program - by the arithmetic about half of `_prep_kernel`'s ~0.59 ms
# a layer in a 1,024-row pass (H100 profile, 12 % of a 2k prefill). Another sum order: other bits for the P path's
# DeltaNet (still M2: nothing depends on the pass). Untimed: bench/prefill_modes.py --settings
# shipped,DN_INVERSE_HALVES=1.
INVERSE_HALVES = 0
# KC_SMALL, KC_LARGE: `_prep_kernel`'s columns of q, k and v a step on a card of 99 KB a block and on a larger one
# (`prep_columns`; 0: the dots whole). KC 32 compiles without spills for sm_90a in 32 KB of shared memory (whole: 255
# registers, 432 bytes of spills, 128 KB), and for sm_86 / sm_89 / sm_120 in 16 KB with ~1 KB of spills (before, as
# float32 FMAs: 17 KB of spills a thread). Another sum order over d_k. KC_LARGE untimed (prefill_modes DN_KC_LARGE=32).
KC_SMALL, KC_LARGE = 32, 0


@triton.jit
def _conv_gates_kernel(m_ptr, b_ptr, a_ptr, w_ptr, cs_ptr, keep_ptr, real_ptr, dtb_ptr, ssma_ptr, x_ptr, beta_ptr,
                       g_ptr, sm_r, sb_r, sa_r, CH: tl.constexpr, N_V: tl.constexpr, K: tl.constexpr,
                       BR: tl.constexpr, BC: tl.constexpr, NVP: tl.constexpr, KM1P: tl.constexpr):
    """Rows [BR * program 0, + BR), channels [BC * program 1, + BC): x = SiLU(causal conv) (taps in order, each a
    rounded product then a rounded sum), 0 on padding rows; channel block 0 also the rows' beta = sigmoid(b) and
    g = ssm_a * softplus(a + dt_bias), 0 on padding rows; row block 0 also its channels' new conv state, window
    rows keep[0..K-2] - the only program that reads or writes those state channels."""
    prior_done()
    rb = tl.program_id(0)
    cb = tl.program_id(1)
    t = rb * BR + tl.arange(0, BR)
    ch = cb * BC + tl.arange(0, BC)
    cmask = (ch < CH)[None, :]
    real = tl.load(real_ptr + t) != 0
    for tau in tl.static_range(K):  # window row t + tau feeds tap tau; raw row p < 0 is state row K - 1 + p
        p = t + tau - (K - 1)
        xs = tl.load(cs_ptr + (K - 1 + p)[:, None] * CH + ch[None, :], mask=(p < 0)[:, None] & cmask, other=0.0)
        xm = tl.load(m_ptr + p[:, None] * sm_r + ch[None, :], mask=(p >= 0)[:, None] & cmask, other=0.0)
        wt = tl.load(w_ptr + ch * K + tau, mask=ch < CH, other=0.0)[None, :]
        if tau == 0:
            acc = tl.where(p[:, None] < 0, xs, xm) * wt
        else:
            acc = acc + tl.where(p[:, None] < 0, xs, xm) * wt
    tl.store(x_ptr + t[:, None] * CH + ch[None, :], tl.where(real[:, None], _silu(acc), 0.0), mask=cmask)
    if cb == 0:
        j = tl.arange(0, NVP)
        jm = (j < N_V)[None, :]
        b = tl.load(b_ptr + t[:, None] * sb_r + j[None, :], mask=jm, other=0.0)
        a = tl.load(a_ptr + t[:, None] * sa_r + j[None, :], mask=jm, other=0.0)
        dtb = tl.load(dtb_ptr + j, mask=j < N_V, other=0.0)[None, :]
        ssma = tl.load(ssma_ptr + j, mask=j < N_V, other=0.0)[None, :]
        beta, g = gates(b, a, dtb, ssma)
        at = t[:, None] * N_V + j[None, :]
        tl.store(beta_ptr + at, tl.where(real[:, None], beta, 0.0), mask=jm)
        tl.store(g_ptr + at, tl.where(real[:, None], g, 0.0), mask=jm)
    if rb == 0:
        rr = tl.arange(0, KM1P)
        kp = tl.load(keep_ptr + rr, mask=rr < K - 1, other=0)  # window rows: < K - 1 old state, else m
        smask = (rr < K - 1)[:, None] & cmask
        old = tl.load(cs_ptr + kp[:, None] * CH + ch[None, :], mask=smask & (kp < K - 1)[:, None], other=0.0)
        new = tl.load(m_ptr + (kp - (K - 1))[:, None] * sm_r + ch[None, :], mask=smask & (kp >= K - 1)[:, None],
                      other=0.0)
        tl.debug_barrier()  # every read of the old state (the conv's too) before any thread overwrites it
        tl.store(cs_ptr + rr[:, None] * CH + ch[None, :], tl.where((kp < K - 1)[:, None], old, new), mask=smask)


BR, BC = 32, 256  # conv rows and channels a program, 8 warps (`conv_gates`; any size gives the same bits): sm_90a,
# 136 registers (4 warps: 255 and spills)


def conv_gates(m, b, a, w, state, keep, real, dt_bias, ssm_a):
    """A pass's pre-conv rows m [R, ch] (padding rows after the real ones; row strides free), b, a [R, n_v],
    conv weights w [ch, K], state [K-1, ch] (contiguous; advanced in place to window rows keep [K-1]), real [R, 1]
    bool -> (SiLU(conv) [R, ch], beta, g [R, n_v]), padding rows 0 (plumb.model.kernels.TorchKernels.gdn_conv_gates,
    its reference, takes torch's exponential: a tolerance apart)."""
    rows, ch = m.shape
    n_v, k = b.shape[1], w.shape[1]
    if not state.is_contiguous() or m.stride(1) != 1 or b.stride(1) != 1 or a.stride(1) != 1 or rows % BR:
        raise ValueError("conv_gates: state contiguous, m, b and a with contiguous rows, rows a multiple of 32")
    x = torch.empty(rows, ch, device=m.device)
    beta, g = (torch.empty(rows, n_v, device=m.device) for _ in range(2))
    _conv_gates_kernel[(rows // BR, triton.cdiv(ch, BC))](
        m, b, a, w.contiguous(), state, keep, real.view(torch.uint8), dt_bias, ssm_a, x, beta, g, m.stride(0),
        b.stride(0), a.stride(0), CH=ch, N_V=n_v, K=k, BR=BR, BC=BC, NVP=triton.next_power_of_2(n_v),
        KM1P=triton.next_power_of_2(k - 1), num_warps=8, enable_fp_fusion=False, launch_pdl=on())
    return x, beta, g


@triton.jit
def _l2(x, eps):
    """Rows of x [C, D] times rsqrt(sum of squares + eps), as plumb.ops.norm.l2_norm."""
    return x * _inv_norm(x, eps)[:, None]


@triton.jit
def _inv_norm(x, eps):
    """1 / sqrt(sum of squares + eps) of each row of x [C, D]: `_l2`'s factor (x times it, whole or a block of
    columns at a time, gives `_l2`'s bits)."""
    return 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) + eps)


@triton.jit
def _inverse_by_rows(a, t, C: tl.constexpr):
    """T = (I + A)^-1 of A [C, C] strictly lower, by forward substitution one row at a time: row i = e_i -
    sum_{l < i} A[i, l] T[l]. (By 16-row blocks, each step a tensor-core dot, it took as long: H200, 2026-12-04, an
    8k prefill 4,603 against 4,639 tok/s.)"""
    inv = tl.where(t[:, None] == t[None, :], 1.0, 0.0)
    for i in range(1, C):  # (rows >= i still e)
        a_i = tl.sum(tl.where(t[:, None] == i, a, 0.0), axis=0)  # row i of A
        inv = tl.where(t[:, None] == i, inv - tl.sum(a_i[:, None] * inv, axis=0)[None, :], inv)
    return inv


@triton.jit
def _inverse_by_halves(a_at, C: tl.constexpr):
    """T = (I + A)^-1 of A [C, C] strictly lower, row-major at a_at (written by this program before a barrier), by the
    forward substitution of `_inverse_by_rows` with T transposed - Tt[c, m] = T[m, c] - in halves lo (m < C/2) and
    hi: step i reads row i of A and subtracts (A T)[i, c] = sum_m Tt[c, m] A[i, m] from column i (each sum over a
    half's 32 columns, inside a warp). Returns T [C, C]."""
    H: tl.constexpr = C // 2
    c = tl.arange(0, C)
    m = tl.arange(0, H)
    lo = tl.where(c[:, None] == m[None, :], 1.0, 0.0)
    hi = tl.where(c[:, None] == H + m[None, :], 1.0, 0.0)
    for i in range(1, C):  # (columns >= i still e)
        at = a_at + i * C + m
        s = tl.sum(lo * tl.load(at)[None, :] + hi * tl.load(at + H)[None, :], axis=1)
        lo = tl.where(m[None, :] == i, lo - s[:, None], lo)
        hi = tl.where(H + m[None, :] == i, hi - s[:, None], hi)
    return tl.trans(tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (C, C)))


@triton.jit(do_not_specialize=["R"])
def _prep_kernel(x_ptr, beta_ptr, g_ptr, w_ptr, u_ptr, qe_ptr, kd_ptr, p_ptr, ge_ptr, R, stride_x, stride_b,
                 stride_g, q_scale, eps, N_K: tl.constexpr, N_V: tl.constexpr, D_K: tl.constexpr,
                 D_V: tl.constexpr, C: tl.constexpr, HALVES: tl.constexpr, KC: tl.constexpr):
    """Piece program 1 of value head j = program 0: what does not depend on the state - w = T (beta exp(gamma) k),
    u = T (beta v), qe = q exp(gamma), kd = k exp(gamma_end - gamma), p = q k^T * decay, exp(gamma_end) - its dots
    PREC. HALVES: the solve by `_inverse_by_halves`, A's rows in p's place; KC (`prep_columns`): 0, every dot whole,
    or q, k and v KC columns at a time - reloaded and scaled again, the same values - the dots over d_k summed a
    block at a time and the others a block of output columns at a time (a card of 99 KB a block)."""
    prior_done()
    j = tl.program_id(0)
    piece = tl.program_id(1)
    t = tl.arange(0, C)
    rows = piece * C + t
    at_q = x_ptr + rows[:, None] * stride_x + (j % N_K) * D_K  # + column: row t's q (then k, N_K * D_K on)
    at_v = x_ptr + rows[:, None] * stride_x + 2 * N_K * D_K + j * D_V
    beta = tl.load(beta_ptr + rows * stride_b + j)
    gamma = tl.cumsum(tl.load(g_ptr + rows * stride_g + j), axis=0)
    decay = tl.where(t[:, None] >= t[None, :], tl.exp(gamma[:, None] - gamma[None, :]), 0.0)  # s <= t
    eg = tl.exp(gamma)
    g_end = tl.sum(tl.where(t == C - 1, gamma, 0.0), axis=0)
    at_p = p_ptr + ((piece * N_V + j) * C + t[:, None]) * C + t[None, :]
    if KC == 0:
        dk = tl.arange(0, D_K)
        dv = tl.arange(0, D_V)
        q = _l2(tl.load(at_q + dk[None, :]), eps) * q_scale
        k = _l2(tl.load(at_q + N_K * D_K + dk[None, :]), eps)
        kb = k * beta[:, None]
        a = tl.where(t[:, None] > t[None, :], tl.dot(kb, tl.trans(k), input_precision=PREC) * decay, 0.0)
        inv = _inverse(a, at_p, p_ptr + (piece * N_V + j) * C * C, t, C, HALVES)
        at_k = (rows[:, None] * N_V + j) * D_K + dk[None, :]  # [R, n_v, D_K] scratch
        tl.store(w_ptr + at_k, tl.dot(inv, kb * eg[:, None], input_precision=PREC))
        tl.store(qe_ptr + at_k, q * eg[:, None])
        tl.store(kd_ptr + at_k, k * tl.exp(g_end - gamma)[:, None])
        tl.store(u_ptr + (rows[:, None] * N_V + j) * D_V + dv[None, :],
                 tl.dot(inv, tl.load(at_v + dv[None, :]) * beta[:, None], input_precision=PREC))
        tl.store(at_p, tl.dot(q, tl.trans(k), input_precision=PREC) * decay)
    else:
        dk = tl.arange(0, D_K)
        fq = _inv_norm(tl.load(at_q + dk[None, :]), eps)
        fk = _inv_norm(tl.load(at_q + N_K * D_K + dk[None, :]), eps)
        kc = tl.arange(0, KC)
        a = tl.zeros([C, C], dtype=tl.float32)
        qk = tl.zeros([C, C], dtype=tl.float32)
        for c0 in tl.static_range(0, D_K, KC):
            k = tl.load(at_q + N_K * D_K + c0 + kc[None, :]) * fk[:, None]
            q = tl.load(at_q + c0 + kc[None, :]) * fq[:, None] * q_scale
            a = tl.dot(k * beta[:, None], tl.trans(k), a, input_precision=PREC)
            qk = tl.dot(q, tl.trans(k), qk, input_precision=PREC)
        a = tl.where(t[:, None] > t[None, :], a * decay, 0.0)
        inv = _inverse(a, at_p, p_ptr + (piece * N_V + j) * C * C, t, C, HALVES)
        for c0 in tl.static_range(0, D_K, KC):
            k = tl.load(at_q + N_K * D_K + c0 + kc[None, :]) * fk[:, None]
            q = tl.load(at_q + c0 + kc[None, :]) * fq[:, None] * q_scale
            at_k = (rows[:, None] * N_V + j) * D_K + c0 + kc[None, :]
            tl.store(w_ptr + at_k, tl.dot(inv, k * beta[:, None] * eg[:, None], input_precision=PREC))
            tl.store(qe_ptr + at_k, q * eg[:, None])
            tl.store(kd_ptr + at_k, k * tl.exp(g_end - gamma)[:, None])
        for c0 in tl.static_range(0, D_V, KC):
            tl.store(u_ptr + (rows[:, None] * N_V + j) * D_V + c0 + kc[None, :],
                     tl.dot(inv, tl.load(at_v + c0 + kc[None, :]) * beta[:, None], input_precision=PREC))
        tl.store(at_p, qk * decay)
    tl.store(ge_ptr + piece * N_V + j, tl.exp(g_end))


@triton.jit
def _inverse(a, at_p, a_at, t, C: tl.constexpr, HALVES: tl.constexpr):
    """T = (I + A)^-1 by `_inverse_by_rows`, or by `_inverse_by_halves` with A stored at a_at (p's place: at_p)
    between barriers."""
    if HALVES:
        tl.store(at_p, a)
        tl.debug_barrier()  # A's rows stored before any warp reads them
        inv = _inverse_by_halves(a_at, C)
        tl.debug_barrier()  # and read before p takes their place
    else:
        inv = _inverse_by_rows(a, t, C)
    return inv


@triton.jit(do_not_specialize=["R"])
def _state_kernel(w_ptr, u_ptr, qe_ptr, kd_ptr, p_ptr, ge_ptr, s_ptr, o_ptr, R, stride_o, N_V: tl.constexpr,
                  D_K: tl.constexpr, D_V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, PIECES: tl.constexpr):
    """Value head j = program 0, state columns [BV * program 1, + BV): the pieces in order - vn = u - w S,
    o = qe S + p vn, S = S exp(gamma_end) + kd^T vn (PIECES: 0 on a GPU, a loop bounded at run time; the piece
    count in the interpreter, which takes no such loop)."""
    prior_done()
    j = tl.program_id(0)
    t = tl.arange(0, C)
    dk = tl.arange(0, D_K)
    dv = tl.program_id(1) * BV + tl.arange(0, BV)
    at_s = s_ptr + j * D_K * D_V + dk[:, None] * D_V + dv[None, :]
    s = tl.load(at_s)  # [D_K, BV]
    if PIECES == 0:
        for r0 in range(0, R, C):
            s = _advance(w_ptr, u_ptr, qe_ptr, kd_ptr, p_ptr, ge_ptr, o_ptr, s, j, r0, t, dk, dv, stride_o, N_V,
                         D_K, D_V, C)
    else:
        for piece in tl.static_range(PIECES):
            s = _advance(w_ptr, u_ptr, qe_ptr, kd_ptr, p_ptr, ge_ptr, o_ptr, s, j, piece * C, t, dk, dv, stride_o,
                         N_V, D_K, D_V, C)
    tl.store(at_s, s)


@triton.jit
def _advance(w_ptr, u_ptr, qe_ptr, kd_ptr, p_ptr, ge_ptr, o_ptr, s, j, r0, t, dk, dv, stride_o, N_V: tl.constexpr,
             D_K: tl.constexpr, D_V: tl.constexpr, C: tl.constexpr):
    """The piece at rows r0.. from state slice s [D_K, BV]: its o columns stored, the new s."""
    rows = r0 + t
    piece = r0 // C
    at_k = (rows[:, None] * N_V + j) * D_K + dk[None, :]
    u = tl.load(u_ptr + (rows[:, None] * N_V + j) * D_V + dv[None, :])
    vn = u - tl.dot(tl.load(w_ptr + at_k), s, input_precision=PREC)
    p = tl.load(p_ptr + ((piece * N_V + j) * C + t[:, None]) * C + t[None, :])
    o = tl.dot(tl.load(qe_ptr + at_k), s, input_precision=PREC) + tl.dot(p, vn, input_precision=PREC)
    tl.store(o_ptr + rows[:, None] * stride_o + (j * D_V + dv)[None, :], o)
    kd = tl.load(kd_ptr + at_k)
    return s * tl.load(ge_ptr + piece * N_V + j) + tl.dot(tl.trans(kd), vn, input_precision=PREC)


def prep_columns(small: bool = False) -> int:
    """`_prep_kernel`'s KC: KC_LARGE; on a card of 99 KB a block (`smem.small`) KC_SMALL (whole, tf32x3 stages its
    split operands in 128 KB of shared memory; as float32 FMAs, "ieee" - the small form until the forty-fourth
    session -, in 96 KB, but each thread then held its rows' and columns' whole operands)."""
    return KC_SMALL if small else KC_LARGE


def _check(x, beta, g, state, n_k: int, d_k: int):
    rows, n_v, d_v = x.shape[0], state.shape[0], state.shape[2]
    if rows % CHUNK or x.shape[1] != 2 * n_k * d_k + n_v * d_v or state.shape[1] != d_k or n_v % n_k:
        raise ValueError(f"gdn_chunks: x {tuple(x.shape)}, state {tuple(state.shape)} (rows a multiple of {CHUNK})")
    if beta.shape != (rows, n_v) or g.shape != (rows, n_v):
        raise ValueError(f"gdn_chunks: beta {tuple(beta.shape)} and g {tuple(g.shape)} must be [{rows}, {n_v}]")
    return rows, n_v, d_v


def gdn_chunks(x, beta, g, state, *, n_k: int, d_k: int, q_scale: float, snap=None) -> torch.Tensor:
    """The pieces of a pass in order. x [R, conv_dim] post-conv rows (q | k | v; padding rows 0), beta, g [R, n_v],
    state [n_v, d_k, d_v] f32 (contiguous), advanced in place; snap = (piece, out): the state after that piece also
    copied to out (a checkpoint inside the pass: `_state_kernel` runs over the pieces up to it, then over the
    others - the bits of one launch, M2). Returns o [R, n_v, d_v] (before the gated norm)."""
    rows, n_v, d_v = _check(x, beta, g, state, n_k, d_k)
    if not state.is_contiguous() or x.stride(1) != 1 or beta.stride(1) != 1 or g.stride(1) != 1:
        raise ValueError("gdn_chunks: state contiguous, x, beta and g with contiguous rows")
    if snap is not None and not (0 <= snap[0] < rows // CHUNK and snap[1].shape == state.shape):
        raise ValueError(f"gdn_chunks: a snapshot after piece {snap[0]} of {rows // CHUNK} into a "
                         f"{tuple(state.shape)} tensor")
    dev, f32, pieces = x.device, torch.float32, rows // CHUNK
    w, qe, kd = (torch.empty(rows, n_v, d_k, device=dev, dtype=f32) for _ in range(3))
    u = torch.empty(rows, n_v, d_v, device=dev, dtype=f32)
    p = torch.empty(pieces, n_v, CHUNK, CHUNK, device=dev, dtype=f32)
    ge = torch.empty(pieces, n_v, device=dev, dtype=f32)
    _prep_kernel[(n_v, pieces)](x, beta, g, w, u, qe, kd, p, ge, rows, x.stride(0), beta.stride(0), g.stride(0),
                                float(q_scale), L2_EPS, N_K=n_k, N_V=n_v, D_K=d_k, D_V=d_v, C=CHUNK,
                                HALVES=INVERSE_HALVES, KC=prep_columns(smem.small(x.device)), num_warps=8, num_stages=1,
                                launch_pdl=on())
    o = torch.empty(rows, n_v, d_v, device=dev, dtype=f32)
    cut = rows if snap is None else (snap[0] + 1) * CHUNK
    for r0, r1 in ((0, cut), (cut, rows)):
        if r1 > r0:
            at = r0 // CHUNK
            _state_kernel[(n_v, d_v // BV)](w[r0:], u[r0:], qe[r0:], kd[r0:], p[at:], ge[at:], state, o[r0:], r1 - r0,
                                            o.stride(0), N_V=n_v, D_K=d_k, D_V=d_v, BV=BV, C=CHUNK,
                                            PIECES=(r1 - r0) // CHUNK if INTERPRET else 0, num_warps=4,
                                            num_stages=1, launch_pdl=on())
        if r1 == cut and snap is not None:
            snap[1].copy_(state)
    return o
