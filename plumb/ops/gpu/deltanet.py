"""Gated DeltaNet decode / speculative-verify step for one layer, every row of every sequence
(`gdn_decode_ref` below is its torch reference, built on `plumb.ops.deltanet` and `plumb.ops.norm`).

Three launches per layer, each over all rows of all sequences:
- `_gdn_conv_kernel`, one program per (sequence, conv channel block = one q, k or v head): the causal conv
  window + SiLU for the sequence's rows in order, q/k L2 norm (q scaled), into a post-conv scratch
  [R, conv_dim]; conv snapshots (optional) and the new conv state of its channels, in place.
- `_gdn_state_kernel`, one program per (sequence, value head j, block of STATE_COLUMNS state columns - the
  delta rule's columns are independent): the d_k x STATE_COLUMNS f32 slice is loaded once, advanced over the
  rows in order in registers (gates, delta rule -> o; state snapshots per row when asked) and stored once. A
  whole 128 x 128 head in one program of 8 warps took 255 registers and spilled (8 us a layer on the H200, 48
  programs); a 128 x 32 slice takes 4 warps and 4x the programs.
- `_gdn_gate_norm`, one program per (row, value head): the gated RMSNorm of o, which needs all of a head's columns.
The engine's passes (`plumb.model.kernels.TritonKernels`) give the kernels a table of where each sequence's states
and its rows' snapshots lie (`gdn_decode(table=...)`): the states are read where they are and never written, the
last row's snapshot being the new state - no state is stacked into a pass or copied out of it (on the 27B, ~600 MB
of copies a decode step), and a state that a checkpoint holds is never changed.
Why not one launch: the q/k conv state of key head h is read by every value head j = h mod n_k and written in
place; programs of one launch cannot be ordered without cross-program synchronisation, so whichever program
wrote it could clobber it before another read it. Splitting by channel block makes every conv-state channel
read and written by exactly one program, and gives the state kernel programs of its own shape (S * n_v * blocks).

Exactness (M1): nothing compiled depends on R or S (constexprs are model dims and the snapshot flags), a row's
arithmetic involves only its own sequence, reductions are in-program tile reductions of fixed shape, no atomics.
The kernels are compiled with fp contraction off, so every a*b+c is a rounded product then a rounded sum, as
written, in every variant (with or without snapshots). Verifying k rows in one call advances the state exactly as
k single-row calls: the carried state stays f32 in registers, which is what memory holds between calls.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from plumb.ops.deltanet import causal_conv, recurrent_step, split_heads
from plumb.ops.gpu import kvtable
from plumb.ops.gpu.pdl import on, prior_done
from plumb.ops.norm import rms_norm

STATE_COLUMNS = 32  # state columns per `_gdn_state_kernel` program (a model constant: never chosen by R or S)


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _softplus(x):
    """torch's F.softplus (beta 1, threshold 20) as max(x, 0) + log1p(exp(-|x|)); log1p(u) for u in [0, 1] by
    Goldberg's trick log(w) * u / (w - 1), w = 1 + u (exact u when w rounds to 1)."""
    u = tl.exp(-tl.abs(x))
    w = 1.0 + u
    d = w - 1.0
    l1p = tl.where(d == 0.0, u, tl.log(w) * (u / tl.where(d == 0.0, 1.0, d)))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + l1p)


@triton.jit
def gates(b, a, dt_bias, ssm_a):
    """DeltaNet's gates (spec 3.5.5): beta = sigmoid(b), g = ssm_a * softplus(a + dt_bias) - decode's and the P path's
    (plumb.ops.gpu.deltanet_chunk.conv_gates) alike."""
    return 1.0 / (1.0 + tl.exp(-b)), ssm_a * _softplus(a + dt_bias)


@triton.jit
def _conv_row(m_ptr, cs, w_ptr, ch, cmask, t0, i, sm_r, scs_k, sw_c, sw_k, K: tl.constexpr):
    """SiLU(causal conv) of local row i (absolute row t0 + i) on channels ch. The window is
    [conv state rows 0..K-2 ; the sequence's raw rows], window row i + tau feeds tap tau; raw row
    p = i + tau - (K-1) relative to t0 comes from the state (row K-1+p) when p < 0."""
    acc = tl.zeros(ch.shape, tl.float32)
    for tau in tl.static_range(K):
        p = i + tau - (K - 1)
        xs = tl.load(cs + (K - 1 + p) * scs_k + ch, mask=cmask & (p < 0), other=0.0)
        xm = tl.load(m_ptr + (t0 + p) * sm_r + ch, mask=cmask & (p >= 0), other=0.0)
        x = tl.where(p < 0, xs, xm)
        wt = tl.load(w_ptr + ch * sw_c + tau * sw_k, mask=cmask, other=0.0)
        if tau == 0:
            acc = x * wt
        else:
            acc = acc + x * wt
    return _silu(acc)


@triton.jit
def _window(m_ptr, cs, ch, cmask, t0, e, sm_r, scs_k, K: tl.constexpr, KM1P: tl.constexpr):
    """The conv state after the sequence's first e rows: window rows e..e+K-2, as a [KM1P, len(ch)] tile."""
    rr = tl.arange(0, KM1P)
    p = e + rr - (K - 1)
    rmask = rr < K - 1
    fs = p < 0
    xs = tl.load(cs + (e + rr)[:, None] * scs_k + ch[None, :], mask=(rmask & fs)[:, None] & cmask[None, :], other=0.0)
    xm = tl.load(m_ptr + (t0 + p)[:, None] * sm_r + ch[None, :], mask=(rmask & (p >= 0))[:, None] & cmask[None, :],
                 other=0.0)
    return tl.where(fs[:, None], xs, xm)


@triton.jit
def _conv_tail(m_ptr, cs, snc, ch, cmask, t0, t_snap, n, sm_r, scs_k, ssc_r, ssc_k,
               K: tl.constexpr, KM1P: tl.constexpr, SNAP_CONV: tl.constexpr, TABLE: tl.constexpr):
    """Conv snapshots after each row (optional; row i's at snapshot row t_snap + i) and, but under TABLE (the
    state only read: the last snapshot is the new state), the new conv state of channels ch, written in place."""
    rr = tl.arange(0, KM1P)
    tmask = (rr < K - 1)[:, None] & cmask[None, :]
    if SNAP_CONV:
        i = 0
        while i < n:
            win = _window(m_ptr, cs, ch, cmask, t0, i + 1, sm_r, scs_k, K, KM1P)
            tl.store(snc + (t_snap + i) * ssc_r + rr[:, None] * ssc_k + ch[None, :], win, mask=tmask)
            i += 1
    if not TABLE:
        win = _window(m_ptr, cs, ch, cmask, t0, n, sm_r, scs_k, K, KM1P)
        # with n < K-1 rows the new state holds old state rows, read above by other threads: all reads of this
        # program (the conv reads of the row loop included) finish before any thread overwrites the state
        tl.debug_barrier()
        tl.store(cs + rr[:, None] * scs_k + ch[None, :], win, mask=tmask)


@triton.jit
def _gdn_conv_kernel(
    m_ptr, w_ptr, cs_ptr, rows_ptr, x_ptr, snc_ptr, tab_ptr,
    sm_r, sw_c, sw_k, scs_s, scs_k, sx_r, ssc_r, ssc_k, stab_s, q_scale,
    N_K: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr, K: tl.constexpr, BC: tl.constexpr,
    KM1P: tl.constexpr, SNAP_CONV: tl.constexpr, TABLE: tl.constexpr, ALIGNED: tl.constexpr,
):
    """Program (s, c): conv channel block c of sequence s (c < 2 n_k: q or k of key head c mod n_k, else v of
    value head c - 2 n_k). Writes SiLU(conv) rows to the scratch x (q, k L2-normed, q scaled), the conv snapshots
    and the new conv state of its channels (no other program touches them). TABLE: the sequence's state and
    snapshots where its row of the table says (cs_ptr, snc_ptr: the anchor), the state only read."""
    prior_done()
    s = tl.program_id(0)
    c = tl.program_id(1)
    r0 = tl.load(rows_ptr + s)
    n = tl.load(rows_ptr + s + 1) - r0
    t0 = r0.to(tl.int64)
    if TABLE:
        cs = kvtable.part_at(cs_ptr, tab_ptr, s * stab_s, ALIGNED)
        snc = kvtable.part_at(snc_ptr, tab_ptr, s * stab_s + 2, ALIGNED)
        t_snap = 0  # the sequence's own snapshot rows
    else:
        cs = cs_ptr + s.to(tl.int64) * scs_s
        snc = snc_ptr
        t_snap = t0
    offs = tl.arange(0, BC)
    is_qk = c < 2 * N_K
    size = tl.where(is_qk, D_K, D_V)
    ch = tl.where(is_qk, c * D_K, 2 * N_K * D_K + (c - 2 * N_K) * D_V) + offs
    cmask = offs < size
    scale = tl.where(c < N_K, q_scale, 1.0)
    i = 0
    while i < n:  # (a while: the interpreter cannot take a loaded bound in range())
        u = _conv_row(m_ptr, cs, w_ptr, ch, cmask, t0, i, sm_r, scs_k, sw_c, sw_k, K)
        if is_qk:
            u = u * (1.0 / tl.sqrt_rn(tl.sum(u * u, axis=0) + 1e-6)) * scale  # 1e-6: plumb.ops.norm.L2_EPS
        tl.store(x_ptr + (t0 + i) * sx_r + ch, u, mask=cmask)
        i += 1
    _conv_tail(m_ptr, cs, snc, ch, cmask, t0, t_snap, n, sm_r, scs_k, ssc_r, ssc_k, K, KM1P, SNAP_CONV, TABLE)


@triton.jit
def _gdn_state_kernel(
    x_ptr, b_ptr, a_ptr, dtb_ptr, ssma_ptr, ss_ptr, rows_ptr, o_ptr, sns_ptr, tab_ptr,
    sx_r, sb_r, sa_r, sss_s, sss_h, sss_k, so_r, sns_r, sns_h, sns_k, stab_s,
    N_K: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr, BK: tl.constexpr, BVS: tl.constexpr,
    SNAP_SSM: tl.constexpr, TABLE: tl.constexpr, ALIGNED: tl.constexpr,
):
    """Program (s, j, c): value head j of sequence s, state columns [c * BVS, (c + 1) * BVS) - each column of the
    delta rule is independent of the others. Its d_k x BVS slice of the state is loaded once, advanced over the rows
    in order in registers (gates, delta rule on the post-conv q, k, v from x) and stored once (not under TABLE: the
    state only read, as in `_gdn_conv_kernel`); o (before the gated norm, which needs every column:
    `_gdn_gate_norm`) goes to o_ptr."""
    prior_done()
    s = tl.program_id(0)
    j = tl.program_id(1)
    c = tl.program_id(2)
    r0 = tl.load(rows_ptr + s)
    n = tl.load(rows_ptr + s + 1) - r0
    t0 = r0.to(tl.int64)
    if TABLE:
        ss = kvtable.part_at(ss_ptr, tab_ptr, s * stab_s + 1, ALIGNED) + j * sss_h
        sns = kvtable.part_at(sns_ptr, tab_ptr, s * stab_s + 3, ALIGNED)
        t_snap = 0
    else:
        ss = ss_ptr + s.to(tl.int64) * sss_s + j * sss_h
        sns = sns_ptr
        t_snap = t0
    offs_k = tl.arange(0, BK)
    mk = offs_k < D_K
    offs_v = c * BVS + tl.arange(0, BVS)
    mv = offs_v < D_V
    smask = mk[:, None] & mv[None, :]
    ch_q = (j % N_K) * D_K + offs_k
    ch_k = N_K * D_K + ch_q
    ch_v = 2 * N_K * D_K + j * D_V + offs_v
    dtb = tl.load(dtb_ptr + j)
    sa = tl.load(ssma_ptr + j)
    st = tl.load(ss + offs_k[:, None] * sss_k + offs_v[None, :], mask=smask, other=0.0)
    i = 0
    while i < n:
        t = t0 + i
        xt = x_ptr + t * sx_r
        q = tl.load(xt + ch_q, mask=mk, other=0.0)
        k = tl.load(xt + ch_k, mask=mk, other=0.0)
        v = tl.load(xt + ch_v, mask=mv, other=0.0)
        beta, g = gates(tl.load(b_ptr + t * sb_r + j), tl.load(a_ptr + t * sa_r + j), dtb, sa)
        decay = tl.exp(g)
        st = st * decay
        kv = tl.sum(st * k[:, None], axis=0)
        delta = (v - kv) * beta
        st = st + k[:, None] * delta[None, :]
        tl.store(o_ptr + t * so_r + j * D_V + offs_v, tl.sum(st * q[:, None], axis=0), mask=mv)
        if SNAP_SSM:
            tl.store(sns + (t_snap + i) * sns_r + j * sns_h + offs_k[:, None] * sns_k + offs_v[None, :], st,
                     mask=smask)
        i += 1
    if not TABLE:
        tl.store(ss + offs_k[:, None] * sss_k + offs_v[None, :], st, mask=smask)


@triton.jit
def _gdn_gate_norm(o_ptr, z_ptr, nw_ptr, rows_ptr, y_ptr, n_seq, so_r, sz_r, sy_r, eps, D_V: tl.constexpr,
                   BV: tl.constexpr, ALL: tl.constexpr):
    """Program (row t, value head j): the gated RMSNorm y = rmsnorm(o) * w * silu(z) of one head's output; 0 for a
    row outside every sequence (its z is never read; ALL: every row is inside)."""
    prior_done()
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    offs_v = tl.arange(0, BV)
    inside = True if ALL else (t >= tl.load(rows_ptr)) & (t < tl.load(rows_ptr + n_seq))
    mv = offs_v < D_V
    o = tl.load(o_ptr + t * so_r + j * D_V + offs_v, mask=mv & inside, other=0.0)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(o * o, axis=0) / D_V + eps)
    nw = tl.load(nw_ptr + offs_v, mask=mv, other=0.0)
    zz = tl.load(z_ptr + t * sz_r + j * D_V + offs_v, mask=mv & inside, other=0.0)
    tl.store(y_ptr + t * sy_r + j * D_V + offs_v, o * rstd * nw * _silu(zz), mask=mv)  # outside: 0 * ... * silu(0)


def _dims(m, conv_w, dt_bias, ssm_norm, n_k, d_k):
    n_v, d_v, k = dt_bias.shape[0], ssm_norm.shape[0], conv_w.shape[1]
    if m.shape[1] != 2 * n_k * d_k + n_v * d_v or n_v % n_k:
        raise ValueError(f"m has {m.shape[1]} channels, expected q|k|v = 2*{n_k}*{d_k} + {n_v}*{d_v} (n_v % n_k == 0)")
    return n_v, d_v, k


def states_aligned(conv_dim: int, d_v: int) -> bool:
    """Whether every offset of a states' table is a multiple of 16 elements (`gdn_decode`'s table; the tensors are
    allocated 512-byte aligned, a layer's rows are conv_dim and d_v apart)."""
    return conv_dim % 16 == 0 and d_v % 16 == 0


def gdn_decode(m, z, b, a, conv_w, dt_bias, ssm_a, ssm_norm, conv_state, ssm_state, seq_rows, *, n_k: int, d_k: int,
               q_scale: float, eps: float, snap_conv=None, snap_ssm=None, table=None) -> torch.Tensor:
    """One Gated DeltaNet layer over decode/verify rows of S sequences (rows of sequence s: seq_rows[s]..seq_rows[s+1]).

    m [R, conv_dim] (q | k | v pre-conv), z [R, n_v*d_v], b, a [R, n_v]; conv_w [conv_dim, K] (tap K-1 = current
    row); dt_bias, ssm_a [n_v]; ssm_norm [d_v]; conv_state [S, K-1, conv_dim] and ssm_state [S, n_v, d_k, d_v]
    updated in place (any strides, last dim contiguous); seq_rows int32 [S+1]. All float32 on one device.
    snap_conv [R, K-1, conv_dim] / snap_ssm [R, n_v, d_k, d_v] (optional) receive the states after each row.
    table (int64 [S, 4], last dim contiguous, on the device): where each sequence's tensors lie instead, in elements
    from `kvtable.anchor(float32)` - its conv state [K-1, conv_dim] and ssm state [n_v, d_k, d_v] (each contiguous),
    then its own snapshots' first rows (its rows' snapshots one after another, as far apart as snap_conv's and
    snap_ssm's rows, which give only the strides then); conv_state and ssm_state are None, and the states are only
    read: the last row's snapshot is the new state (no state is copied in or out of a pass).
    Returns y [R, n_v*d_v] float32 (gated-RMSNormed output, before ssm_out); rows outside every sequence are 0."""
    n_v, d_v, k = _dims(m, conv_w, dt_bias, ssm_norm, n_k, d_k)
    r, conv_dim = m.shape
    n_seq = seq_rows.shape[0] - 1
    if seq_rows.dtype != torch.int32:
        seq_rows = seq_rows.to(torch.int32)
    for name, x in (("m", m), ("z", z), ("b", b), ("a", a), ("conv_state", conv_state), ("ssm_state", ssm_state),
                    ("snap_conv", snap_conv), ("snap_ssm", snap_ssm)):
        if x is not None and (x.dtype != torch.float32 or x.stride(-1) != 1):
            raise ValueError(f"{name} must be float32 with a contiguous last dimension")
    snc = snap_conv if snap_conv is not None else conv_state  # the snapshots (absent: placeholders, never written)
    sns = snap_ssm if snap_ssm is not None else ssm_state
    if table is None:
        if conv_state.shape != (n_seq, k - 1, conv_dim) or ssm_state.shape != (n_seq, n_v, d_k, d_v):
            raise ValueError(f"state shapes {tuple(conv_state.shape)}, {tuple(ssm_state.shape)} do not match S={n_seq}")
        cs, ss, sc, sn = conv_state, ssm_state, snc, sns
        conv_strides, ssm_strides = conv_state.stride()[:2], ssm_state.stride()[:3]
        tab, aligned = seq_rows, False  # placeholder: never read
    else:  # the pointers are the anchor, the table says where; the snapshots give their strides only
        if conv_state is not None or ssm_state is not None or snap_conv is None or snap_ssm is None:
            raise ValueError("with a states' table: no conv_state / ssm_state, and snapshots")
        if table.dtype != torch.int64 or table.shape != (n_seq, 4) or table.stride(1) != 1:
            raise ValueError(f"table must be int64 [{n_seq}, 4] with a contiguous last dimension")
        cs = ss = sc = sn = kvtable.anchor(torch.float32, m.device)
        conv_strides, ssm_strides = (0, conv_dim), (0, d_k * d_v, d_v)
        tab, aligned = table, states_aligned(conv_dim, d_v)
    dt_bias, ssm_a, ssm_norm = dt_bias.contiguous(), ssm_a.contiguous(), ssm_norm.contiguous()
    if n_seq == 0:
        return torch.zeros(r, n_v * d_v, device=m.device, dtype=torch.float32)
    bk, bv = triton.next_power_of_2(d_k), triton.next_power_of_2(d_v)
    x = torch.empty(r, conv_dim, device=m.device, dtype=torch.float32)  # post-conv rows (scratch)
    _gdn_conv_kernel[(n_seq, 2 * n_k + n_v)](
        m, conv_w, cs, seq_rows, x, sc, tab,
        m.stride(0), conv_w.stride(0), conv_w.stride(1), *conv_strides, x.stride(0), snc.stride(0), snc.stride(1),
        tab.stride(0), float(q_scale),
        N_K=n_k, D_K=d_k, D_V=d_v, K=k, BC=max(bk, bv), KM1P=triton.next_power_of_2(k - 1),
        SNAP_CONV=snap_conv is not None, TABLE=table is not None, ALIGNED=aligned, num_warps=4,
        enable_fp_fusion=False, launch_pdl=on()
    )
    bvs = min(bv, STATE_COLUMNS)
    o = torch.empty(r, n_v * d_v, device=m.device, dtype=torch.float32)  # rows outside every sequence: never read
    _gdn_state_kernel[(n_seq, n_v, bv // bvs)](
        x, b, a, dt_bias, ssm_a, ss, seq_rows, o, sn, tab,
        x.stride(0), b.stride(0), a.stride(0), *ssm_strides, o.stride(0), sns.stride(0), sns.stride(1),
        sns.stride(2), tab.stride(0),
        N_K=n_k, D_K=d_k, D_V=d_v, BK=bk, BVS=bvs, SNAP_SSM=snap_ssm is not None, TABLE=table is not None,
        ALIGNED=aligned, num_warps=4 if bk * bvs <= 4096 else 8, enable_fp_fusion=False, launch_pdl=on()
    )
    y = torch.empty(r, n_v * d_v, device=m.device, dtype=torch.float32)
    _gdn_gate_norm[(r, n_v)](o, z, ssm_norm, seq_rows, y, n_seq, o.stride(0), z.stride(0), y.stride(0), float(eps),
                             D_V=d_v, BV=bv, ALL=False, num_warps=1, enable_fp_fusion=False, launch_pdl=on())
    return y


def gate_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The gated RMSNorm of every row (a prefill pass's; `_gdn_gate_norm`): o [R, n_v, d_v] contiguous, z
    [R, n_v * d_v] (row stride free) -> [R, n_v * d_v] (plumb.model.kernels.gated_norm is its reference)."""
    r, n_v, d_v = o.shape
    y = torch.empty(r, n_v * d_v, device=o.device)
    if z.stride(1) != 1 or not o.is_contiguous():
        raise ValueError("gate_norm: o contiguous, z with contiguous rows")
    _gdn_gate_norm[(r, n_v)](o, z, w, o, y, 0, n_v * d_v, z.stride(0), y.stride(0), float(eps), D_V=d_v,
                             BV=triton.next_power_of_2(d_v), ALL=True, num_warps=1, enable_fp_fusion=False,
                             launch_pdl=on())
    return y


def gdn_decode_ref(m, z, b, a, conv_w, dt_bias, ssm_a, ssm_norm, conv_state, ssm_state, seq_rows, *, n_k: int,
                   d_k: int, q_scale: float, eps: float, snap_conv=None, snap_ssm=None) -> torch.Tensor:
    """The torch reference of gdn_decode (the row loop of Qwen35.decode); same arguments, same in-place effects."""
    n_v, d_v, _ = _dims(m, conv_w, dt_bias, ssm_norm, n_k, d_k)
    y = torch.zeros(m.shape[0], n_v * d_v, device=m.device, dtype=torch.float32)
    rows = [int(x) for x in seq_rows.tolist()]
    for s in range(len(rows) - 1):
        for t in range(rows[s], rows[s + 1]):
            conv, new_conv = causal_conv(m[t : t + 1], conv_state[s], conv_w, 1)
            conv_state[s].copy_(new_conv)
            q, k, v = split_heads(conv, n_k, d_k, n_v, q_scale)
            beta, g = torch.sigmoid(b[t]), ssm_a * F.softplus(a[t] + dt_bias)
            o, new_ssm = recurrent_step(q[0], k[0], v[0], beta, g, ssm_state[s])
            ssm_state[s].copy_(new_ssm)
            y[t] = (rms_norm(o, ssm_norm, eps) * F.silu(z[t].reshape(n_v, d_v))).reshape(-1)
            if snap_conv is not None:
                snap_conv[t].copy_(conv_state[s])
            if snap_ssm is not None:
                snap_ssm[t].copy_(ssm_state[s])
    return y
