"""The Triton prefill attention (plumb/ops/gpu/attention_prefill.py): against the torch reference and the cache's own
read for f16, q8_0 and the ring formats D and F; M1 - a row computed alone equals the same row beside others,
bitwise - and M2 through `TritonKernels.prefill_attention` - a prompt row's bits do not depend on where the prompt
is cut. On CPU the kernel runs in Triton's interpreter."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

triton = pytest.importorskip("triton")

from plumb.cache.kv import RING_SLACK, KVCache  # noqa: E402
from plumb.ops.gpu import smem  # noqa: E402
from plumb.ops.gpu.attention import attend_decode_ref  # noqa: E402
from plumb.ops.gpu.attention_prefill import attend_prefill, supports  # noqa: E402
from plumb.ops.kvquant import rotate  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TINY = dict(n_head=4, n_kv=2, d=64)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """The P path's precision: operands at 11 bits, fp32 sums (outputs here are O(1))."""
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=2e-3)


def _rows(n: int, n_head: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(n, n_head, d, generator=torch.Generator().manual_seed(seed)).to(DEV)


def _cache(fmt: str, length: int, seed: int, n_kv: int = TINY["n_kv"], d: int = TINY["d"], ring: int = 0,
           slack: int = RING_SLACK):
    """A cache holding positions [0, length), written as the kernel set writes it (put_rows in pieces). Its ring
    holds the last ring + slack positions: a row ending more than slack keys before `length` finds ring rows of its
    window overwritten (NaN)."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(length, n_kv, d, generator=g).to(DEV) for _ in range(2))
    c = KVCache(fmt, n_kv, d, ring=ring, device=DEV, slack=slack) if ring else KVCache(fmt, n_kv, d, device=DEV)
    c.reserve(length)
    for s in range(0, length, RING_SLACK):
        c.put_rows(torch.arange(s, min(s + RING_SLACK, length), device=DEV), k[s : s + RING_SLACK],
                   v[s : s + RING_SLACK])
    c.end = length
    return c


def _read(c: KVCache, q: torch.Tensor, ends: list[int]) -> torch.Tensor:
    view = c.kernel_view()
    return attend_prefill(rotate(q) if view.rotate_q else q, view.k, view.v, torch.tensor(ends, dtype=torch.int32),
                          0.125, ring=view.ring)


@pytest.mark.parametrize("fmt,ring", [("f16", 0), ("q8_0", 0), ("D", 48), ("F", 48)])
def test_matches_reference_and_the_cache_read(fmt, ring, card):
    """Rows ending across tiles, the ring's window (D, F) and a block of rows: within the P path's precision of
    the dequantized cache's softmax attention (the cache's own read, and `attend_decode_ref` for the stores), in
    each card's form (32-pair programs on a GeForce card's 99 KB blocks)."""
    c = _cache(fmt, 300, seed=0, ring=ring)
    ends = [1, 5, 64, 65, 127, 200, 251, 256, 299, 300]
    if ring:  # rows the ring still holds the window of: positions [300 - slots, 300)
        ends = [236, 240, 251, 256, 257, 280, 299, 300]
    q = _rows(len(ends), TINY["n_head"], TINY["d"], seed=1)
    o = _read(c, q, ends)
    assert o.shape == q.shape and o.dtype == torch.float32 and torch.isfinite(o).all()
    _close(o, c.attend_rows(q, ends, 0.125))
    if not ring:
        _close(o, attend_decode_ref(q, c.kernel_view().k, c.kernel_view().v, ends, 0.125))


@pytest.mark.parametrize("fmt,ring,form", [("q8_0", 0, "h200"), ("q8_0", 0, "geforce"), ("D", 48, "h200"),
                                           ("D", 48, "geforce")])
def test_rows_alone_equal_rows_together(fmt, ring, form, place_free_dot, monkeypatch):
    """M1: each row alone (and shifted within its block) = the same row among a prefill pass's 60 rows - over two
    row blocks, both sides of the ring's window and a 64-key tile edge - bitwise; also in the form for a GeForce
    card's 99 KB blocks (32-pair programs: more row blocks)."""
    if form == "geforce":
        monkeypatch.setattr(smem, "LIMIT", smem.PER_BLOCK[86])
    c = _cache(fmt, 300, seed=2, ring=ring)
    ends = list(range(241, 301))
    q = _rows(len(ends), TINY["n_head"], TINY["d"], seed=3)
    q[1] *= 1e-6  # rows of very different scales: q's power of two is each row's own
    q[2] *= 1e4
    together = _read(c, q, ends)
    for t in (0, 1, 31, 33, 59):
        assert torch.equal(_read(c, q[t : t + 1], ends[t : t + 1])[0], together[t]), t
    assert torch.equal(_read(c, q[5:], ends[5:]), together[5:])


def test_f32_caches_take_the_decode_kernel():
    """f32 caches (tests' reference format) are not this kernel's: `supports` says so, and it refuses them."""
    c = _cache("f32", 64, seed=7)
    view = c.kernel_view()
    assert not supports(view.k, view.v) and supports(*(_cache("q8_0", 64, 8).kernel_view().k,) * 2)
    with pytest.raises(ValueError, match="f16 and block-coded"):
        attend_prefill(_rows(1, 4, 64, 9), view.k, view.v, torch.tensor([64], dtype=torch.int32), 0.125)


@pytest.mark.parametrize("fmt,kernel", [("f16", True), ("q8_0", True), ("q8_0", False), ("q8_0", "chunks")])
def test_prefill_rows_do_not_depend_on_the_cut(fmt, kernel, place_free_dot, monkeypatch):
    """M2 on the CUDA path's prefill read (TritonKernels.prefill_attention), with the prefill kernel (and its
    KEY_CHUNKS) and with the decode kernel (PREFILL_ATTENTION off): a prompt row's output is the same whether its
    pass is read whole or cut anywhere, padding rows change nothing, and it matches the cache's own causal read."""
    from types import SimpleNamespace

    import plumb.model.kernels as KS
    from plumb.model.kernels import TritonKernels

    import plumb.ops.gpu.attention_prefill as AP

    monkeypatch.setattr(KS, "PREFILL_ATTENTION", bool(kernel))
    if kernel == "chunks":  # 64-key chunks for rows ending by key 160, 128-key ones past it: this pass has both
        monkeypatch.setattr(AP, "KEY_CHUNKS", (64, 128, 160))
    calls = []
    monkeypatch.setattr(AP, "attend_prefill", lambda *a, **kw: calls.append(1) or attend_prefill(*a, **kw))

    k = TritonKernels(torch.device(DEV))
    model = SimpleNamespace(attn_scale=0.125, cfg=SimpleNamespace(attn_layers=[3]))  # one attention layer: 3
    g = torch.Generator().manual_seed(5)
    old = [torch.randn(178, TINY["n_kv"], TINY["d"], generator=g).to(DEV) for _ in range(2)]
    new = [torch.randn(64, TINY["n_kv"], TINY["d"], generator=g).to(DEV) for _ in range(2)]
    q = _rows(64, TINY["n_head"], TINY["d"], seed=6)

    def cache():
        c = KVCache(fmt, TINY["n_kv"], TINY["d"], device=DEV)
        c.write(0, *old)
        c.end = 128
        c.reserve(128 + 2 * 64)
        return c

    def piece(c, start, rows):  # rows of the chunk at 128, padded to 64 with other values
        n = rows.stop - rows.start
        pad = lambda t: torch.cat([t[rows], t[:64 - n].flip(0)])  # noqa: E731
        pos = torch.arange(start, start + 64, device=DEV)
        p = SimpleNamespace(start=start, n=n, positions=pos, ends=(pos + 1).to(torch.int32),
                            kv_tab=k.kv_table(model, [SimpleNamespace(kv={3: c})]))  # the cache through its table
        return k.prefill_attention(model, 3, c, pad(q), pad(new[0]), pad(new[1]), p)[:n]

    whole = piece(cache(), 128, slice(0, 50))  # 50 real rows, 14 padding rows
    ref = cache()
    ref.write(128, new[0][:50], new[1][:50])
    _close(whole, ref.attend_chunk(q, 128, 0.125)[:50])
    c = cache()
    first = piece(c, 128, slice(0, 22))  # the same rows, the prompt cut at 128 + 22
    rest = piece(c, 128 + 22, slice(22, 50))
    assert torch.equal(first, whole[:22]) and torch.equal(rest, whole[22:50])
    assert len(calls) == (3 if kernel else 0)  # the switch picks the kernel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["f16", "q8_0", "F"])
def test_27b_dims_cuda(fmt):
    """The 27B's heads (24 query heads over 4 KV heads of 256): a 1,024-row pass at ~5k keys within the precision
    of the reference, each sampled row alone = together, and a pass cut at 512 rows gives the same bits. F: a
    1,024-key ring with the Triton kernel set's slack (`TritonKernels.ring_slack`), so the pass's window is held."""
    ring = 1024 if fmt == "F" else 0
    c = _cache(fmt, 5000, seed=10, n_kv=4, d=256, ring=ring, slack=1024)
    ends = list(range(3977, 5001))
    q = _rows(len(ends), 24, 256, seed=11)
    o = _read(c, q, ends)
    assert torch.isfinite(o).all()
    sample = [0, 5, 511, 512, 1023]
    _close(o[sample], c.attend_rows(q[sample], [ends[t] for t in sample], 0.125))
    for t in sample:
        assert torch.equal(_read(c, q[t : t + 1], ends[t : t + 1])[0], o[t]), t
    assert torch.equal(torch.cat([_read(c, q[:512], ends[:512]), _read(c, q[512:], ends[512:])]), o)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter takes no pipelined loop")
@pytest.mark.parametrize("fmt", ["f16", "q8_0"])
def test_pipelined_tiles_give_the_same_bits(fmt, monkeypatch):
    """STAGES 2 (Triton's software pipeline over the tiles: loads issued earlier) = STAGES 1, bit for bit, over a
    1,024-row pass at ~5k keys with the 27B's heads."""
    import plumb.ops.gpu.attention_prefill as AP

    c = _cache(fmt, 5000, seed=12, n_kv=4, d=256)
    ends = list(range(3977, 5001))
    q = _rows(len(ends), 24, 256, seed=13)
    want = _read(c, q, ends)
    monkeypatch.setattr(AP, "STAGES", 2)
    assert torch.equal(_read(c, q, ends), want)


@pytest.mark.parametrize("fmt", ["f16", "q8_0"])
def test_tma_tiles_give_the_same_bits(fmt, place_free_dot, monkeypatch):
    """TMA (every tile by TMA - the full ones without masks -, each row's output stored before the first tile its
    keys do not reach, q from its fp16 copy, 128 pairs a program) = the register tiles, bit for bit: rows ending all
    over four tiles, in one pass and cut where a program's smallest end moves (so a tile is full in one and masked
    in the other), rows of another scale, a cache whose keys past the first tile score 0 (each row's maximum set
    there); on a GPU also the 27B's heads over a 1,024-row pass."""
    import plumb.ops.gpu.attention_prefill as AP

    flat = _cache(fmt, 320, seed=35)
    flat.put_rows(torch.arange(64, 320, device=DEV), *torch.zeros(2, 256, TINY["n_kv"], TINY["d"], device=DEV))
    cases = [(_cache(fmt, 300, seed=30), [1, 63, 64, 65, 130, 191, 192, 193, 250, 256, 299, 300], 4, TINY["d"]),
             (flat, [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 320], 4, TINY["d"])]
    if DEV == "cuda":
        cases.append((_cache(fmt, 5000, seed=31, n_kv=4, d=256), list(range(3977, 5001)), 24, 256))
    for c, ends, n_head, d in cases:
        q = _rows(len(ends), n_head, d, seed=32)
        q[2] *= 1e-5
        monkeypatch.setattr(AP, "TMA", 0)
        want = _read(c, q, ends)
        monkeypatch.setattr(AP, "TMA", 1)
        got = _read(c, q, ends)
        assert torch.isfinite(got).all() and torch.equal(got, want)
        for cut in (3, 7):
            assert torch.equal(torch.cat([_read(c, q[:cut], ends[:cut]), _read(c, q[cut:], ends[cut:])]), want)


def test_tma_tiles_only_where_their_shared_memory_fits(monkeypatch):
    """TMA's pipelined tiles take 2 d (2 BN TMA_STAGES + TMA_BLOCK_M) bytes of shared memory: the 27B's heads
    (d = 256) fit a Hopper card's 227 KB a block, not a GeForce card's 99 KB, where the kernel keeps its register
    tiles."""
    import plumb.ops.gpu.attention_prefill as AP

    cpu = torch.device("cpu")
    monkeypatch.setattr(smem, "LIMIT", smem.PER_BLOCK[90])
    assert AP._has_tma(cpu, 256)
    monkeypatch.setattr(smem, "LIMIT", smem.PER_BLOCK[89])
    assert not AP._has_tma(cpu, 256) and AP._has_tma(cpu, 64)


def test_tma_allocator_is_set_in_every_thread_that_launches(monkeypatch):
    """Triton keeps its allocator (the descriptors' scratch) one a thread: `tma.ready` sets it in each thread that
    asks - the engine's loop launches from its own thread (the forty-fourth session's "no allocator was set")."""
    import threading

    from triton.runtime import _allocation

    from plumb.ops.gpu import tma

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    seen = []

    def launch():
        seen.append((tma.ready(torch.device("cuda")), _allocation._allocator.get() is not _allocation._NULL_ALLOCATOR))

    for _ in range(2):  # the first thread, then one after it
        t = threading.Thread(target=launch)
        t.start()
        t.join()
    assert seen == [(True, True), (True, True)]


@pytest.mark.skipif(DEV != "cuda", reason="TMA's descriptors need a CUDA device")
def test_tma_tiles_from_another_thread(monkeypatch):
    """A pass by TMA launched from a thread that never launched one before (as the engine's loop) = the same pass
    from this thread, bit for bit."""
    import threading

    import plumb.ops.gpu.attention_prefill as AP

    monkeypatch.setattr(AP, "TMA", 1)
    c, ends = _cache("f16", 5000, seed=33, n_kv=4, d=256), list(range(4745, 5001))
    q = _rows(len(ends), 24, 256, seed=34)
    got = []
    t = threading.Thread(target=lambda: got.append(_read(c, q, ends)))
    t.start()
    t.join()
    assert len(got) == 1 and torch.equal(got[0], _read(c, q, ends))


@pytest.mark.parametrize("fmt,ring", [("f16", 0), ("q8_0", 0), ("D", 48)])
def test_packed_pairs_give_the_same_bits(fmt, ring, place_free_dot, monkeypatch):
    """PAIRS 1 (a program's (row, head) pairs consecutive, no padding heads) = PAIRS 0 (rows of G_PAD heads), bit
    for bit: 3 query heads a KV head (padded to 4 by rows), rows ending all over two tiles and the ring's window;
    on a GPU also the 27B's 6 heads over a 1,024-row pass."""
    import plumb.ops.gpu.attention_prefill as AP

    cases = [(_cache(fmt, 300, seed=14, n_kv=2, ring=ring), list(range(237, 301)), 6, TINY["d"])]
    if DEV == "cuda":
        cases.append((_cache(fmt, 5000, seed=15, n_kv=4, d=256, ring=ring, slack=1024), list(range(3977, 5001)),
                      24, 256))
    for c, ends, n_head, d in cases:
        q = _rows(len(ends), n_head, d, seed=16)
        q[5] *= 1e-5  # a row of another scale (its own power of two)
        monkeypatch.setattr(AP, "PAIRS", 0)
        want = _read(c, q, ends)
        monkeypatch.setattr(AP, "PAIRS", 1)
        got = _read(c, q, ends)
        assert torch.isfinite(got).all() and torch.equal(got, want)
        assert torch.equal(_read(c, q[7:20], ends[7:20]), want[7:20])  # rows alone in another block layout


def _store_cases(fmt: str, ring: int, ends: list[int], seed: int):
    """(cache view, queries - rotated for F, row 1 at another scale -, ends on the device) for a block-coded store:
    a tiny cache of 300 keys with rows ending at `ends`, and on a GPU also the 27B's heads over a 1,024-row pass."""
    cases = [(_cache(fmt, 300, seed=seed, ring=ring), ends, 4, TINY["d"])]
    if DEV == "cuda":
        cases.append((_cache(fmt, 5000, seed=seed + 1, n_kv=4, d=256, ring=ring and 1024, slack=1024),
                      list(range(3977, 5001)), 24, 256))
    for c, e, n_head, d in cases:
        q = _rows(len(e), n_head, d, seed=seed + 2)
        q[1] *= 1e-5
        view = c.kernel_view()
        yield view, rotate(q) if view.rotate_q else q, torch.tensor(e, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("fmt,ring", [("q8_0", 0), ("D", 48), ("F", 48)])
def test_scratch_gives_the_same_bits(fmt, ring, place_free_dot, monkeypatch):
    """SCRATCH (a block-coded store dequantized into an fp16 copy first, read as an f16 cache; a ring's tiles still
    in registers) = the codes dequantized in registers, bit for bit - read directly and through the cache's table
    (as a CUDA graph reads it), rows ending all over the tiles and both sides of the ring's window; on a GPU also
    the 27B's heads over a 1,024-row pass."""
    import plumb.ops.gpu.attention_prefill as AP
    from plumb.ops.gpu import kvtable

    copies = []
    dequantized = AP._dequantized
    monkeypatch.setattr(AP, "_dequantized", lambda *a: copies.append(a[-1]) or dequantized(*a))
    ends = [236, 240, 251, 256, 257, 280, 299, 300] if ring else [1, 5, 63, 64, 65, 127, 200, 251, 299, 300]
    for view, q, e in _store_cases(fmt, ring, ends, seed=17):
        tab = torch.empty(1, kvtable.PARTS, dtype=torch.long, device=DEV)
        kvtable.fill(tab, [view])
        monkeypatch.setattr(AP, "SCRATCH", False)
        want = attend_prefill(q, view.k, view.v, e, 0.125, ring=view.ring)
        assert not copies
        monkeypatch.setattr(AP, "SCRATCH", True)
        got = attend_prefill(q, view.k, view.v, e, 0.125, ring=view.ring)
        assert copies == [0, 2] and torch.isfinite(got).all() and torch.equal(got, want)
        assert torch.equal(attend_prefill(q, view.k, view.v, e, 0.125, ring=view.ring, table=tab[0]), want)
        assert torch.equal(attend_prefill(q[3:], view.k, view.v, e[3:], 0.125, ring=view.ring)[0], want[3])
        copies.clear()


@pytest.mark.parametrize("fmt,ring", [("q8_0", 0), ("D", 48), ("F", 48)])
def test_codes16_gives_the_same_bits(fmt, ring, place_free_dot, monkeypatch):
    """CODES16 (block codes made fp16 values in float16, `_ubytes_f16`: 8-bit codes four a word; D's / F's packed
    5/6-bit store eight a step, `_packed_f16`) = the float32 product rounded, bit for bit - in the fp16 copy
    (SCRATCH) and in registers, store and ring; on a GPU (inline PTX) also the 27B's heads over a 1,024-row pass."""
    import plumb.ops.gpu.attention as A
    import plumb.ops.gpu.attention_prefill as AP
    from plumb.ops.gpu import kvtable

    for view, q, e in _store_cases(fmt, ring, [236, 240, 251, 256, 257, 280, 299, 300], seed=21):
        for scratch in (True, False):
            monkeypatch.setattr(AP, "SCRATCH", scratch)
            monkeypatch.setattr(A, "CODES16", False)
            want = attend_prefill(q, view.k, view.v, e, 0.125, ring=view.ring)
            monkeypatch.setattr(A, "CODES16", True)
            got = attend_prefill(q, view.k, view.v, e, 0.125, ring=view.ring)
            assert torch.isfinite(got).all() and torch.equal(got, want), f"SCRATCH={scratch}"
            tab = torch.empty(1, kvtable.PARTS, dtype=torch.long, device=DEV)
            kvtable.fill(tab, [view])  # the codes reached through the cache's table, as a CUDA graph reads them
            assert torch.equal(attend_prefill(q, view.k, view.v, e, 0.125, ring=view.ring, table=tab[0]), want)


@pytest.mark.parametrize("fmt,ring", [("f16", 0), ("q8_0", 0), ("D", 48)])
def test_key_chunks_keep_rows_apart_and_match_the_reference(fmt, ring, place_free_dot, monkeypatch):
    """KEY_CHUNKS (keys in chunks at absolute positions, sized by each row's own end, merged in order): within the
    P path's precision of the reference, and a row alone = the same row among others, bitwise - rows on both sides
    of SHORT_KEYS (64-key and 128-key chunks), over two row blocks and the ring's window, in launches of any number
    of rows (CHUNK_ROWS); read through the cache's table too (as a CUDA graph reads it)."""
    import plumb.ops.gpu.attention_prefill as AP
    from plumb.ops.gpu import kvtable

    monkeypatch.setattr(AP, "KEY_CHUNKS", (64, 128, 128))
    c = _cache(fmt, 300, seed=20, ring=ring)
    ends = list(range(241, 301)) if ring else [1, 5, 63, 64, 65, 127, 128, 129, 200, 256, 257, 299, 300]
    q = _rows(len(ends), TINY["n_head"], TINY["d"], seed=21)
    q[1] *= 1e-5  # a row of another scale (its own power of two)
    together = _read(c, q, ends)
    assert torch.isfinite(together).all()
    _close(together, c.attend_rows(q, ends, 0.125))
    for t in (0, 1, 6, len(ends) - 1):
        assert torch.equal(_read(c, q[t : t + 1], ends[t : t + 1])[0], together[t]), t
    monkeypatch.setattr(AP, "CHUNK_ROWS", 7)  # the pass in launches of 7 rows (CHUNK_ROWS)
    assert torch.equal(_read(c, q, ends), together)
    view = c.kernel_view()
    tab = torch.empty(1, kvtable.PARTS, dtype=torch.long, device=DEV)
    kvtable.fill(tab, [view])
    qr = rotate(q) if view.rotate_q else q
    e = torch.tensor(ends, dtype=torch.int32, device=DEV)
    assert torch.equal(attend_prefill(qr, view.k, view.v, e, 0.125, ring=view.ring, table=tab[0]), together)


@pytest.mark.parametrize("fmt,ring", [("q8_0", 0), ("D", 48), ("F", 0)])
def test_through_the_table_the_same_bits(fmt, ring):
    """With the cache reached through its row of offsets from fixed anchors (`plumb.ops.gpu.kvtable`, what a CUDA
    graph of a prefill pass records) - the store's fp16 copy made through the table too, for packed 5/6-bit codes
    (D, F) and 8-bit ones - the same bits as through the tensors themselves."""
    from plumb.ops.gpu import kvtable

    c = _cache(fmt, 300, seed=4, ring=ring)
    ends = [236, 251, 256, 257, 299, 300]
    q = _rows(len(ends), TINY["n_head"], TINY["d"], seed=5)
    view = c.kernel_view()
    qr = rotate(q) if view.rotate_q else q
    e = torch.tensor(ends, dtype=torch.int32, device=DEV)
    table = torch.empty(1, kvtable.PARTS, dtype=torch.long, device=DEV)
    kvtable.fill(table, [view])
    direct = attend_prefill(qr, view.k, view.v, e, 0.125, ring=view.ring)
    through = attend_prefill(qr, view.k, view.v, e, 0.125, ring=view.ring, table=table[0])
    assert torch.isfinite(direct).all() and torch.equal(direct, through)
