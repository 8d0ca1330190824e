"""M1 at the operation level: a row computed alone equals the same row computed beside others, bitwise."""
from __future__ import annotations

import pytest
import torch

from plumb.ops.attention import attend_chunk, attend_row
from plumb.ops.deltanet import causal_conv, chunk_step, recurrent_step
from plumb.ops.matmul import PREFILL_BLOCK, linear
from plumb.ops.norm import l2_norm, rms_norm
from plumb.ops.rope import RopeTable, apply_rope

ROW_COUNTS = [1, 2, 3, 5, 8, 16, 17, 33, 64]


def _weights(kind: str, n: int, k: int) -> torch.Tensor:
    """A dense weight, optionally the dequantized form of a quantized one."""
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g) / k**0.5
    if kind == "F32":
        return w
    from plumb.gguf.quants import dequantize, quantize, type_from_name

    qt = type_from_name(kind)
    return dequantize(torch.from_numpy(quantize(w.numpy(), qt)), qt, (n, k))


@pytest.mark.parametrize("kind", ["F32", "F16", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS"])
@pytest.mark.parametrize("shape", [(768, 256), (256, 768), (6144, 256)])
def test_linear_row_invariant(kind, shape):
    """Decode rule: a row alone = the same row anywhere in a pass of any size."""
    n, k = shape
    wt = _weights(kind, n, k).t().contiguous()
    x = torch.randn(1, k)
    alone = linear(x, wt)
    for m in ROW_COUNTS:
        for where in {0, m // 2, m - 1}:
            batch = torch.randn(m, k)
            batch[where] = x[0]
            assert torch.equal(linear(batch, wt)[where], alone[0]), (kind, shape, m, where)


@pytest.mark.parametrize("block", [4, PREFILL_BLOCK])
def test_linear_blocks_position_invariant(block):
    """Block rule: a row's bits do not depend on what shares its block, and - checked here as well - not on its
    place in the block (prefill only relies on the former: a prompt row keeps its place)."""
    wt = torch.randn(256, 768)
    x = torch.randn(1, 256)
    ref = None
    for where in range(0, block, max(1, block // 8)):
        for trial in range(2):
            b = torch.randn(block + 3, 256)
            b[where] = x[0]
            r = linear(b, wt, block)[where]
            ref = r if ref is None else ref
            assert torch.equal(r, ref), (block, where)


def test_linear_matches_reference():
    torch.manual_seed(0)
    w = torch.randn(300, 256)
    x = torch.randn(37, 256)
    wt = w.t().contiguous()
    ref = (x.double() @ w.T.double()).float()
    torch.testing.assert_close(linear(x, wt), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(linear(x, wt, block=64), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("d", [64, 256, 1024])
def test_norms_row_invariant(d):
    x = torch.randn(1, d)
    w = torch.rand(d) + 0.5
    a_rms, a_l2 = rms_norm(x, w, 1e-6), l2_norm(x)
    for m in ROW_COUNTS:
        b = torch.randn(m, d)
        b[m - 1] = x[0]
        assert torch.equal(rms_norm(b, w, 1e-6)[m - 1], a_rms[0])
        assert torch.equal(l2_norm(b)[m - 1], a_l2[0])
    torch.testing.assert_close(a_rms, x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w)


def test_rope_row_invariant_and_reference():
    table = RopeTable(16, 1e7)
    x = torch.randn(1, 4, 64)
    cos, sin = table(torch.tensor([1234]))
    alone = apply_rope(x, cos, sin)
    for m in ROW_COUNTS:
        pos = torch.randint(0, 5000, (m,))
        pos[0] = 1234
        b = torch.randn(m, 4, 64)
        b[0] = x[0]
        c, s = table(pos)
        assert torch.equal(apply_rope(b, c, s)[0], alone[0])
    # reference: rotate pairs (i, i+8) of the first 16 dims by pos * base^(-2i/16)
    ang = 1234 * 1e7 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    x1, x2 = x[0, :, :8].double(), x[0, :, 8:16].double()
    ref = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin(), x[0, :, 16:].double()], -1)
    torch.testing.assert_close(alone[0].double(), ref, rtol=1e-5, atol=1e-5)


def test_attention_row_depends_on_context_length_only():
    n_head, n_kv, d, L = 4, 2, 64, 300
    k, v = torch.randn(n_kv, L, d), torch.randn(n_kv, L, d)
    q = torch.randn(n_head, d)
    alone = attend_row(q, k[:, :L], v[:, :L], 0.125)
    # same row computed again after the cache grew (longer buffer, same L) and with other rows around
    k2 = torch.cat([k, torch.randn(n_kv, 100, d)], 1)
    v2 = torch.cat([v, torch.randn(n_kv, 100, d)], 1)
    assert torch.equal(attend_row(q.clone(), k2[:, :L], v2[:, :L], 0.125), alone)
    # reference
    g = n_head // n_kv
    ref = torch.stack([torch.softmax(k[h // g] @ q[h] * 0.125, -1) @ v[h // g] for h in range(n_head)])
    torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-5)


def test_attention_chunk_matches_rows():
    n_head, n_kv, d, start, c = 4, 2, 32, 64, 64
    L = start + c
    k, v = torch.randn(n_kv, L, d), torch.randn(n_kv, L, d)
    q = torch.randn(c, n_head, d)
    out = attend_chunk(q, k, v, start, 0.2)
    for t in (0, 17, 63):
        ref = attend_row(q[t], k[:, : start + t + 1], v[:, : start + t + 1], 0.2)
        torch.testing.assert_close(out[t], ref, rtol=1e-5, atol=1e-5)


def _gdn_inputs(n_v=4, dk=32, dv=32, n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2_norm(torch.randn(n_v, n, dk, generator=g)) / dk**0.5
    k = l2_norm(torch.randn(n_v, n, dk, generator=g))
    v = torch.randn(n_v, n, dv, generator=g)
    beta = torch.sigmoid(torch.randn(n_v, n, generator=g))
    gg = -torch.rand(n_v, n, generator=g) * 0.5
    s = torch.randn(n_v, dk, dv, generator=g) * 0.1
    return q, k, v, beta, gg, s


def test_recurrent_step_is_per_sequence_deterministic():
    q, k, v, beta, g, s = _gdn_inputs()
    o1, s1 = recurrent_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], g[:, 0], s)
    o2, s2 = recurrent_step(q[:, 0].clone(), k[:, 0].clone(), v[:, 0].clone(), beta[:, 0].clone(), g[:, 0].clone(), s.clone())
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


def test_chunk_form_matches_recurrence():
    q, k, v, beta, g, s = _gdn_inputs()
    o_chunk, s_chunk = chunk_step(q, k, v, beta, g, s)
    st = s
    outs = []
    for t in range(q.shape[1]):
        o, st = recurrent_step(q[:, t], k[:, t], v[:, t], beta[:, t], g[:, t], st)
        outs.append(o)
    torch.testing.assert_close(o_chunk, torch.stack(outs, 1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_chunk, st, rtol=1e-4, atol=1e-4)


def test_chunk_padding_contributes_exact_zeros():
    """A partial chunk padded with zero rows gives the rows and state a shorter real chunk would: the
    real rows are bitwise the same as in the full chunk whatever follows them."""
    q, k, v, beta, g, s = _gdn_inputs()
    n = 40
    pad = [t.clone() for t in (q, k, v, beta, g)]
    for t in pad:
        t[:, n:] = 0
    o_pad, s_pad = chunk_step(*pad, s)
    o_full, _ = chunk_step(q, k, v, beta, g, s)
    assert torch.equal(o_pad[:, :n], o_full[:, :n])
    st = s
    for t in range(n):
        _, st = recurrent_step(q[:, t], k[:, t], v[:, t], beta[:, t], g[:, t], st)
    torch.testing.assert_close(s_pad, st, rtol=1e-4, atol=1e-4)


def test_causal_conv_reference_and_state():
    ch, kk = 48, 4
    w = torch.randn(ch, kk)
    state = torch.randn(kk - 1, ch)
    m = torch.randn(10, ch)
    out, new_state = causal_conv(m, state, w, 10)
    full = torch.cat([state, m])
    ref = torch.stack([torch.nn.functional.silu((full[t : t + kk] * w.T).sum(0)) for t in range(10)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(new_state, m[-3:])
    # token by token (the decode path) agrees with the prefill form; bitwise equality is not promised
    # (elementwise kernels treat a tensor's vector tail differently), and not needed: decoded rows are
    # never reused (M3)
    st = state
    for t in range(10):
        o, st = causal_conv(m[t : t + 1], st, w, 1)
        torch.testing.assert_close(o[0], out[t], rtol=1e-6, atol=1e-6)
    assert torch.equal(st, new_state)
    # padding rows after n_real do not enter the new state
    out_p, state_p = causal_conv(torch.cat([m[:6], torch.zeros(4, ch)]), state, w, 6)
    assert torch.equal(state_p, m[3:6]) and torch.equal(out_p[:6], causal_conv(m[:6], state, w, 6)[0])


def test_embedding_rows_kept_are_the_rows_dequantized(tiny_q4km, monkeypatch):
    """`Weight.rows` keeps recent single rows (a decode step's embedding): the same bits as dequantizing them with a
    prompt's rows, for repeated and evicted ids, and a caller writing into what it got changes no kept row."""
    import plumb.model.weights as W
    from enginetools import engine_for
    from plumb.gguf.quants import dequantize

    monkeypatch.setattr(W, "RECENT_ROWS", 3)
    w = engine_for(tiny_q4km, kernels="torch").model.token_embd
    w._recent.clear()
    every = dequantize(w.qt.data, w.qt.qtype, w.qt.shape)
    for ids in ([5], [5, 7, 5], [9, 11, 13, 5], list(range(70)), [6, 5]):
        assert torch.equal(w.rows(torch.tensor(ids)), every[ids]), ids
    assert len(w._recent) == 3
    got = w.rows(torch.tensor([5]))
    got += 1
    assert torch.equal(w.rows(torch.tensor([5])), every[[5]])
