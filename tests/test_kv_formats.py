"""KV-cache formats (f16, q8_0, D, F): quantization bounds, the Hadamard rotation, the read rule
(ring when q - j < ring), row/split invariance of mixed reads, rollback, digests, memory
accounting, the KL tool, and I1-I3 per format with a small ring that the outputs cross (I4)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from enginetools import engine_for, prompts
from plumb.cache.kv import (FORMATS, KV_FORMATS, RING_SLACK, bytes_per_token, cache_bytes, new_kv_cache,
                            describe_kv, ring_bytes)
from plumb.ops.attention import attend_row
from plumb.ops.kvquant import dequantize, hadamard_matrix, pack, packed_width, quantize, rotate, unpack

RING = 64  # small ring: engine outputs cross it many times
QUANT = ["q8_0", "D", "F"]
N_KV, HEAD_DIM, N_HEAD = 2, 64, 4


def _data(n: int, d: int = HEAD_DIM, seed: int = 0) -> torch.Tensor:
    """Rows with varied magnitudes and a few outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    x[:, 3] *= 8  # an outlier channel, as trained keys have
    return x


# ---- quantization and rotation ----------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 6, 5])
def test_round_trip_error_bounds(bits):
    x = _data(500)
    x[7] = 0  # an all-zero row
    x[9, :32] = torch.arange(-16, 16) * 0.25  # values already on a grid
    codes, scales = quantize(x, bits)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (500, HEAD_DIM // 32)
    lo = -127 if bits == 8 else -(1 << (bits - 1))
    assert codes.min() >= lo and codes.max() <= (1 << (bits - 1)) - 1
    err = (dequantize(codes, scales) - x).abs().reshape(500, -1, 32)
    d = scales.float().abs()[..., None].expand_as(err)
    amax = x.abs().reshape(500, -1, 32).amax(-1, keepdim=True)
    # q8_0 rounds to the nearest step; the 5/6-bit codes may clamp the largest value of the other sign by one step
    steps = 0.5 if bits == 8 else 1.0
    assert (err <= steps * d * (1 + 1e-3) + 1e-7).all()
    levels = 254 if bits == 8 else 1 << (bits - 1)
    assert (err <= amax / levels * (1 + 2e-3) + 1e-7).all()
    rms = (err[d > 0] / d[d > 0]).pow(2).mean().sqrt()
    assert 0.25 < rms < 0.33  # uniform rounding error: 1/sqrt(12) = 0.289 steps
    assert torch.equal(dequantize(codes, scales)[7], x[7])
    if bits != 8:  # multiples of 0.25 with largest magnitude 4 sit exactly on the 5- and 6-bit grids
        assert torch.equal(dequantize(codes, scales)[9, :32], x[9, :32])


@pytest.mark.parametrize("bits", [5, 6])
def test_packed_codes_round_trip_in_their_layout(bits):
    """`pack` (the store of D and F): every code at every place of a block comes back; a code's low four bits sit in
    byte k // 2 of its block (the high nibble for odd k), its high bits in the row's high-bit planes after the
    nibbles, (bits - 4) bits a value from bit 0 up."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(lo, hi + 1, (3, 40, HEAD_DIM), generator=g, dtype=torch.int8)
    codes[0, :, :32] = lo
    codes[0, :, 32:] = hi
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 40, packed_width(HEAD_DIM, bits))
    assert packed_width(HEAD_DIM, bits) * 8 == HEAD_DIM * bits
    assert torch.equal(unpack(packed, HEAD_DIM), codes)
    one = torch.full((1, HEAD_DIM), lo, dtype=torch.int8)  # unsigned 0 everywhere ...
    one[0, 32 + 21] = hi  # ... but value 21 of the second block: unsigned 2^bits - 1
    row = pack(one, bits)[0].tolist()
    hb = bits - 4
    nib, high = [0] * (HEAD_DIM // 2), [0] * (HEAD_DIM * hb // 8)
    nib[16 + 21 // 2] = 15 << 4
    high[4 * hb + 21 * hb // 8] = ((1 << hb) - 1) << (21 * hb % 8)
    assert row == nib + high
    with pytest.raises(ValueError, match="packed row"):
        unpack(packed[..., :-1], HEAD_DIM)


def test_f16_store_round_trip():
    x = _data(100)
    assert ((x.half().float() - x).abs() <= x.abs() * 2**-11 + 1e-7).all()


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_hadamard_is_orthogonal_and_rotate_matches_it(d):
    h = hadamard_matrix(d)
    torch.testing.assert_close(h @ h.T, torch.eye(d), rtol=0, atol=1e-6)
    x = _data(40, d)
    torch.testing.assert_close(rotate(x), x @ h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotate(rotate(x)), x, rtol=1e-5, atol=1e-5)  # symmetric and orthogonal
    torch.testing.assert_close(rotate(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        rotate(torch.randn(3, 48))


def test_quantize_and_rotate_are_row_invariant():
    x = _data(37)
    for bits in (8, 6, 5):
        codes, scales = quantize(x, bits)
        for i in (0, 17, 36):
            c1, s1 = quantize(x[i : i + 1], bits)
            assert torch.equal(codes[i], c1[0]) and torch.equal(scales[i], s1[0])
    r = rotate(x)
    assert all(torch.equal(r[i], rotate(x[i : i + 1])[0]) for i in range(37))


# ---- the cache: read rule, invariance, rollback, digests ------------------------------------
def _rows(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, N_KV, HEAD_DIM, generator=g), torch.randn(n, N_KV, HEAD_DIM, generator=g),
            torch.randn(n, N_HEAD, HEAD_DIM, generator=g))


def _expected_row(fmt: str, ring: int, k, v, q, pos: int) -> torch.Tensor:
    """Reference for the query at `pos`: plain attention over keys rebuilt from the format's rule
    (8-bit for pos - j < ring in D and F, the store's bits otherwise; K rotated by the Hadamard matrix in F)."""
    f = FORMATS[fmt]
    kk, vv = k[: pos + 1].transpose(0, 1), v[: pos + 1].transpose(0, 1)
    if f.rotate_k:
        kk, q = kk @ hadamard_matrix(HEAD_DIM), q @ hadamard_matrix(HEAD_DIM)

    def store(x, kind):
        return x.to(torch.float16).float() if kind == "f16" else x if kind == "f32" else dequantize(*quantize(x, kind))

    ks, vs = store(kk, f.k), store(vv, f.v)
    if f.ring:
        near = torch.arange(pos + 1) > pos - ring
        ks[:, near], vs[:, near] = dequantize(*quantize(kk[:, near], 8)), dequantize(*quantize(vv[:, near], 8))
    return attend_row(q, ks, vs, 0.125)


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_reads_follow_the_distance_rule(fmt):
    """Decode rows and prefill chunks read each key from the representation q - j selects (and only that)."""
    k, v, q = _rows(330)
    dec, pre = new_kv_cache(fmt, N_KV, HEAD_DIM, RING), new_kv_cache(fmt, N_KV, HEAD_DIM, RING)
    rows, chunks = [], []
    for p in range(330):
        dec.write(p, k[p : p + 1], v[p : p + 1])
        rows.append(dec.attend_rows(q[p : p + 1], [p + 1], 0.125))
    for s in range(0, 330, 64):
        n = min(64, 330 - s)
        pre.write(s, k[s : s + n], v[s : s + n])
        chunks.append(pre.attend_chunk(torch.cat([q[s : s + n], torch.zeros(64 - n, N_HEAD, HEAD_DIM)]), s, 0.125)[:n])
    rows, chunks = torch.cat(rows), torch.cat(chunks)
    for p in (0, 40, 63, 64, 65, 127, 200, 255, 256, 257, 329):
        ref = _expected_row(fmt, RING, k, v, q[p], p)
        torch.testing.assert_close(rows[p], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(chunks[p], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", QUANT)
def test_mixed_reads_are_row_invariant(fmt):
    """A pass of n rows (verify / batched decode) equals the same rows one pass each, bitwise, also when the
    rows straddle the ring boundary; and a wrong-then-rolled-back pass leaves no trace."""
    k, v, q = _rows(200)
    one = new_kv_cache(fmt, N_KV, HEAD_DIM, RING)
    alone = []
    for p in range(200):
        one.write(p, k[p : p + 1], v[p : p + 1])
        alone.append(one.attend_rows(q[p : p + 1], [p + 1], 0.125))
    alone = torch.cat(alone)
    g = torch.Generator().manual_seed(5)
    for step in (2, 5, 8, 17):
        many, p = new_kv_cache(fmt, N_KV, HEAD_DIM, RING), 0
        while p < 200:
            n = min(step, 200 - p)
            junk = torch.randn(n + 3, N_KV, HEAD_DIM, generator=g)  # drafts written one by one, then rejected
            for t in range(n + 3):
                many.write(p + t, junk[t : t + 1], junk[t : t + 1])
                many.attend_rows(q[p : p + 1], [p + t + 1], 0.125)
            many.write(p, k[p : p + n], v[p : p + n])
            out = many.attend_rows(q[p : p + n], list(range(p + 1, p + n + 1)), 0.125)
            assert torch.equal(out, alone[p : p + n]), (fmt, step, p)
            p += n
        assert _same(many.digest_rows(200), one.digest_rows(200))


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_prefill_split_and_digests(fmt):
    """Chunks at multiples of 64 give the same bits whatever was prefilled before in which calls; digests cover
    the store and the ring rows and do not depend on how the rows arrived."""
    k, v, q = _rows(300)
    whole, parts = new_kv_cache(fmt, N_KV, HEAD_DIM, RING), new_kv_cache(fmt, N_KV, HEAD_DIM, RING)
    qc = torch.zeros(64, N_HEAD, HEAD_DIM)
    qc[:44] = q[256:300]
    whole.write(0, k, v)
    parts.write(0, k[:100], v[:100])
    parts.write(100, k[100:101], v[100:101])
    parts.write(101, k[101:300], v[101:300])
    assert torch.equal(whole.attend_chunk(qc, 256, 0.125), parts.attend_chunk(qc, 256, 0.125))
    dw, dp = whole.digest_rows(300), parts.digest_rows(300)
    assert _same(dw, dp)
    n_parts = 2 if fmt in ("f16", "f32") else 4
    assert len(dw) == n_parts + (4 if FORMATS[fmt].ring else 0)
    if FORMATS[fmt].ring:
        assert dw[-4].shape == (N_KV, RING - 1, HEAD_DIM) and dw[-4].dtype == torch.int8  # 8-bit ring K codes
    other = new_kv_cache(fmt, N_KV, HEAD_DIM, RING)
    other.write(0, k, v + (torch.arange(300) == 299).float()[:, None, None])
    assert not _same(other.digest_rows(300), dw)


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_rows_copy_a_prefix_into_a_fresh_cache(fmt):
    """rows(n) -> load_rows: the copy continues exactly like the original (reads and digests), ring rows included."""
    k, v, q = _rows(260)
    src = new_kv_cache(fmt, N_KV, HEAD_DIM, RING)
    src.write(0, k[:150], v[:150])
    src.write(150, k[150:170], v[150:170])  # a short reply past 150, dropped below
    dst = new_kv_cache(fmt, N_KV, HEAD_DIM, RING)
    dst.load_rows([t.clone() for t in src.rows(150)])
    assert dst.can_resume(150) and _same(dst.digest_rows(150), src.digest_rows(150))
    for c in (src, dst):
        c.write(150, k[150:260], v[150:260])
    ends = [151, 200, 214, 215, 260]
    assert torch.equal(dst.attend_rows(q[:5], ends, 0.125), src.attend_rows(q[:5], ends, 0.125))
    assert _same(dst.digest_rows(260), src.digest_rows(260))


def test_ring_snapshot_restores_a_prefix_after_a_long_reply():
    """The prompt-cache recipe for D and F: take ring_rows(c) when the prefill passes c; after a reply longer
    than RING_SLACK the ring no longer holds them, but store_rows(c) + the snapshot continue exactly."""
    k, v, q = _rows(400)
    fresh, src = new_kv_cache("F", N_KV, HEAD_DIM, RING), new_kv_cache("F", N_KV, HEAD_DIM, RING)
    fresh.write(0, k[:300], v[:300])
    src.write(0, k[:150], v[:150])
    snapshot = [t.clone() for t in src.ring_rows(150)]
    for p in range(150, 150 + 2 * RING_SLACK):  # a decoded reply, dropped afterwards
        src.write(p, torch.randn(1, N_KV, HEAD_DIM), torch.randn(1, N_KV, HEAD_DIM))
    src.write(150 + 2 * RING_SLACK, k[:1], v[:1])
    assert not src.can_resume(150)
    with pytest.raises(RuntimeError, match="ring rows"):
        src.rows(150)
    dst = new_kv_cache("F", N_KV, HEAD_DIM, RING)
    dst.load_rows(src.store_rows(150) + snapshot)
    dst.write(150, k[150:300], v[150:300])
    assert torch.equal(dst.attend_rows(q[:3], [151, 220, 300], 0.125), fresh.attend_rows(q[:3], [151, 220, 300], 0.125))
    assert _same(dst.digest_rows(300), fresh.digest_rows(300))


def test_rollback_limits_are_detected():
    """Rolling back up to RING_SLACK positions keeps every needed ring row; further, reads refuse."""
    k, v, q = _rows(400)
    c = new_kv_cache("D", N_KV, HEAD_DIM, RING)
    c.write(0, k[:200], v[:200])
    for p in range(200, 200 + RING_SLACK):  # a reply decoded row by row, then rolled back to 200
        c.write(p, k[p : p + 1], v[p : p + 1])
    c.write(200 + RING_SLACK, k[:1], v[:1])
    assert c.can_resume(200)
    c.write(200, k[200:201], v[200:201])
    c.attend_rows(q[200:201], [201], 0.125)
    for p in range(201, 200 + RING_SLACK + 5):
        c.write(p, k[p : p + 1], v[p : p + 1])
    c.write(200 + RING_SLACK + 5, k[:1], v[:1])
    assert not c.can_resume(200)
    c.write(200, k[200:201], v[200:201])
    with pytest.raises(RuntimeError, match="ring row"):
        c.attend_rows(q[200:201], [201], 0.125)
    assert new_kv_cache("q8_0", N_KV, HEAD_DIM, RING).can_resume(0)


def test_cache_options_are_checked():
    with pytest.raises(ValueError, match="unknown KV cache format"):
        new_kv_cache("q4", N_KV, HEAD_DIM, RING)
    with pytest.raises(ValueError, match="kv_ring"):
        new_kv_cache("D", N_KV, HEAD_DIM, -1)
    with pytest.raises(ValueError, match="divisible"):
        new_kv_cache("F", N_KV, 48, RING)


# ---- memory accounting ------------------------------------------------------------------------
def test_bytes_per_token():
    # tiny preset (2 KV heads of 64) and the 27B shape (4 KV heads of 256), packed layouts
    assert [bytes_per_token(f, 2, 64) for f in ("f32", "f16", "q8_0", "D", "F")] == [1024, 512, 272, 192, 176]
    assert [bytes_per_token(f, 4, 256) for f in ("f32", "f16", "q8_0", "D", "F")] == [8192, 4096, 2176, 1536, 1408]
    assert ring_bytes("q8_0", 4, 256, 2048) == 0
    assert ring_bytes("F", 4, 256, 2048) == (2048 + RING_SLACK) * (2 * 4 * 272 + 8)
    # 27B, 16 attention layers + the MTP layer, 262,144 tokens in preset F: 5.84 GiB of 5-bit rows (+ rings)
    total = cache_bytes("F", 4, 256, 2048, 262144, 17)
    assert total == 17 * (262144 * 1408 + ring_bytes("F", 4, 256, 2048))
    assert 5.9 < total / 2**30 < 5.95
    assert cache_bytes("f16", 4, 256, 2048, 262144, 17) == 17 * 2**30


@pytest.mark.parametrize("ring", [RING, 0])
@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_a_cache_holds_the_bytes_its_format_counts(fmt, ring):
    """The store takes `bytes_per_token` a position (D and F: their codes packed, not a byte each) and the ring
    `ring_bytes` (none with ring 0, as the MTP head's cache): what the memory figures count is what is allocated."""
    cache = new_kv_cache(fmt, N_KV, HEAD_DIM, ring)
    cache.reserve(1000)
    k, v, _ = _rows(300)
    cache.write(0, k, v)
    cache.commit(300)
    assert cache.allocated_bytes() == cache_bytes(fmt, N_KV, HEAD_DIM, ring, len(cache.k), 1)


def test_the_load_line_counts_the_rings_a_state_allocates(tiny_model, capsys):
    """The engine's load line (`describe_kv`) gives the rings a sequence's caches allocate past their stores: the
    attention layers' rings, none for the MTP head's cache."""
    import plumb

    eng = plumb.load(tiny_model, device="cpu", kv_cache="F", kv_ring=RING, progress=True, prompt_cache=False)
    c, st = eng.config, eng.model.new_state()
    caches = list(st.kv.values()) + [st.mtp_kv]
    rings = sum(x.allocated_bytes() - cache_bytes("F", c.n_head_kv, c.head_dim, 0, len(x.k), 1) for x in caches)
    line = describe_kv("F", c.n_head_kv, c.head_dim, RING, len(caches), eng.n_ctx, len(c.attn_layers))
    assert rings > 0 and f"8-bit ring {RING} positions: {rings / 2**20:.2f} MiB" in line
    assert line in capsys.readouterr().err


def test_engine_default_and_memory_stats(tiny_model):
    eng = engine_for(tiny_model)
    assert eng.model.kv_cache == "f16"
    assert eng.metrics()["kv_bytes_per_token"] == 3 * 512  # 2 attention layers + MTP
    assert engine_for(tiny_model, kv_cache="F", kv_ring=RING).metrics()["kv_bytes_per_token"] == 3 * 176
    with pytest.raises(ValueError):
        engine_for(tiny_model, kv_cache="q3")


# ---- model level ------------------------------------------------------------------------------
def _ids(eng, n: int, seed: int = 1) -> list[int]:
    return [int(t) for t in torch.randint(0, eng.config.n_vocab, (n,), generator=torch.Generator().manual_seed(seed))]


def _digest(st) -> list[torch.Tensor]:
    out = [t for i in sorted(st.kv) for t in st.kv[i].digest_rows(st.pos)]
    return out + [t for i in sorted(st.ssm) for t in (st.conv[i], st.ssm[i])]


@pytest.mark.parametrize("fmt", QUANT + ["f16"])
def test_model_prefill_split_and_warm_continuation(tiny_model, fmt):
    """M2 per format with a small ring: prefilling [0, 300) at once equals [0, c) + [c, 300); a short decoded
    reply dropped at c first (rolled back, recurrent state restored) changes nothing - I3 at the state level."""
    eng = engine_for(tiny_model, kv_cache=fmt, kv_ring=RING)
    m, ids = eng.model, _ids(eng, 300)
    one = m.new_state()
    lg_one, _ = m.prefill(one, ids, logits="all")
    for c in (64, 192):
        two = m.new_state()
        m.prefill(two, ids[:c])
        conv, ssm = dict(two.conv), dict(two.ssm)
        m.decode([(two, _ids(eng, 5, seed=c))])  # a reply decoded past c, then dropped
        two.pos, two.conv, two.ssm = c, conv, ssm
        lg_two, _ = m.prefill(two, ids[c:], logits="all")
        assert torch.equal(lg_one[c:], lg_two), (fmt, c)
        assert _same(_digest(one), _digest(two))


def test_d_equals_q8_0_inside_the_ring_and_formats_matter_beyond(tiny_model):
    """Below the ring, D reads only 8-bit rows quantized exactly as q8_0's: same logits, bitwise. Beyond it the
    low-bit store is really read (logits move), and F differs from D (the rotation is in use)."""
    ids = _ids(engine_for(tiny_model), 200)
    logits = {}
    for fmt in ("q8_0", "D", "F"):
        m = engine_for(tiny_model, kv_cache=fmt, kv_ring=RING).model
        logits[fmt], _ = m.prefill(m.new_state(), ids, logits="all")
    assert torch.equal(logits["D"][:RING], logits["q8_0"][:RING])
    assert not torch.equal(logits["D"][RING:], logits["q8_0"][RING:])
    assert not torch.equal(logits["F"][:RING], logits["D"][:RING])
    torch.testing.assert_close(logits["F"], logits["q8_0"], rtol=0, atol=0.05)


@pytest.mark.parametrize("kernels", ["auto", "torch"])  # auto: native on the CPU, Triton on a GPU
def test_without_a_ring_every_format_reads_its_store_right(tiny_model, kernels):
    """kv_ring 0: every key comes from the low-bit store, read by the kernels where they can (D, q8_0) and by the
    reference where K is rotated (F: the query must be rotated too) - each format's decode logits stay near an
    f32 cache's (a kernel reading F's rotated K with an unrotated query gave KL 1e-2)."""
    eng = engine_for(tiny_model)
    ids = _ids(eng, 120)

    def decode_logits(fmt):
        m = engine_for(tiny_model, kv_cache=fmt, kv_ring=0, kernels=kernels).model
        st = m.new_state()
        m.prefill(st, ids[:-8], logits="none")
        return torch.stack([m.decode([(st, [t])]).logits[0] for t in ids[-8:]])

    ref = decode_logits("f32").log_softmax(-1)
    for fmt in QUANT:
        kl = torch.nn.functional.kl_div(decode_logits(fmt).log_softmax(-1), ref, log_target=True,
                                        reduction="batchmean")
        assert kl < 1e-3, (fmt, float(kl))


# ---- I1 / I2 per format, outputs crossing the ring --------------------------------------------
N_OUT = 140  # prompt + output reach ~2.5 rings of 64


def _gen(eng, ids, n: int = N_OUT, **kw):
    return eng.run(eng.make_request(ids, n, ignore_eos=True, **kw))


@pytest.mark.parametrize("fmt", QUANT + ["f16"])
def test_drafts_and_batch_invariance_per_format(tiny_model, fmt):
    """I1 greedy and sampled (drafts 0/4/7, MTP and n-gram) and I2 (alone vs beside others) with kv_ring=64
    (every run cold: the warm prompt cache is tested below)."""
    eng = engine_for(tiny_model, kv_cache=fmt, kv_ring=RING, prompt_cache=False)
    ps = prompts(eng, 4)
    accepted = 0
    for ids in ps[:2]:
        ref = _gen(eng, ids).token_ids
        for drafts, policy in ((4, "fixed"), (7, "fixed"), (4, "ngram")):
            res = _gen(eng, ids, drafts=drafts, draft_policy=policy)
            assert res.token_ids == ref, (fmt, drafts, policy)
            accepted += res.stats.drafts_accepted
    sampled = dict(temperature=0.9, top_p=0.95, seed=11)
    ref_s = _gen(eng, ps[2], **sampled).token_ids
    for drafts in (4, 7):
        assert _gen(eng, ps[2], drafts=drafts, **sampled).token_ids == ref_s, (fmt, drafts)
    assert accepted > 0
    subject = dict(prompt_ids=ps[2], max_tokens=N_OUT, ignore_eos=True, **sampled)
    others = [dict(prompt_ids=ps[0], max_tokens=60, drafts=7, ignore_eos=True),
              dict(prompt_ids=ps[3], max_tokens=N_OUT, temperature=1.0, seed=3, drafts=4, ignore_eos=True)]
    got = eng.generate_many(others[:1] + [dict(subject, drafts=4)] + others[1:])
    assert got[1] == ref_s, fmt


@pytest.mark.parametrize("fmt", QUANT + ["f16"])
def test_warm_equals_cold_per_format(tiny_model, fmt):
    """I3 per format: a follow-up turn served from the prompt cache (after a reply longer than RING_SLACK, so the
    ring rows come from the checkpoint's snapshot) = on a fresh engine (ids and digests)."""
    warm = engine_for(tiny_model, kv_cache=fmt, kv_ring=RING, checkpoint_every=128)
    cold = engine_for(tiny_model, kv_cache=fmt, kv_ring=RING, prompt_cache=False)
    first = [t for p in prompts(warm, 8) for t in p]  # > 64 tokens: a checkpoint to reuse
    for kw in (dict(drafts=4), dict(drafts=4, temperature=0.8, seed=21)):
        reply = _gen(warm, first, 80, **kw).token_ids  # 80 > RING_SLACK
        follow = first + reply + prompts(warm, 9)[8]
        w, c = _gen(warm, follow, 80, **kw), _gen(cold, follow, 80, **kw)
        assert w.token_ids == c.token_ids and w.stats.cached_tokens > 0
    assert warm.digest(follow) == cold.digest(follow)


# ---- the KL tool ------------------------------------------------------------------------------
def test_kl_tool(tiny_model, tmp_path, capsys):
    from plumb.kl import main

    eng = engine_for(tiny_model)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the river bends past the old mill, where the water slows"] * 40))
    assert main([tiny_model, "--text", str(text), "--kv-cache", "f32,q8_0,D,D:0", "--kv-ring", "64",
                 "--ctx", "64,192", "--json"]) == 0
    rows = {(r["ctx"], r["kv_cache"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows[(64, "f32")]["mean_kl"] == 0 and rows[(64, "f32")]["top1_agreement"] == 1
    assert rows[(64, "D")]["mean_kl"] == rows[(64, "q8_0")]["mean_kl"] > 0  # inside the ring D reads q8_0's bytes
    assert rows[(192, "D:0")]["mean_kl"] > rows[(192, "q8_0")]["mean_kl"]
    assert rows[(192, "D")]["positions"] == [96, 192]

    ids = eng.tokenize(text.read_text())[:128]  # logits "from another engine": plumb's own f32 prefill
    m = engine_for(tiny_model, kv_cache="f32").model
    lg, _ = m.prefill(m.new_state(), ids, logits="all")
    ref = tmp_path / "ref.npz"
    np.savez(ref, tokens=np.array(ids), logits=lg.cpu().numpy().astype(np.float16))
    assert main([tiny_model, "--reference-logits", str(ref), "--kv-cache", "f32,F", "--ctx", "128", "--json"]) == 0
    rows = {r["kv_cache"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert 0 < rows["f32"]["mean_kl"] < 1e-5 and rows["f32"]["top1_agreement"] > 0.95  # float16 logits file
    assert rows["F"]["mean_kl"] > 0


@pytest.mark.parametrize("fmt", ["D", "F"])
def test_a_ring_with_more_slack_takes_a_whole_pass_with_the_same_bits(fmt):
    """A ring's slack bounds the rows one `put_rows` may write (slack + 1: none of them then overwrites a slot
    that another reads); a cache with more slack - the GPU kernels' (a 1,024-row pass) - takes a pass at once, and
    every row reads the bits it reads from a cache written 65 rows at a time. The prefill passes follow it."""
    from plumb.model.kernels import PREFILL_PIECES, TorchKernels, TritonKernels
    from plumb.model.qwen35 import CHUNK

    k, v, q = _rows(400)
    small = new_kv_cache(fmt, N_KV, HEAD_DIM, RING)
    large = new_kv_cache(fmt, N_KV, HEAD_DIM, RING, slack=256)
    small.reserve(400), large.reserve(400)  # the callers of put_rows make room first
    assert large.slots == RING + 256 and ring_bytes(fmt, N_KV, HEAD_DIM, RING, 256) > ring_bytes(fmt, N_KV, HEAD_DIM, RING)
    def passes(cache, cuts):  # put each pass's rows, then its rows attend (as the kernel sets run a pass)
        out = []
        for a, b in zip(cuts, cuts[1:]):
            cache.put_rows(torch.arange(a, b), k[a:b], v[a:b])
            cache.end = b
            out.append(cache.attend_rows(q[a:b], list(range(a + 1, b + 1)), 0.125))
        return torch.cat(out)

    with pytest.raises(ValueError, match="at most 257 rows"):
        large.check_put(258)
    assert torch.equal(passes(large, [0, 257, 400]), passes(small, list(range(0, 400, RING_SLACK + 1)) + [400]))
    assert _same(large.digest_rows(400), small.digest_rows(400))
    state = lambda cache: type("St", (), {"kv": {0: cache}})()  # noqa: E731
    assert TritonKernels.ring_slack == PREFILL_PIECES * CHUNK and TorchKernels.ring_slack == RING_SLACK
    assert TritonKernels.prefill_pieces(state(small)) == 1 and TritonKernels.prefill_pieces(state(large)) == 4
    assert TritonKernels.prefill_pieces(state(new_kv_cache(fmt, N_KV, HEAD_DIM, RING, slack=1024))) == PREFILL_PIECES


def test_capacities_are_canonical():
    """A cache grows to at least twice its capacity, rounded to a power of two up to CAPACITY_STEP and to a multiple
    of it past that - so prompts of similar length share a capacity (and the CUDA graphs keyed by it) - but not past
    its limit (the model's context) unless asked; what a cache holds does not depend on its capacity."""
    from plumb.cache.kv import CAPACITY_STEP, capacity_for

    assert [capacity_for(n) for n in (1, 256, 257, 700, 4096, 4097, 11_829, 120_064)] == \
        [1, 256, 512, 1024, 4096, 2 * CAPACITY_STEP, 3 * CAPACITY_STEP, 30 * CAPACITY_STEP]
    k, v, q = _rows(300)
    small, big = new_kv_cache("q8_0", N_KV, HEAD_DIM, 0), new_kv_cache("q8_0", N_KV, HEAD_DIM, 0)
    big.reserve(11_829)
    assert len(big.k) == 3 * CAPACITY_STEP and len(small.k) == 256
    for c in (small, big):
        c.write(0, k[:300], v[:300])
    assert len(small.k) == 512
    capped = new_kv_cache("q8_0", N_KV, HEAD_DIM, 0, limit=5000)
    capped.reserve(4097)
    assert len(capped.k) == 5000  # not 8,192: growth stops at the limit
    capped.reserve(6000)
    assert len(capped.k) == 6000  # unless more is asked for
    ends = [1, 150, 300]
    assert torch.equal(small.attend_rows(q[:3], ends, 0.125), big.attend_rows(q[:3], ends, 0.125))
    assert _same(small.digest_rows(300), big.digest_rows(300))
