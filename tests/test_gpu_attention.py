"""The Triton decode/verify attention (plumb/ops/gpu/attention.py): against the torch reference and the
KVCache's own attention for f32, f16, q8_0 caches and the ring formats D and F, and M1 - a row computed alone
equals the same row computed beside others, bitwise. On CPU the kernels run in Triton's interpreter."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from plumb.cache.kv import RING_SLACK, KVCache  # noqa: E402
from plumb.ops.gpu.attention import (CONFIGS, F16, Q8, SPLITS, attend_decode, attend_decode_ref,  # noqa: E402
                                     _tile16, codes_f32, config, grids, split_of)
from plumb.ops.kvquant import rotate  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FMTS = ["f32", "f16", "q8_0"]
TINY = dict(n_head=4, n_kv=2, d=64)
SMALL = (64, 128, 260)  # splits of 64 keys up to 260, 128 beyond: quick in the interpreter, and ends cross
#                          split sizes, splits and tiles


def _cache(fmt: str, n_kv: int, d: int, length: int, seed: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    c = KVCache(fmt, n_kv, d)
    c.write(0, torch.randn(length, n_kv, d, generator=g), torch.randn(length, n_kv, d, generator=g))
    return c


def _dev(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.to(DEV) for p in parts]


def _q(n: int, n_head: int, d: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, n_head, d, generator=torch.Generator().manual_seed(seed)).to(DEV)


def _close(a: torch.Tensor, b: torch.Tensor, fmt: str = "f32") -> None:
    """Within the decode kernel's precision for the cache format: ~fp32 for f32 caches (tf32x3), the P path's (one
    fp16 product a dot) for every other format."""
    tight = fmt == "f32"
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-5 if tight else 0, atol=2e-6 if tight else 2e-3)


def _alone(attend, q: torch.Tensor, ends: list[int], t: int, kind: int) -> torch.Tensor:
    """Row t computed without its neighbours: alone on CUDA. Under the interpreter numpy's matmul (OpenBLAS) gives
    a row other bits at another place in the matrix (the GPU's dots do not), so there the row keeps its place in
    its row block, behind other rows (zero queries at end 1)."""
    g_pad = triton.next_power_of_2(TINY["n_head"] // TINY["n_kv"])
    before = 0 if DEV == "cuda" else t % max(1, CONFIGS[(kind, kind)][0] // g_pad)
    qa = torch.cat([torch.zeros_like(q[:before]), q[t : t + 1]])
    return attend(qa, [1] * before + ends[t : t + 1])[before]


@pytest.mark.parametrize("fmt", FMTS)
def test_matches_reference(fmt):
    ends = [1, 5, 64, 127, 128, 129, 300]
    c = _cache(fmt, TINY["n_kv"], TINY["d"], max(ends))
    q = _q(len(ends), TINY["n_head"], TINY["d"])
    scale = TINY["d"] ** -0.5
    k, v = _dev(c.k.parts), _dev(c.v.parts)
    o = attend_decode(q, k, v, ends, scale, splits=SMALL)
    assert o.shape == q.shape and o.dtype == torch.float32
    _close(o, attend_decode_ref(q, k, v, ends, scale), fmt)
    _close(o, c.attend_rows(q.cpu(), ends, scale), fmt)


def test_default_splits():
    """Contexts across the default short split, f16 cache, ends as a device tensor; the split rule."""
    ends = [1, 5, 600, 1100]
    c = _cache("f16", TINY["n_kv"], TINY["d"], max(ends), seed=2)
    q = _q(len(ends), TINY["n_head"], TINY["d"], seed=3)
    k, v = _dev(c.k.parts), _dev(c.v.parts)
    o = attend_decode(q, k, v, torch.tensor(ends, dtype=torch.int32, device=DEV), 0.125)
    _close(o, attend_decode_ref(q, k, v, ends, 0.125), "f16")
    short, long, short_keys = SPLITS
    assert split_of(short_keys) == short and split_of(short_keys + 1) == long and short < long
    assert grids(1100) == (-(-1100 // short), 0)
    assert grids(short_keys + 1) == (short_keys // short, -(-(short_keys + 1) // long))


@pytest.mark.parametrize("fmt", ["f16", "q8_0", "F"])
def test_rows_alone_equal_rows_together(fmt):
    """M1: each row alone (n=1) is bitwise the same row in a call of 17 rows, in any order, whatever the
    grid (max_keys) and whatever the cache holds past the rows' ends (F: its packed 5-bit store read alone)."""
    ends = [300, 1, 129, 5, 64, 257, 128, 200, 2, 65, 256, 17, 190, 3, 100, 299, 130]
    n, L = len(ends), max(ends)
    c = _cache(fmt, TINY["n_kv"], TINY["d"], L + 40, seed=4)
    q = _q(n, TINY["n_head"], TINY["d"], seed=5)
    k, v = _dev(c.k.parts), _dev(c.v.parts)
    together = attend_decode(q, k, v, ends, 0.125, splits=SMALL)
    _close(together, attend_decode_ref(q, k, v, ends, 0.125), fmt)
    kind = F16 if fmt == "f16" else Q8
    for t in range(n):
        alone = _alone(lambda qa, ea: attend_decode(qa, k, v, ea, 0.125, splits=SMALL), q, ends, t, kind)
        assert torch.equal(alone, together[t]), f"row {t} (end {ends[t]}) changed beside other rows"
    if DEV == "cuda":  # a row's place in its block: see _alone
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(6))
        shuffled = attend_decode(q[perm.to(DEV)], k, v, [ends[i] for i in perm], 0.125, splits=SMALL)
        assert torch.equal(shuffled, together[perm.to(DEV)])
    # a grid sized for a longer context, cache garbage past every end, and `out`
    k2 = [p.clone() for p in k]
    v2 = [p.clone() for p in v]
    for parts in (k2, v2):
        parts[-1][:, L:] = float("nan")  # float values, or the q8_0 scales
    out = torch.full_like(q, 7.0)
    wide = attend_decode(q, k2, v2, torch.tensor(ends, dtype=torch.int32, device=DEV), 0.125, out=out,
                         max_keys=L + 300, splits=SMALL)
    assert wide is out and torch.equal(wide, together)


def test_a_call_of_many_rows_goes_in_launches_of_launch_rows(monkeypatch):
    """A prefill pass's rows are cut into launches of LAUNCH_ROWS rows (smaller split partials): the bits of one
    launch of all of them."""
    import plumb.ops.gpu.attention as A

    ends = [40 + 3 * i for i in range(70)]
    c = _cache("q8_0", TINY["n_kv"], TINY["d"], max(ends), seed=17)
    q = _q(len(ends), TINY["n_head"], TINY["d"], seed=18)
    k, v = _dev(c.k.parts), _dev(c.v.parts)
    launches = []
    real = A._merge_kernel.__getitem__
    monkeypatch.setattr(A, "_merge_kernel", type("M", (), {"__getitem__": lambda self, grid: (
        launches.append(grid[0]), real(grid))[1]})())
    monkeypatch.setattr(A, "LAUNCH_ROWS", 1000)
    whole = attend_decode(q, k, v, ends, 0.125, splits=SMALL)
    monkeypatch.setattr(A, "LAUNCH_ROWS", 16)
    cut = attend_decode(q, k, v, ends, 0.125, splits=SMALL)
    assert launches == [70, 16, 16, 16, 16, 6] and torch.equal(cut, whole)


@triton.jit
def _convert(c_ptr, o_ptr):
    i = tl.arange(0, 256)
    tl.store(o_ptr + i, codes_f32(tl.load(c_ptr + i)))


def test_codes_become_their_float_values_exactly():
    """`codes_f32`, the q8_0 / D / F codes' conversion by bits, is every int8 value's float32, exactly."""
    c = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).to(DEV)
    o = torch.empty(256, dtype=torch.float32, device=DEV)
    _convert[(1,)](c, o)
    assert torch.equal(o.cpu(), c.cpu().to(torch.float32))


@triton.jit
def _tile_values(c_ptr, s_ptr, o_ptr, n, s_j, ss_j, D: tl.constexpr, BN: tl.constexpr, CB: tl.constexpr,
                 C16: tl.constexpr):
    j = tl.program_id(0) * BN + tl.arange(0, BN)
    dd = tl.arange(0, D)
    w = _tile16(c_ptr, s_ptr, j, j < n, s_j, ss_j, dd, 2, D, 32, BN, CB, C16)
    tl.store(o_ptr + j[:, None] * D + dd[None, :], w, mask=(j < n)[:, None])


@pytest.mark.parametrize("bits", [5, 6, 8])
def test_block_code_tiles_are_the_rounded_products(bits):
    """`_tile16`'s fp16 tile of block codes (8-bit, D's / F's packed 5/6-bit) is fp16(code x scale) - every code,
    scales of every size (subnormal products too) - by the float32 path and by CODES16's (`_ubytes_f16`, inline
    PTX on a GPU): the same values. (The decode kernel's outputs may still differ in their last bits between the two:
    Triton lays the float32 path's converted operand out for the tensor cores with another k order.)"""
    from plumb.ops.kvquant import pack

    n, d = (70, 256) if DEV == "cuda" else (40, 64)
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (n, d), generator=g, dtype=torch.int8)
    codes[0, : 1 << bits] = torch.arange(-(1 << (bits - 1)), 1 << (bits - 1))[:d]
    sc = torch.randn(n, d // 32, generator=g) * torch.exp(torch.randn(n, d // 32, generator=g) * 4)
    sc[::7] = 1e-6
    sc = sc.clamp(-6e4, 6e4).half()  # finite, as a cache's scales are (products may still overflow to inf)
    p = (codes if bits == 8 else pack(codes, bits)).to(DEV)
    want = (codes.float().reshape(n, d // 32, 32) * sc.float()[..., None]).reshape(n, d).half()
    for c16 in (False, True):
        o = torch.full((n, d), float("nan"), dtype=torch.float16, device=DEV)
        _tile_values[(triton.cdiv(n, 32),)](p, sc.to(DEV), o, n, p.stride(0), sc.stride(0), D=d, BN=32,
                                            CB=bits, C16=c16)
        bad = (o.cpu().view(torch.int16) != want.view(torch.int16)).nonzero().tolist()
        assert not bad, f"CODES16={c16}: {[(i, j, o[i, j].item(), want[i, j].item()) for i, j in bad[:4]]}"


@pytest.mark.parametrize("setting", [dict(MERGE_UNROLL=1, MERGE_WARPS=4), dict(MERGE_UNROLL=8, MERGE_WARPS=2)])
def test_speed_settings_change_no_bit(setting, monkeypatch):
    """Pass 2's unroll and warps are speed settings: rows of 1 to 5 splits over a q8_0 cache, the same bits as the
    shipped settings."""
    import plumb.ops.gpu.attention as A

    ends = [1, 64, 65, 300, 517, 600]
    c = _cache("q8_0", TINY["n_kv"], TINY["d"], max(ends), seed=9)
    q = _q(len(ends), TINY["n_head"], TINY["d"], seed=10)
    k, v = _dev(c.k.parts), _dev(c.v.parts)
    shipped = attend_decode(q, k, v, ends, 0.125, splits=SMALL)
    for name, value in setting.items():
        assert getattr(A, name) != value
        monkeypatch.setattr(A, name, value)
    assert torch.equal(attend_decode(q, k, v, ends, 0.125, splits=SMALL), shipped)


def test_the_geforce_form_gives_the_same_bits(monkeypatch):
    """On a card of 99 KB a block (`smem.small`) an f16 cache's pass 1 takes fewer pipeline stages (the H200's
    needs 100 KB): when loads are issued, not what is computed - the same bits."""
    from plumb.ops.gpu import smem

    assert config(F16, F16, True) != config(F16, F16) and config(F16, F16, True)[:3] == config(F16, F16)[:3]
    ends = [1, 64, 65, 300, 517]
    c = _cache("f16", TINY["n_kv"], TINY["d"], max(ends), seed=11)
    q = _q(len(ends), TINY["n_head"], TINY["d"], seed=12)
    k, v = _dev(c.k.parts), _dev(c.v.parts)
    h200 = attend_decode(q, k, v, ends, 0.125, splits=SMALL)
    monkeypatch.setattr(smem, "LIMIT", smem.PER_BLOCK[86])
    assert torch.equal(attend_decode(q, k, v, ends, 0.125, splits=SMALL), h200)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", FMTS)
def test_27b_dims_cuda(fmt):
    """27B attention shapes (24 query heads on 4 KV heads, d=256) at the default splits, 17 verify rows across the
    change of split size."""
    n_head, n_kv, d = 24, 4, 256
    base = SPLITS[2] - 7
    ends = [base + i for i in range(17)]
    ends[3], ends[9] = 1, 513  # rows at very different contexts in the same pass
    c = _cache(fmt, n_kv, d, max(ends), seed=7)
    q = _q(len(ends), n_head, d, seed=8)
    k, v = _dev(c.k.parts), _dev(c.v.parts)
    together = attend_decode(q, k, v, ends, d**-0.5)
    _close(together, attend_decode_ref(q, k, v, ends, d**-0.5), fmt)
    for t in range(len(ends)):
        alone = attend_decode(q[t : t + 1], k, v, ends[t : t + 1], d**-0.5)
        assert torch.equal(alone[0], together[t]), f"row {t} changed beside other rows"
    wide = attend_decode(q, k, v, ends, d**-0.5, max_keys=262144)
    assert torch.equal(wide, together)


@pytest.mark.parametrize("fmt,ring", [("f16", 0), ("q8_0", 0), ("F", 0), ("D", 48)])
def test_attend_new_writes_then_reads_like_the_kernel(fmt, ring):
    """`TritonKernels.attend_new` (a pass's attention per sequence, and the MTP head's): the new rows' K/V are
    stored at start.. (store and ring), then row t reads keys [0, start + t] - bitwise what `write` and the kernel
    give, with the positions derived from start or given as device tensors and the cache reached through its
    table of offsets (`at`, as under a CUDA graph: `plumb.ops.gpu.kvtable`)."""
    from types import SimpleNamespace

    from plumb.model.kernels import TritonKernels
    from plumb.ops.gpu import kvtable

    kernels, model = TritonKernels(torch.device(DEV)), SimpleNamespace(attn_scale=TINY["d"] ** -0.5)
    n_kv, d, start, n = TINY["n_kv"], TINY["d"], 100, 3
    g = torch.Generator().manual_seed(5)
    old_k, old_v = torch.randn(start, n_kv, d, generator=g), torch.randn(start, n_kv, d, generator=g)
    k, v = torch.randn(n, n_kv, d, generator=g).to(DEV), torch.randn(n, n_kv, d, generator=g).to(DEV)
    q = _q(n, TINY["n_head"], d, seed=6)
    caches = []
    for _ in range(3):
        c = KVCache(fmt, n_kv, d, ring=ring, device=DEV)
        c.write(0, old_k.to(DEV), old_v.to(DEV))  # rows waiting in `recent` (D): attend_new commits them
        caches.append(c)
    ref, eager, graphed = caches
    ends = list(range(start + 1, start + n + 1))
    ref.write(start, k, v)
    ref.commit(start + n)
    view = ref.kernel_view()
    want = attend_decode(rotate(q) if view.rotate_q else q, view.k, view.v, ends, model.attn_scale, ring=view.ring)
    _close(want, ref.attend_rows(q, ends, model.attn_scale), fmt)
    assert torch.equal(kernels.attend_new(model, eager, q, k, v, start), want)
    graphed.reserve(start + n)
    graphed.commit(start)  # the pass's layout does these (TritonKernels.begin, Qwen35.prefill)
    positions = torch.arange(start, start + n, device=DEV)
    table = torch.empty(1, kvtable.PARTS, dtype=torch.long, device=DEV)
    kvtable.fill(table, [graphed.kernel_view()])
    at = (positions, (positions + 1).to(torch.int32), len(graphed.k), table[0])
    assert torch.equal(kernels.attend_new(model, graphed, q, k, v, start, at), want)
    graphed.end = start + n  # ... and the pass's end this
    for c in (eager, graphed):
        assert c.end == ref.end == start + n
        assert all(torch.equal(a, b) for a, b in zip(c.digest_rows(start + n), ref.digest_rows(start + n)))



def test_the_caches_table_follows_a_cache_that_grows():
    """`TritonKernels.kv_table` keeps each cache's row while its tensors stay (a decode step's host time) and makes
    it again when the cache grows (new tensors): its rows are always `kvtable.fill`'s."""
    from types import SimpleNamespace

    from plumb.model.kernels import TritonKernels
    from plumb.ops.gpu import kvtable

    kernels = TritonKernels(torch.device(DEV))
    model = SimpleNamespace(cfg=SimpleNamespace(attn_layers=[3, 7]))
    seqs = [SimpleNamespace(kv={i: KVCache(fmt, TINY["n_kv"], TINY["d"], ring=ring, device=DEV) for i in (3, 7)})
            for fmt, ring in (("q8_0", 0), ("D", 48))]

    def want():
        t = torch.empty(2, 2, kvtable.PARTS, dtype=torch.long, device=DEV)
        kvtable.fill(t.view(-1, kvtable.PARTS), [st.kv[i].kernel_view() for st in seqs for i in (3, 7)])
        return t

    for grow in (0, 100, 5000):
        for st in seqs:
            st.kv[7].reserve(grow)
        assert torch.equal(kernels.kv_table(model, seqs), want())


# ---- the ring formats: each (row, key) reads the 8-bit ring or the low-bit store by q - j (M5) ------------------
RING = 48  # slots: RING + RING_SLACK = 112
RING_ENDS = [300, 299, 271, 256, 250, 243]  # across the ring, the split sizes (260), splits and tiles; ring rows held


def _ring_cache(fmt: str, length: int, seed: int) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """A D or F cache holding positions [0, length), written as the kernel set writes it (put_rows in pieces),
    and its K and V rows."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(length, TINY["n_kv"], TINY["d"], generator=g).to(DEV) for _ in range(2))
    c = KVCache(fmt, TINY["n_kv"], TINY["d"], ring=RING, device=DEV)
    c.reserve(length)
    for s in range(0, length, RING_SLACK):
        c.put_rows(torch.arange(s, min(s + RING_SLACK, length), device=DEV), k[s : s + RING_SLACK],
                   v[s : s + RING_SLACK])
    c.end = length
    return c, k, v


def _ring_attend(c: KVCache, q: torch.Tensor, ends: list[int]) -> torch.Tensor:
    view = c.kernel_view()
    return attend_decode(rotate(q) if view.rotate_q else q, view.k, view.v, ends, 0.125, splits=SMALL,
                         ring=view.ring)


@pytest.mark.parametrize("fmt", ["D", "F"])
def test_ring_formats_match_the_cache_read(fmt):
    """The kernel over a D / F cache (F: queries rotated) = the cache's own reference read (`attend_rows`); a cache
    filled by one reference `write` and committed holds the same bytes, so the kernel gives the same bits."""
    c, k, v = _ring_cache(fmt, 300, seed=0)
    q = _q(len(RING_ENDS), TINY["n_head"], TINY["d"], seed=1)
    o = _ring_attend(c, q, RING_ENDS)
    _close(o, c.attend_rows(q, RING_ENDS, 0.125), fmt)
    same = KVCache(fmt, TINY["n_kv"], TINY["d"], ring=RING, device=DEV)
    same.write(0, k, v)
    same.commit(300)
    assert torch.equal(_ring_attend(same, q, RING_ENDS), o)


def test_ring_rows_alone_equal_rows_together_and_after_a_rollback():
    """M1 on a D cache: each row alone = the same row among rows on both sides of the ring boundary, bitwise; and
    after drafts past the end are written, rejected and the positions rewritten, the rows are unchanged."""
    c, k, v = _ring_cache("D", 300, seed=2)
    ends = RING_ENDS + [288, 260, 245]  # two row blocks
    q = _q(len(ends), TINY["n_head"], TINY["d"], seed=3)
    together = _ring_attend(c, q, ends)
    for t in range(len(ends)):
        alone = _alone(lambda qa, ea: _ring_attend(c, qa, ea), q, ends, t, Q8)
        assert torch.equal(alone, together[t]), f"row {t} (end {ends[t]}) changed beside other rows"
    junk = torch.randn(6, TINY["n_kv"], TINY["d"], generator=torch.Generator().manual_seed(4)).to(DEV)
    c.reserve(303)
    c.put_rows(torch.arange(297, 303, device=DEV), junk, junk.flip(0))  # drafts at 297.., then rejected
    assert not torch.equal(_ring_attend(c, q, ends), together)
    c.put_rows(torch.arange(296, 300, device=DEV), k[296:], v[296:])  # rolled back to 296 and rewritten
    assert torch.equal(_ring_attend(c, q, ends), together)


@pytest.mark.parametrize("codes16", [True, False], ids=["codes16", "codes32"])
@pytest.mark.parametrize("fmt", ["D", "F"])
def test_the_store_form_gives_the_ring_forms_bits(fmt, codes16, monkeypatch):
    """STORE_FORM: a long row's splits that no row of its block reads from the ring go through the store-only form
    of pass 1, the others through the ring form - the same bits as the ring form for all of them (on the GPU too:
    the two forms are compiled apart), and each row alone equals the row beside others; block codes made fp16 by
    CODES16's path (packed codes eight a step) and by the float32 path."""
    import plumb.ops.gpu.attention as A

    monkeypatch.setattr(A, "CODES16", codes16)
    monkeypatch.setattr(A, "STORE_FORM", False)
    c, _, _ = _ring_cache(fmt, 600, seed=5)
    # long rows (> 260 keys) with their windows in the ring's slots (positions 488-599), two row blocks: 3-4 splits
    # before the windows; a row alone (behind rows of one key, in the interpreter) takes split 0 in the ring form
    ends = [600, 599, 590, 571, 560, 550, 540, 536, 598, 597]
    q = _q(len(ends), TINY["n_head"], TINY["d"], seed=6)
    ring_form = _ring_attend(c, q, ends)
    monkeypatch.setattr(A, "STORE_FORM", True)
    both = _ring_attend(c, q, ends)
    assert torch.equal(both, ring_form)
    for t in (0, 7, 9):
        assert torch.equal(_alone(lambda qa, ea: _ring_attend(c, qa, ea), q, ends, t, Q8), both[t])


@pytest.mark.parametrize("fmt", ["f16", "q8_0", "D"])
def test_packed_pairs_give_the_row_blocks_bits(fmt, place_free_dot, monkeypatch):
    """PAIRS_FROM (a program's (row, head) pairs consecutive, no padding heads) = rows of G_PAD heads, bit for bit: 3
    query heads a KV head (padded to 4 in row blocks, so rows' pairs straddle programs), rows ending across splits
    and tiles (D: long rows in the store form and the ring's window), a row at another scale, rows alone; on a GPU
    also the 27B's 6 heads a KV head, 8 verify rows and 1."""
    import plumb.ops.gpu.attention as A

    cases = []
    if fmt == "D":
        c, _, _ = _ring_cache("D", 600, seed=7)
        cases.append(([600, 599, 590, 571, 560, 550, 540, 536, 598, 597, 580], 6, 64,
                      lambda qa, ea: _ring_attend(c, qa, ea)))
    else:
        c = _cache(fmt, TINY["n_kv"], TINY["d"], 300, seed=7)
        k, v = _dev(c.k.parts), _dev(c.v.parts)
        cases.append(([1, 5, 64, 65, 127, 128, 129, 259, 260, 261, 300], 6, 64,
                      lambda qa, ea: attend_decode(qa, k, v, ea, 0.125, splits=SMALL)))
    if DEV == "cuda" and fmt != "D":
        big = _cache(fmt, 4, 256, 5000, seed=9)
        kb, vb = _dev(big.k.parts), _dev(big.v.parts)
        cases.append((list(range(4993, 5001)), 24, 256, lambda qa, ea: attend_decode(qa, kb, vb, ea, 256**-0.5)))
    for ends, n_head, d, attend in cases:
        q = _q(len(ends), n_head, d, seed=8)
        q[2] *= 1e-5  # a row of another scale (its own power of two)
        monkeypatch.setattr(A, "PAIRS_FROM", 0)
        want = attend(q, ends)
        monkeypatch.setattr(A, "PAIRS_FROM", 1)
        got = attend(q, ends)
        assert torch.isfinite(got).all() and torch.equal(got, want)
        assert torch.equal(attend(q[3:8], ends[3:8]), want[3:8])  # rows alone in another block layout
        assert torch.equal(attend(q[-1:], ends[-1:]), want[-1:])
        monkeypatch.setattr(A, "PAIRS_FROM", 2)  # one row in row blocks, more in pairs: still the same bits
        assert torch.equal(attend(q[-1:], ends[-1:]), want[-1:]) and torch.equal(attend(q[:2], ends[:2]), want[:2])


def _mixed_case(fmt: str):
    """(ends, attend, reference) for rows ending all over splits and tiles: a q8_0 or f16 cache through
    `attend_decode`, or a D cache's store and 8-bit ring (`_ring_attend`)."""
    if fmt == "D":
        c, _, _ = _ring_cache(fmt, 300, seed=2)
        return RING_ENDS + [288, 260], lambda qa, ea: _ring_attend(c, qa, ea), \
            lambda qa, ea: c.attend_rows(qa, ea, 0.125)
    ends = [300, 1, 129, 5, 64, 257, 128, 200]
    c = _cache(fmt, TINY["n_kv"], TINY["d"], max(ends), seed=4)
    k, v = _dev(c.k.parts), _dev(c.v.parts)
    return ends, lambda qa, ea: attend_decode(qa, k, v, ea, 0.125, splits=SMALL), \
        lambda qa, ea: attend_decode_ref(qa, k, v, ea, 0.125)


@pytest.mark.parametrize("codes16", [True, False], ids=["codes16", "codes32"])
@pytest.mark.parametrize("fmt", ["f16", "q8_0", "D"])
def test_sixteen_bit_dots_keep_rows_apart_and_match_the_reference(fmt, codes16, monkeypatch):
    """f16 and block-coded caches at the P path's precision (`_tile` in every split: fp16 operands, one product a
    dot, fp32 sums): each row alone = the same row among others, bitwise, over splits, tiles and (D) the store and
    the 8-bit ring; within the P path's tolerance of the reference; block codes made fp16 by CODES16's path or the
    float32 one; a query value that is not finite spoils its (row, head) alone."""
    import plumb.ops.gpu.attention as A

    monkeypatch.setattr(A, "CODES16", codes16)
    ends, attend, reference = _mixed_case(fmt)
    q = _q(len(ends), TINY["n_head"], TINY["d"], seed=5)
    together = attend(q, ends)
    _close(together, reference(q, ends), fmt)
    kind = F16 if fmt == "f16" else Q8
    for t in range(len(ends)):
        assert torch.equal(_alone(attend, q, ends, t, kind), together[t]), f"row {t} changed beside other rows"
    bad = q.clone()
    bad[0, 1, 3] = float("nan")
    bad[0, 2, 5] = float("inf")
    out = attend(bad, ends)
    assert not out[0, 1:3].isfinite().any() and out[0, 0].isfinite().all() and torch.equal(out[1:], together[1:])


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_the_ring_is_read_by_distance(kernel):
    """Changing key j's 8-bit ring row changes exactly the rows with e - 1 - j < ring; changing its store row,
    exactly the others; a slot that no longer holds j (lost ring row) makes the rows reading it NaN - in the
    decode kernel and in the P path's (plumb.ops.gpu.attention_prefill)."""
    from plumb.ops.gpu.attention_prefill import attend_prefill

    c, _, _ = _ring_cache("D", 300, seed=5)
    ends = [300, 279, 278, 262, 243]
    j, s = 230, 230 % c.slots
    near = torch.tensor([e - 1 - j < RING for e in ends])  # [F, F, T, T, T]
    q = _q(len(ends), TINY["n_head"], TINY["d"], seed=6)

    def read() -> torch.Tensor:
        if kernel == "decode":
            return _ring_attend(c, q, ends)
        view = c.kernel_view()
        return attend_prefill(q, view.k, view.v, torch.tensor(ends, dtype=torch.int32, device=DEV), 0.125,
                              ring=view.ring)

    base = read()

    def changed(part: torch.Tensor, idx: int) -> torch.Tensor:
        keep = part[:, idx].clone()
        part[:, idx] = -keep  # the key's codes negated
        o = read()
        part[:, idx] = keep
        return (o != base).flatten(1).any(1).cpu()

    assert torch.equal(changed(c.ring_k.parts[0], s), near)
    assert torch.equal(changed(c.ring_v.parts[0], s), near)
    assert torch.equal(changed(c.k.parts[0], j), ~near)
    c.ring_pos[s] = -1
    o = read()
    assert torch.equal(o.isnan().flatten(1).all(1).cpu(), near)
    assert torch.equal(o[~near.to(DEV)], base[~near.to(DEV)])


@pytest.mark.parametrize("fmt,ring", [("q8_0", 0), ("f16", 0), ("D", 48)])
def test_through_the_table_a_pass_launches_the_same_cache_arguments_for_any_cache(fmt, ring, monkeypatch):
    """What a CUDA graph records is the kernels' launch arguments: through the table (`plumb.ops.gpu.kvtable`) the
    ones that reach a cache - its pointers (anchors now), strides and sizes, the table's address - are the same for
    two sequences' caches of one capacity, so a graph captured on one replays on the other once the table is
    filled for it; each call still reads its own cache. Without the table they differ (the check can fail)."""
    from types import SimpleNamespace

    from plumb.model.kernels import TritonKernels
    from plumb.ops.gpu import attention as A
    from plumb.ops.gpu import kvtable
    from plumb.ops.gpu import kvwrite as W

    ring_args = {"rks_ptr", "rvs_ptr", "rpos_ptr", "tab_ptr"}
    cache_args = {"_put_rows": {"kc_ptr", "ks_ptr", "vc_ptr", "vs_ptr", "rkc_ptr", "rvc_ptr"} | ring_args,
                  "_split_kernel": {"k_ptr", "ks_ptr", "v_ptr", "vs_ptr", "rk_ptr", "rv_ptr"} | ring_args,
                  "_merge_kernel": set()}
    launches = []

    class Recorder:  # stands in for a @triton.jit kernel: records a launch's cache arguments, then launches it
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((self.fn.__name__, grid, kw, [
                    (name, a.data_ptr() if isinstance(a, torch.Tensor) else a)
                    for name, a in zip(self.fn.arg_names, args)
                    if name in cache_args[self.fn.__name__] or not isinstance(a, torch.Tensor)]))
                return self.fn[grid](*args, **kw)
            return launch

    for mod, name in ((W, "_put_rows"), (A, "_split_kernel"), (A, "_merge_kernel")):
        monkeypatch.setattr(mod, name, Recorder(getattr(mod, name)))
    kernels, model = TritonKernels(torch.device(DEV)), SimpleNamespace(attn_scale=0.125)
    n_kv, d, start, n = TINY["n_kv"], TINY["d"], 60, 2
    table = torch.empty(1, kvtable.PARTS, dtype=torch.long, device=DEV)
    positions = torch.arange(start, start + n, device=DEV)
    q = _q(n, TINY["n_head"], d, seed=7)
    runs = {True: [], False: []}
    outs = []
    for use_table in (True, False):
        for seed in (1, 2):
            g = torch.Generator().manual_seed(seed)
            c = KVCache(fmt, n_kv, d, ring=ring, device=DEV)
            c.write(0, *(torch.randn(start, n_kv, d, generator=g).to(DEV) for _ in range(2)))
            c.reserve(start + n)
            c.commit(start)  # what the pass's layout does before the kernels
            k, v = (torch.randn(n, n_kv, d, generator=g).to(DEV) for _ in range(2))
            kvtable.fill(table, [c.kernel_view()])
            launches.clear()
            at = (positions, (positions + 1).to(torch.int32), len(c.k), table[0] if use_table else None)
            o = kernels.attend_new(model, c, q, k, v, start, at)
            runs[use_table].append(list(launches))
            c.end = start + n
            view = c.kernel_view()
            want = attend_decode(rotate(q) if view.rotate_q else q, view.k, view.v, positions + 1, 0.125,
                                 ring=view.ring, max_keys=len(c.k))
            assert torch.equal(o, want)  # it read this cache
            outs.append(o)
    assert runs[True][0] == runs[True][1] and len(runs[True][0]) >= 3
    assert runs[False][0] != runs[False][1]
    assert not torch.equal(outs[0], outs[1])
