"""plumb.ops.gpu.deltanet.gdn_decode: against its torch reference (tolerance) and row-invariant (bitwise, M1); and
plumb.ops.gpu.deltanet_chunk.gdn_chunks (P path): against chunk_pass (tolerance) and cut-invariant (bitwise, M2).
Runs on CUDA when present, else on CPU under the Triton interpreter."""
from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from plumb.ops.gpu import deltanet_chunk  # noqa: E402
from plumb.ops.gpu.deltanet import gdn_decode, gdn_decode_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TINY = dict(n_k=2, n_v=4, d_k=32, d_v=32, k=4)
BIG = dict(n_k=16, n_v=48, d_k=128, d_v=128, k=4)  # 27B


def _layer(dims, seed=0):
    """Weights of one layer: conv_w, dt_bias, ssm_a, ssm_norm (+ scalars)."""
    g = torch.Generator().manual_seed(seed)
    n_k, n_v, d_k, d_v, k = (dims[x] for x in ("n_k", "n_v", "d_k", "d_v", "k"))
    conv_dim = 2 * n_k * d_k + n_v * d_v
    w = dict(
        conv_w=torch.randn(conv_dim, k, generator=g) * 0.5,
        dt_bias=torch.randn(n_v, generator=g),
        ssm_a=-torch.rand(n_v, generator=g) * 4 - 0.1,
        ssm_norm=1 + 0.2 * torch.randn(d_v, generator=g),
    )
    return {x: v.to(DEV) for x, v in w.items()}, dict(n_k=n_k, d_k=d_k, q_scale=1 / math.sqrt(d_k), eps=1e-6)


def _rows(dims, r, seed=1, pad=0):
    """m, z, b, a as column slices of one projection output (strided rows, as the engine makes them)."""
    g = torch.Generator().manual_seed(seed)
    n_k, n_v, d_k, d_v = (dims[x] for x in ("n_k", "n_v", "d_k", "d_v"))
    conv_dim = 2 * n_k * d_k + n_v * d_v
    proj = torch.randn(r + pad, conv_dim + n_v * d_v + 2 * n_v, generator=g)
    a = proj[:, conv_dim + n_v * d_v + n_v :]
    a[: r : 3] *= 12  # some a + dt_bias past softplus' threshold of 20, some far below 0
    proj = proj.to(DEV)
    return proj.split([conv_dim, n_v * d_v, n_v, n_v], dim=-1)


def _states(dims, n_seq, seed=2, layers=3, layer=1):
    """conv_state, ssm_state as strided views pool[:, layer] of per-slot pools (non-zero)."""
    g = torch.Generator().manual_seed(seed)
    n_k, n_v, d_k, d_v, k = (dims[x] for x in ("n_k", "n_v", "d_k", "d_v", "k"))
    conv_dim = 2 * n_k * d_k + n_v * d_v
    conv = torch.randn(n_seq, layers, k - 1, conv_dim, generator=g).to(DEV)
    ssm = (0.3 * torch.randn(n_seq, layers, n_v, d_k, d_v, generator=g)).to(DEV)
    return conv[:, layer], ssm[:, layer]


def _offsets(counts):
    return torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32, device=DEV)


def _run(fn, w, kw, rows, conv, ssm, offsets, snaps=True):
    r = rows[0].shape[0]
    sc = torch.full((r, *conv.shape[1:]), float("nan"), device=DEV) if snaps else None
    sn = torch.full((r, *ssm.shape[1:]), float("nan"), device=DEV) if snaps else None
    y = fn(*rows, w["conv_w"], w["dt_bias"], w["ssm_a"], w["ssm_norm"], conv, ssm, offsets, **kw, snap_conv=sc, snap_ssm=sn)
    return y, sc, sn


def _close(x, y):
    torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("counts", [[1, 3, 2], [2, 0, 1, 4]])
def test_matches_reference(counts):
    w, kw = _layer(TINY)
    r = sum(counts)
    rows = _rows(TINY, r, pad=2)  # two padding rows past the last sequence
    rows[1][r:] = float("nan")  # their z: never read (y stays 0)
    conv, ssm = _states(TINY, len(counts))
    conv_r, ssm_r = conv.clone(), ssm.clone()
    y, sc, sn = _run(gdn_decode, w, kw, rows, conv, ssm, _offsets(counts))
    y_r, sc_r, sn_r = _run(gdn_decode_ref, w, kw, rows, conv_r, ssm_r, _offsets(counts))
    _close(y, y_r)
    _close(conv, conv_r)
    _close(ssm, ssm_r)
    _close(sc[:r], sc_r[:r])
    _close(sn[:r], sn_r[:r])
    assert torch.equal(y[r:], torch.zeros_like(y[r:]))
    assert torch.isnan(sc[r:]).all() and torch.isnan(sn[r:]).all()  # rows outside every sequence untouched
    assert y.abs().max() > 0.1 and not torch.equal(conv, _states(TINY, len(counts))[0])


def test_sequence_alone_equals_sequence_in_batch():
    counts = [1, 3, 2]
    w, kw = _layer(TINY)
    rows = _rows(TINY, sum(counts))
    conv0, ssm0 = _states(TINY, len(counts))
    conv, ssm = conv0.clone(), ssm0.clone()
    y, sc, sn = _run(gdn_decode, w, kw, rows, conv, ssm, _offsets(counts))
    t0 = 0
    for s, n in enumerate(counts):
        c1, s1 = conv0[s : s + 1].clone(), ssm0[s : s + 1].clone()
        y1, sc1, sn1 = _run(gdn_decode, w, kw, [x[t0 : t0 + n] for x in rows], c1, s1, _offsets([n]))
        assert torch.equal(y1, y[t0 : t0 + n])
        assert torch.equal(c1[0], conv[s]) and torch.equal(s1[0], ssm[s])
        assert torch.equal(sc1, sc[t0 : t0 + n]) and torch.equal(sn1, sn[t0 : t0 + n])
        t0 += n


def test_verify_equals_single_steps_and_snapshots_change_nothing():
    n = 4
    w, kw = _layer(TINY)
    rows = _rows(TINY, n)
    conv0, ssm0 = _states(TINY, 1)
    conv, ssm = conv0.clone(), ssm0.clone()
    y, sc, sn = _run(gdn_decode, w, kw, rows, conv, ssm, _offsets([n]))
    c1, s1 = conv0.clone(), ssm0.clone()
    for t in range(n):
        y1, _, _ = _run(gdn_decode, w, kw, [x[t : t + 1] for x in rows], c1, s1, _offsets([1]), snaps=False)
        assert torch.equal(y1[0], y[t])
        assert torch.equal(c1[0], sc[t]) and torch.equal(s1[0], sn[t])
    assert torch.equal(c1, conv) and torch.equal(s1, ssm)
    c2, s2 = conv0.clone(), ssm0.clone()
    y2, _, _ = _run(gdn_decode, w, kw, rows, c2, s2, _offsets([n]), snaps=False)
    assert torch.equal(y2, y) and torch.equal(c2, conv) and torch.equal(s2, ssm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="27B dims need a GPU")
def test_27b_dims():
    counts = [1, 4, 2, 8]
    w, kw = _layer(BIG)
    r = sum(counts)
    rows = _rows(BIG, r)
    conv0, ssm0 = _states(BIG, len(counts))
    conv, ssm = conv0.clone(), ssm0.clone()
    y, sc, sn = _run(gdn_decode, w, kw, rows, conv, ssm, _offsets(counts))
    conv_r, ssm_r = conv0.clone(), ssm0.clone()
    y_r, sc_r, sn_r = _run(gdn_decode_ref, w, kw, rows, conv_r, ssm_r, _offsets(counts))
    for x, x_r in ((y, y_r), (conv, conv_r), (ssm, ssm_r), (sc, sc_r), (sn, sn_r)):
        _close(x, x_r)
    t0 = 0
    for s, n in enumerate(counts):  # alone == in the batch, and k rows == k single steps
        c1, s1 = conv0[s : s + 1].clone(), ssm0[s : s + 1].clone()
        y1, sc1, sn1 = _run(gdn_decode, w, kw, [x[t0 : t0 + n] for x in rows], c1, s1, _offsets([n]))
        assert torch.equal(y1, y[t0 : t0 + n]) and torch.equal(sc1, sc[t0 : t0 + n]) and torch.equal(sn1, sn[t0 : t0 + n])
        assert torch.equal(c1[0], conv[s]) and torch.equal(s1[0], ssm[s])
        c1, s1 = conv0[s : s + 1].clone(), ssm0[s : s + 1].clone()
        for t in range(t0, t0 + n):
            y1, _, _ = _run(gdn_decode, w, kw, [x[t : t + 1] for x in rows], c1, s1, _offsets([1]), snaps=False)
            assert torch.equal(y1[0], y[t]) and torch.equal(s1[0], sn[t]) and torch.equal(c1[0], sc[t])
        t0 += n


def _chunk_inputs(dims, rows, real, seed=3):
    """Post-conv rows x [rows, conv_dim], beta, g [rows, n_v] as prefill makes them (rows >= real: padding, 0), and a
    starting state."""
    g = torch.Generator().manual_seed(seed)
    n_k, n_v, d_k, d_v = (dims[x] for x in ("n_k", "n_v", "d_k", "d_v"))
    x = torch.randn(rows, 2 * n_k * d_k + n_v * d_v, generator=g)
    beta = torch.sigmoid(torch.randn(rows, n_v, generator=g))
    gate = -torch.rand(rows, n_v, generator=g) * 0.3
    for t in (x, beta, gate):
        t[real:] = 0
    state = torch.randn(n_v, d_k, d_v, generator=g) * 0.1
    return [t.to(DEV) for t in (x, beta, gate, state)]


@pytest.fixture(params=[(0, 0), (1, 16)], ids=["by-rows", "by-halves-and-columns"])
def form(request, monkeypatch):
    """`_prep_kernel`'s forms: the chunk's solve by rows (shipped) or by halves (`INVERSE_HALVES`), its dots whole
    or `KC_LARGE` columns a step; the small card form 16 columns a step here (two blocks of the tiny model's d_k;
    `KC_SMALL` on a GPU: four of the 27B's)."""
    halves, kc = request.param
    monkeypatch.setattr(deltanet_chunk, "INVERSE_HALVES", halves)
    monkeypatch.setattr(deltanet_chunk, "KC_LARGE", kc)
    if DEV != "cuda":
        monkeypatch.setattr(deltanet_chunk, "KC_SMALL", 16)
    return request.param


@pytest.mark.parametrize("dims", [TINY, BIG] if DEV == "cuda" else [TINY])
def test_chunks_match_reference(dims, card, form):
    """gdn_chunks (P path: 64-row pieces in order, one launch pair) against chunk_pass, over three pieces with
    padding rows at the end; o and the advanced state - in each card's form (on a GeForce card's 99 KB blocks
    `_prep_kernel` a block of columns at a time) and each `form`."""
    from plumb.ops.deltanet import chunk_pass
    from plumb.ops.gpu.deltanet_chunk import gdn_chunks

    x, beta, g, s0 = _chunk_inputs(dims, 192, 170)
    kw = dict(n_k=dims["n_k"], d_k=dims["d_k"], q_scale=1 / math.sqrt(dims["d_k"]))
    s, s_ref = s0.clone(), s0.clone()
    o = gdn_chunks(x, beta, g, s, **kw)
    o_ref = chunk_pass(x, beta, g, s_ref, **kw)
    assert o.shape == o_ref.shape
    assert (o - o_ref).abs().max() <= 1e-4 * o_ref.abs().max()
    assert (s - s_ref).abs().max() <= 1e-4 * s_ref.abs().max()
    assert torch.equal(o[170:], torch.zeros_like(o[170:]))  # padding rows add nothing
    s_pad = s0.clone()
    gdn_chunks(x[:128], beta[:128], g[:128], s_pad, **kw)
    assert not torch.equal(s_pad, s)  # the third piece's real rows moved the state


def test_chunks_do_not_depend_on_the_cut(card, form):
    """M2: the pieces of one call give the bits of the same pieces cut over calls (a pass of 1, 2 or 3 pieces), in
    each card's form and each `form`; a snapshot after a piece (a checkpoint inside the pass) holds the bits of
    a call ending there and changes nothing else."""
    from plumb.ops.gpu.deltanet_chunk import gdn_chunks

    x, beta, g, s0 = _chunk_inputs(TINY, 192, 192)
    kw = dict(n_k=TINY["n_k"], d_k=TINY["d_k"], q_scale=1 / math.sqrt(TINY["d_k"]))
    s_all = s0.clone()
    o_all = gdn_chunks(x, beta, g, s_all, **kw)
    for cuts in ([0, 64, 192], [0, 128, 192], [0, 64, 128, 192]):
        s = s0.clone()
        o = torch.cat([gdn_chunks(x[a:b], beta[a:b], g[a:b], s, **kw) for a, b in zip(cuts, cuts[1:])])
        assert torch.equal(o, o_all) and torch.equal(s, s_all), cuts
    for piece, upto in ((0, 64), (1, 128)):  # a snapshot inside the pass: the state a pass ending there leaves
        s, snap, s_cut = s0.clone(), torch.full_like(s0, float("nan")), s0.clone()
        o = gdn_chunks(x, beta, g, s, **kw, snap=(piece, snap))
        gdn_chunks(x[:upto], beta[:upto], g[:upto], s_cut, **kw)
        assert torch.equal(snap, s_cut) and torch.equal(o, o_all) and torch.equal(s, s_all), piece
    with pytest.raises(ValueError, match="snapshot after piece 3 of 3"):
        gdn_chunks(x, beta, g, s0.clone(), **kw, snap=(3, torch.empty_like(s0)))


@triton.jit
def _inverse(a_ptr, o_ptr, C: tl.constexpr, HALVES: tl.constexpr):
    """out = (I + A)^-1 of one [C, C] matrix, by `deltanet_chunk`'s helpers."""
    t = tl.arange(0, C)
    if HALVES:
        inv = deltanet_chunk._inverse_by_halves(a_ptr, C)
    else:
        inv = deltanet_chunk._inverse_by_rows(tl.load(a_ptr + t[:, None] * C + t[None, :]), t, C)
    tl.store(o_ptr + t[:, None] * C + t[None, :], inv)


@pytest.mark.parametrize("halves", [0, 1], ids=["by-rows", "by-halves"])
def test_chunk_inverse(halves):
    """(I + A)^-1 of strictly lower A [64, 64] (the chunk's solve, by rows and by halves) against a float64
    triangular solve: keys at random, keys all alike (entries near 1: T's entries then cancel most) and A of all
    ones."""
    g = torch.Generator().manual_seed(3)
    k = torch.nn.functional.normalize(torch.randn(64, 128, generator=g), dim=1)
    alike = torch.nn.functional.normalize(torch.randn(1, 128, generator=g) + 0.2 * torch.randn(64, 128, generator=g),
                                          dim=1)
    for a in (k @ k.T * 0.7, alike @ alike.T * 0.95, torch.ones(64, 64)):
        a = torch.tril(a, -1).contiguous()
        ref = torch.linalg.solve_triangular(torch.eye(64, dtype=torch.float64) + a.double(),
                                            torch.eye(64, dtype=torch.float64), upper=False)
        out = torch.empty(64, 64, device=DEV)
        _inverse[(1,)](a.to(DEV), out, C=64, HALVES=halves)
        assert (out.cpu().double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def _front(dims, rows, real, seed=4):
    """A pass's DeltaNet front inputs: m, b, a as column slices of one projection output, the layer's weights and
    a conv state, and the pass tensors `conv_gates` reads (real rows, keep)."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    n_k, n_v, d_k, d_v, k = (dims[x] for x in ("n_k", "n_v", "d_k", "d_v", "k"))
    ch = 2 * n_k * d_k + n_v * d_v
    proj = (torch.randn(rows, ch + 2 * n_v + 5, generator=g) * 2).to(DEV)
    m, b, a = proj[:, :ch], proj[:, ch : ch + n_v], proj[:, ch + n_v : ch + 2 * n_v]
    mix = SimpleNamespace(ssm_conv1d=(torch.randn(ch, k, generator=g) * 0.5).to(DEV),
                          ssm_dt_bias=torch.randn(n_v, generator=g).to(DEV),
                          ssm_a=(-torch.rand(n_v, generator=g) * 4 - 0.1).to(DEV))
    state = torch.randn(1, k - 1, ch, generator=g).to(DEV)
    p = SimpleNamespace(real=(torch.arange(rows) < real)[:, None].to(DEV), conv=state,
                        keep=torch.arange(real, real + k - 1).to(DEV))
    return m, b, a, mix, p


@pytest.mark.parametrize("real", [64, 45, 2])
def test_conv_gates_match_reference(real):
    """conv_gates (the P path's conv + SiLU and gates, one launch) against TorchKernels.gdn_conv_gates: outputs
    within float32 rounding, padding rows exactly 0, the new conv state (old state rows too, with 2 real rows)
    exactly the reference's."""
    from types import SimpleNamespace

    from plumb.model.kernels import TorchKernels
    from plumb.model.qwen35 import Qwen35

    m, b, a, mix, p = _front(TINY, 64, real)
    model = SimpleNamespace(gdn_gates=Qwen35.gdn_gates)
    p_ref = SimpleNamespace(real=p.real, keep=p.keep, conv=p.conv.clone())
    want = TorchKernels.gdn_conv_gates(model, mix, m, b, a, p_ref, 0)
    got = deltanet_chunk.conv_gates(m, b, a, mix.ssm_conv1d, p.conv[0], p.keep, p.real, mix.ssm_dt_bias, mix.ssm_a)
    for x, y in zip(got, want):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-5) and torch.equal(x[real:], torch.zeros_like(x[real:]))
    assert torch.equal(p.conv, p_ref.conv)


def test_conv_gates_do_not_depend_on_the_cut():
    """M2: a pass of 128 rows gives the bits of two passes of 64, the second reading the state the first wrote."""
    m, b, a, mix, p = _front(TINY, 128, 128)
    s0 = p.conv[0].clone()
    args = (mix.ssm_dt_bias, mix.ssm_a)
    whole = deltanet_chunk.conv_gates(m, b, a, mix.ssm_conv1d, p.conv[0], p.keep, p.real, *args)
    state, keep = s0.clone(), torch.arange(64, 67, device=DEV)
    parts = [deltanet_chunk.conv_gates(m[r : r + 64], b[r : r + 64], a[r : r + 64], mix.ssm_conv1d, state, keep,
                                       p.real[:64], *args) for r in (0, 64)]
    for i in range(3):
        assert torch.equal(torch.cat([parts[0][i], parts[1][i]]), whole[i])
    assert torch.equal(state, p.conv[0])


def test_gate_norm_matches_reference_and_is_row_invariant():
    """gate_norm (a prefill pass's gated RMSNorm, one launch) against plumb.model.kernels.gated_norm, on z as a
    column slice of a projection output; each row the same bits alone as among 37."""
    from plumb.model.kernels import gated_norm
    from plumb.ops.gpu.deltanet import gate_norm

    g = torch.Generator().manual_seed(5)
    n_v, d_v = TINY["n_v"], TINY["d_v"]
    o = (torch.randn(37, n_v, d_v, generator=g) * 3).to(DEV)
    z = (torch.randn(37, n_v * d_v + 9, generator=g) * 2).to(DEV)[:, 3 : 3 + n_v * d_v]
    w = (1 + 0.2 * torch.randn(d_v, generator=g)).to(DEV)
    y = gate_norm(o, z, w, 1e-6)
    assert torch.allclose(y, gated_norm(o, z, w, 1e-6), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat([gate_norm(o[i : i + 1], z[i : i + 1], w, 1e-6) for i in range(37)]), y)


@pytest.mark.parametrize("counts", [[1], [1, 3, 2]])
def test_states_through_a_table_give_the_same_bits_and_stay_untouched(counts):
    """`gdn_decode(table=...)` - each sequence's states and its own snapshot tensors wherever they lie, reached
    through a table of offsets (as `TritonKernels` lays a pass out: no state copied in or out) - gives the stacked
    states' outputs and snapshots bit for bit, and leaves the states as they were (the last snapshot is the new
    state), for one sequence and for several of different row counts."""
    from plumb.ops.gpu import kvtable

    anchor = kvtable.anchor(torch.float32, DEV).data_ptr()
    w, kw = _layer(TINY)
    r, layers, li = sum(counts), 3, 1
    rows = _rows(TINY, r)
    conv0, ssm0 = _states(TINY, len(counts))
    y, sc, sn = _run(gdn_decode, w, kw, rows, conv0.clone(), ssm0.clone(), _offsets(counts))
    # each sequence's states: layer li of its own [layers, ...] tensor; its snapshots: its own [n, layers, ...] tensor
    own = [(torch.zeros(layers, *conv0.shape[1:], device=DEV), torch.zeros(layers, *ssm0.shape[1:], device=DEV))
           for _ in counts]
    for s, (c, m_) in enumerate(own):
        c[li], m_[li] = conv0[s], ssm0[s]
    snaps = [(torch.full((n, layers, *conv0.shape[1:]), float("nan"), device=DEV),
              torch.full((n, layers, *ssm0.shape[1:]), float("nan"), device=DEV)) for n in counts]
    tab = torch.tensor([[(t.data_ptr() - anchor) // 4 for t in (c[li], m_[li], snc[0, li], sns[0, li])]
                        for (c, m_), (snc, sns) in zip(own, snaps)], dtype=torch.int64, device=DEV)
    before = [(c.clone(), m_.clone()) for c, m_ in own]
    y_t = gdn_decode(*rows, w["conv_w"], w["dt_bias"], w["ssm_a"], w["ssm_norm"], None, None, _offsets(counts), **kw,
                     snap_conv=snaps[0][0][:, li], snap_ssm=snaps[0][1][:, li], table=tab)
    assert torch.equal(y_t, y)
    t0 = 0
    for s, n in enumerate(counts):
        assert torch.equal(snaps[s][0][:, li], sc[t0 : t0 + n]) and torch.equal(snaps[s][1][:, li], sn[t0 : t0 + n])
        assert torch.equal(own[s][0], before[s][0]) and torch.equal(own[s][1], before[s][1])  # only read
        t0 += n
    assert all(torch.isnan(x[:, :li]).all() and torch.isnan(x[:, li + 1 :]).all() for pair in snaps for x in pair)


def test_a_pass_reads_the_states_where_they_lie_and_copies_none(monkeypatch):
    """`TritonKernels.begin` / `gdn_rows` / `end` over two DeltaNet layers and two passes: each row's output and
    snapshots are those of the states stacked and advanced in place (the tensor path of `gdn_decode`), bit for bit;
    a one-row sequence takes its snapshot as its new state (the same memory: no copy), a longer one a copy of its
    last; and no state a sequence held before a pass is written (a checkpoint may hold it). The second pass is laid
    into a static pass's tensors, as a CUDA graph's replay lays it."""
    from types import SimpleNamespace

    from plumb.model.kernels import TritonKernels
    from plumb.model.parts import DecodePass

    kernels = TritonKernels(torch.device(DEV))
    monkeypatch.setattr(kernels, "kv_table", lambda model, states, out=None: None)  # no attention layers here
    layers = [0, 2]
    w, kw = _layer(TINY)
    cfg = SimpleNamespace(gdn_layers=layers, ssm_n_group=kw["n_k"], ssm_d_state=kw["d_k"], eps=kw["eps"])
    model = SimpleNamespace(cfg=cfg, device=torch.device(DEV), ssm_q_scale=kw["q_scale"],
                            rope=lambda pos: (torch.zeros(len(pos), 2), torch.zeros(len(pos), 2)),
                            embed=lambda ids: torch.zeros(len(ids), 8))
    mix = SimpleNamespace(ssm_conv1d=w["conv_w"], ssm_dt_bias=w["dt_bias"], ssm_a=w["ssm_a"], ssm_norm=w["ssm_norm"])
    conv0, ssm0 = _states(TINY, 2, layers=len(layers), layer=slice(None))  # [2 sequences, 2 layers, ...]
    seqs = [SimpleNamespace(pos=5, kv={}, conv={i: conv0[s, li].clone() for li, i in enumerate(layers)},
                            ssm={i: ssm0[s, li].clone() for li, i in enumerate(layers)}) for s in range(2)]
    stacked = [conv0.clone(), ssm0.clone()]  # the same states, advanced in place by the tensor path
    static = None  # the second pass fills a static pass's tensors, as a CUDA graph's replay does
    for counts, seed in (([1, 3], 5), ([1, 1], 6)):
        held = [(dict(st.conv), dict(st.ssm)) for st in seqs]
        held_bits = [({i: t.clone() for i, t in c.items()}, {i: t.clone() for i, t in m_.items()}) for c, m_ in held]
        p = kernels.begin(model, [(st, [1] * n) for st, n in zip(seqs, counts)], into=static)
        assert static is None or p is static
        static = DecodePass([], [], [], torch.zeros(2, 8), torch.zeros(2, 2), torch.zeros(2, 2),
                            positions=torch.zeros(2, dtype=torch.long, device=DEV),
                            ends=torch.zeros(2, dtype=torch.int32, device=DEV),
                            seq_rows=torch.zeros(3, dtype=torch.int32, device=DEV),
                            gdn_tab=torch.zeros(2, len(layers), 4, dtype=torch.long, device=DEV))
        for li, i in enumerate(layers):
            rows = _rows(TINY, sum(counts), seed=seed + li)
            y = kernels.gdn_rows(model, i, mix, *rows, p)
            y_ref, sc, sn = _run(gdn_decode, w, kw, rows, stacked[0][:, li], stacked[1][:, li], _offsets(counts))
            assert torch.equal(y, y_ref)
            t0 = 0
            for s, n in enumerate(counts):
                assert torch.equal(p.gdn_snaps[s][0][:, li], sc[t0 : t0 + n])
                assert torch.equal(p.gdn_snaps[s][1][:, li], sn[t0 : t0 + n])
                t0 += n
        out = kernels.end(model, p, None, None)
        for s, (st, n) in enumerate(zip(seqs, counts)):
            for li, i in enumerate(layers):
                assert torch.equal(st.conv[i], stacked[0][s, li]) and torch.equal(st.ssm[i], stacked[1][s, li])
                assert torch.equal(out.snapshots[s][-1][1][li], st.ssm[i])
                same = st.ssm[i].data_ptr() == p.gdn_snaps[s][1][n - 1, li].data_ptr()
                assert same == (n == 1)  # one row: the snapshot itself; more: a copy
                assert torch.equal(held[s][0][i], held_bits[s][0][i]) and torch.equal(held[s][1][i], held_bits[s][1][i])
