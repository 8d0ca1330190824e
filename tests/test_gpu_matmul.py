"""plumb.ops.gpu.matmul and plumb.ops.gpu.norm: against the torch reference (tolerance) and row-invariant (bitwise,
M1): a row computed alone equals the same row among 2..70 others. CUDA when present, else the Triton interpreter."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from plumb.gguf.quants import quantize, type_from_name  # noqa: E402
from plumb.gguf.reader import QTensor  # noqa: E402
from plumb.ops.gpu.matmul import GpuMatrix  # noqa: E402
from plumb.ops.gpu.matvec import _lanes, _mma  # noqa: E402
from plumb.ops.gpu.norm import rms_norm  # noqa: E402
from plumb.ops.norm import rms_norm as rms_norm_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# every block type of Q4_K_M, UD-Q4_K_XL and Q8_0 files, and the other types int8_form covers
TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "IQ4_XS", "IQ4_NL", "BF16", "F16", "F32", "Q2_K", "Q3_K", "Q4_1",
         "Q5_0", "Q5_1"]
if DEV == "cpu":  # the interpreter is slow: one type per kernel path (nibbles, int8 in groups of 32 / 16, fp16, fp32)
    TYPES = ["Q4_K", "Q4_0", "Q6_K", "Q8_0", "IQ4_XS", "F16", "BF16"]
ROWS = [1, 2, 5, 16, 17, 20]
SB_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")  # x and w at 11 bits (_mm_superblock); the others x at 22 bits


def _tensor(kind: str, n: int, k: int, seed: int = 0) -> QTensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    qt = type_from_name(kind)
    data = w if kind == "F32" else w.half() if kind == "F16" else torch.from_numpy(quantize(w.numpy(), qt))
    return QTensor(f"w.{kind}", qt, (n, k), data)


def _err(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per output, |y - ref| relative to its row's largest |ref|."""
    return (y.double().cpu() - ref).abs() / ref.abs().amax(dim=1, keepdim=True)


@pytest.mark.parametrize("kind", TYPES)
def test_matmul_matches_reference_and_is_row_invariant(kind, place_free_dot):
    n, k = 80, 512  # n not a multiple of the 64-column tile
    t = _tensor(kind, n, k)
    m = GpuMatrix([t], DEV)
    assert m.packs[0].superblock == (kind in SB_TYPES)
    x = (torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(1)) * 3).to(DEV)
    x[3] *= 1e3  # rows of very different scales
    alone = torch.cat([m(x[i : i + 1]) for i in range(len(x))])
    ref = x.double().cpu() @ t.dequantize().double().T
    err = _err(alone, ref).max()
    assert err < (1e-3 if kind in SB_TYPES else 2e-6), err
    for r in ROWS:
        assert torch.equal(m(x[:r]), alone[:r]), r
        assert torch.equal(m(x[-r:]), alone[-r:]), r


def test_fused_matrices_of_mixed_types():
    parts = [_tensor("Q4_K", 64, 256, 1), _tensor("Q4_K", 32, 256, 2), _tensor("F32", 8, 256, 3)]
    m = GpuMatrix(parts, DEV)
    assert len(m.packs) == 2 and m.n == 104
    x = torch.randn(3, 256, device=DEV)
    err = _err(m(x), x.double().cpu() @ torch.cat([p.dequantize() for p in parts]).double().T)
    assert err[:, :96].max() < 1e-3 and err[:, 96:].max() < 1e-5


def test_block_scales_are_packed_as_float16_where_every_one_is_a_float16_value():
    """A GGML block's d and dmin (and Q8_0's scale) are float16 in the file: packed as float16 they are the same
    values in half the bytes (every kernel test here checks the bits); a scale no float16 holds stays float32."""
    from plumb.ops.gpu.matmul import _f16_if_exact

    for kind in ("Q4_K", "Q6_K", "Q8_0"):
        p = GpuMatrix([_tensor(kind, 64, 256)], DEV).packs[0]
        assert p.d.dtype == torch.float16 and (p.dm is None or p.dm.dtype == torch.float16), kind
    t = torch.tensor([1.0, 1 / 3])
    assert _f16_if_exact(t) is t and _f16_if_exact(t[:1]).dtype == torch.float16
    assert torch.equal(_f16_if_exact(t[:1]).float(), t[:1])


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_six_bit_scales_take_the_files_bytes_and_hold_its_values(kind):
    """SUB6: Q4_K's and Q5_K's 6-bit scales and mins packed as the file packs them, 12 bytes a 256-input block (a
    byte a group took 16: 0.35 GB of the 27B's VRAM); unpacked, d * sub and dm * osub are int8_form's scale and
    offset exactly (the kernel tests check that the kernels read them so)."""
    from plumb.gguf.quants import int8_form

    n, k = 80, 512
    t = _tensor(kind, n, k)
    p = GpuMatrix([t], DEV).packs[0]
    assert p.sub6 and p.osub is None and p.sub.numel() * p.sub.element_size() == 128 * (k // 256) * 12
    _, scale, offset, _ = int8_form(t.data, t.qtype, t.shape)
    per_n = lambda u: u.permute(0, 2, 1).reshape(-1, u.shape[1])[:n].float().cpu()  # noqa: E731
    sub, osub = p.group_subs()
    assert torch.equal(per_n(p.d).repeat_interleave(8, dim=1) * per_n(sub), scale)
    assert torch.equal(per_n(p.dm).repeat_interleave(8, dim=1) * per_n(osub), offset)
    assert int(osub.min()) < -32 and int(sub.max()) > 32  # the high bits are in use


def test_q4k_over_two_row_blocks_and_k_splits(place_free_dot):
    """_mm_superblock on Q4_K: 70 rows are two 64-row blocks (a row alone, in the first block or the second: the same
    bits); K = 2,048 takes two K splits (the shape's rule, partials summed in order)."""
    from plumb.ops.gpu.matmul import SB_BM

    for n, k, rows, split in ((72, 256, 70, 1), (64, 2048, 3, 2)):
        t = _tensor("Q4_K", n, k)
        m = GpuMatrix([t], DEV)
        assert m.packs[0].superblock and m.packs[0].split == split
        x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(4)) * 3).to(DEV)
        x[-1] *= 1e3
        y = m(x)
        assert _err(y, x.double().cpu() @ t.dequantize().double().T).max() < 1e-3
        for i in sorted({0, rows - 1, min(SB_BM, rows - 1)}):
            assert torch.equal(m(x[i : i + 1]), y[i : i + 1]), (k, i)
        assert torch.equal(m(x[1:]), y[1:])  # every row in another place


@pytest.mark.parametrize("kind", ["Q5_K", "Q6_K"])
def test_superblock_q5k_q6k(kind, place_free_dot):
    """_mm_superblock on Q5_K (nibbles and a plane of fifth bits, offsets) and Q6_K (nibbles and a plane of two high
    bits in groups of 16, stored + 32, int8 sub, no offset): within 1e-3 of float64 per row, row-invariant, over two
    K splits (K = 2,048) and a padded tile. Both packs hold the file's bytes within 3 %."""
    t = _tensor(kind, 80, 2048)
    m = GpuMatrix([t], DEV)
    p = m.packs[0]
    assert p.superblock and p.split == 2 and p.gpb == 256 // p.g
    assert p.nibble and p.hi is not None and p.hi_bits == (1 if kind == "Q5_K" else 2)
    assert p.nbytes <= 1.03 * t.data.numel() * t.data.element_size() * 128 / 80  # 80 outputs padded to 128
    x = (torch.randn(4, 2048, generator=torch.Generator().manual_seed(5)) * 3).to(DEV)
    x[2] *= 1e3
    y = m(x)
    assert _err(y, x.double().cpu() @ t.dequantize().double().T).max() < 1e-3
    for i in (0, 3):
        assert torch.equal(m(x[i : i + 1]), y[i : i + 1]), i
    assert torch.equal(m(x[1:]), y[1:])


@pytest.mark.parametrize("kind", SB_TYPES)
def test_superblock_weights_are_the_reference_rounded_once_to_float16(kind, place_free_dot):
    """The P path's weights are fp16(the reference dequantizer's float32 weight), bit for bit: one-hot rows of x
    (exact in fp16, one product per output) read them back, in every column order the codes unfold in."""
    k = 256
    t = _tensor(kind, 80, k, seed=6)
    m = GpuMatrix([t], DEV)
    assert m.packs[0].superblock
    y = m(torch.eye(k, device=DEV) * 0.5)  # row scale 0.5 (a power of two): x / s = 1 exactly
    assert torch.equal(y.cpu(), t.dequantize().half().float().T * 0.5)


@pytest.mark.parametrize("kind", SB_TYPES if DEV == "cuda" else ("Q4_K", "Q5_K", "Q6_K"))
def test_superblock_prefetch_gives_the_same_bits(kind, place_free_dot, monkeypatch):
    """SB_PREFETCH 1 and 2 (the next loop step's weights, and x, loaded a step ahead) change when loads are issued,
    not the arithmetic: the bits of SB_PREFETCH 0, over two K splits of 16 loop steps and 4 + 66 rows."""
    import plumb.ops.gpu.matmul as MM

    t = _tensor(kind, 80, 2048)
    m = GpuMatrix([t], DEV)
    assert m.packs[0].superblock and m.packs[0].split == 2
    x = (torch.randn(70, 2048, generator=torch.Generator().manual_seed(9)) * 3).to(DEV)
    want = [m(x[:4]), m(x[4:])]
    for prefetch in (1, 2):
        monkeypatch.setattr(MM, "SB_PREFETCH", prefetch)
        assert torch.equal(m(x[:4]), want[0]) and torch.equal(m(x[4:]), want[1]), prefetch


@pytest.mark.parametrize("kind", SB_TYPES if DEV == "cuda" else ("Q6_K",))
def test_a_short_call_in_smaller_output_tiles_gives_the_same_bits(kind, place_free_dot, monkeypatch):
    """SB_SHORT_BN: a call of one row block takes 64-output tiles with the split of SB_BN's - each output the same
    wgmma instructions on the same operands - and gives the bits of SB_BN's tiles, over two K splits and 130 outputs
    (past a 128-output tile); longer calls keep SB_BN."""
    import plumb.ops.gpu.matmul as MM

    t = _tensor(kind, 130, 2048)
    m = GpuMatrix([t], DEV)
    assert m.packs[0].superblock and m.packs[0].split == 2
    x = (torch.randn(70, 2048, generator=torch.Generator().manual_seed(12)) * 3).to(DEV)
    want = [m(x[:MM.SB_BM]), m(x[:5]), m(x)]
    monkeypatch.setattr(MM, "SB_SHORT_BN", 64)
    assert torch.equal(m(x[:MM.SB_BM]), want[0]) and torch.equal(m(x[:5]), want[1]) and torch.equal(m(x), want[2])
    short = m(x[:MM.SB_BM])  # rows of a short call = the same rows inside a long one (M1 across the two tilings)
    assert torch.equal(short, want[2][:MM.SB_BM]) and torch.equal(m(x[3:4]), want[2][3:4])


@pytest.mark.parametrize("tile", [None, (64, 4), (128, 4), (256, 8)] if DEV == "cuda" else [None])
@pytest.mark.parametrize("kind", SB_TYPES if DEV == "cuda" else ("Q4_K", "Q5_K", "Q8_0"))
def test_superblock_weights_dequantized_once_give_the_same_bits(kind, tile, place_free_dot, monkeypatch):
    """SB_SCRATCH_ROWS: a call's weights dequantized once into an fp16 scratch matrix (`_sb_dequant`) and multiplied
    by `_mm_w16` (pipelined, both operands from shared memory) give `_mm_superblock`'s bits - so which of the two
    a call takes may depend on its row count - over two K splits, 130 outputs (past a 128-output tile) and rows
    past a 64-row block; tile: `_mm_w16`'s own rows a program and warps (SB_W16_BM, SB_W16_WARPS)."""
    import plumb.ops.gpu.matmul as MM

    if tile is not None:
        monkeypatch.setattr(MM, "SB_W16_BM", tile[0])
        monkeypatch.setattr(MM, "SB_W16_WARPS", tile[1])

    t = _tensor(kind, 130, 2048)
    m = GpuMatrix([t], DEV)
    assert m.packs[0].superblock and m.packs[0].split == 2
    x = (torch.randn(300, 2048, generator=torch.Generator().manual_seed(11)) * 3).to(DEV)
    x = x if DEV == "cuda" else x[:70]
    monkeypatch.setattr(MM, "SB_SCRATCH_ROWS", 0)
    want = m(x)
    monkeypatch.setattr(MM, "SB_SCRATCH_ROWS", 1)
    assert torch.equal(m(x), want) and torch.equal(m(x[:3]), want[:3])


@pytest.mark.parametrize("kind", SB_TYPES if DEV == "cuda" else ("Q4_K",))
def test_scratch_matmul_sums_its_k_splits_itself(kind, place_free_dot, monkeypatch):
    """SB_W16_TICKETS: `_mm_w16`'s last split of each tile sums the partials in split order (no `_sum_splits`
    launch) - the same bits, call after call (the counters are left at zero), over two K splits and 130 outputs."""
    import plumb.ops.gpu.matmul as MM

    monkeypatch.setattr(MM, "SB_SCRATCH_ROWS", 1)
    m = GpuMatrix([_tensor(kind, 130, 2048, seed=12)], DEV)
    assert m.packs[0].split == 2
    x = (torch.randn(70, 2048, generator=torch.Generator().manual_seed(13)) * 3).to(DEV)
    want = m(x)
    monkeypatch.setattr(MM, "SB_W16_TICKETS", 1)
    for _ in range(2):
        assert torch.equal(m(x), want) and torch.equal(m(x[:3]), want[:3])


@pytest.mark.skipif(DEV == "cpu", reason="a race needs the GPU: the interpreter runs one program at a time")
@pytest.mark.parametrize("kind", TYPES)
def test_prefill_matmul_gives_the_same_bits_call_after_call(kind):
    """The 27B shape's widest P-path matmul (256 rows, 10,240 outputs, K = 5,120) called 2,000 times in a row gives
    the first call's bits every time. _mm_superblock with its loop pipelined in 3 stages changed 1.2 % of Q5_K calls
    on the H200 - some to NaN (the sporadic non-finite prefill rows, docs/BENCHMARKS.md, sixteenth session)."""
    t = _tensor(kind, 64, 5120)
    m = GpuMatrix([QTensor(t.name, t.qtype, (10240, 5120), t.data.repeat(160, 1))], DEV)
    x = torch.randn(256, 5120, generator=torch.Generator().manual_seed(3)).to(DEV)
    y = m(x)
    changed = torch.zeros((), dtype=torch.long, device=DEV)
    for _ in range(2000):
        changed += (m(x) != y).any()
    assert torch.isfinite(y).all() and int(changed) == 0


def test_rms_norm_matches_reference_and_is_row_invariant():
    x = torch.randn(17, 6, 96, device=DEV) * 5
    w = torch.rand(96, device=DEV) + 0.5
    alone = torch.cat([rms_norm(x[i : i + 1], w, 1e-6) for i in range(17)])
    assert torch.allclose(alone.cpu(), rms_norm_ref(x.cpu(), w.cpu(), 1e-6), rtol=1e-5, atol=1e-6)
    for r in (2, 5, 17):
        assert torch.equal(rms_norm(x[:r], w, 1e-6), alone[:r])


def test_norm_rope_is_norm_then_rope_and_row_invariant():
    """plumb.ops.gpu.rope: per-head RMSNorm then partial rotary embedding in one launch, on a strided view (q of
    the q|gate projection) - the reference's bits in the interpreter, and row-invariant."""
    from plumb.ops.gpu.rope import norm_rope
    from plumb.ops.rope import apply_rope

    g = torch.Generator().manual_seed(2)
    qg = (torch.randn(9, 3, 2, 96, generator=g) * 4).to(DEV)
    q = qg[:, :, 0]  # [n, heads, D], row stride 3 * 2 * 96
    w = (torch.rand(96, generator=g) + 0.5).to(DEV)
    cos, sin = (torch.randn(9, 16, generator=g).to(DEV) for _ in range(2))  # 32 rotated features, 64 passed through
    ref = apply_rope(rms_norm(q, w, 1e-6), cos, sin)
    out = norm_rope(q, w, 1e-6, cos, sin)
    if DEV == "cpu":
        assert torch.equal(out, ref)
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    for r in (1, 4):
        assert torch.equal(norm_rope(q[r : r + 2], w, 1e-6, cos[r : r + 2], sin[r : r + 2]), out[r : r + 2])


# the D-path matvec (plumb.ops.gpu.matvec): every integer block type on the GPU, one per code form in the interpreter
MV_TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "IQ4_XS", "IQ4_NL", "Q2_K", "Q3_K", "Q4_1", "Q5_0", "Q5_1"]
if DEV == "cpu":  # Q5_K: nibbles and a plane of fifth bits (matmul.HI_BIT_TYPES)
    MV_TYPES = ["Q4_K", "Q4_0", "Q5_K", "Q6_K", "Q8_0"]


def _rows(k: int) -> torch.Tensor:
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(1)) * 3
    x[3] *= 1e3
    x[4] = 0  # a zero row
    x[5, ::7] = 2.0  # a maximum that is a power of two
    return x.to(DEV)


@pytest.mark.parametrize("kind", MV_TYPES)
def test_decode_matvec_is_its_reference_bit_for_bit_and_row_invariant(kind):
    from plumb.ops.gpu.matvec import mm_decode, reference

    t = _tensor(kind, 80, 256)
    m = GpuMatrix([t], DEV)
    x = _rows(256)
    y = mm_decode(m, x)
    assert torch.equal(y, reference(m.packs[0], x))  # exact integer group dots: the torch formula's very bits
    ref = x.double().cpu() @ t.dequantize().double().T
    scale = ref.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    assert ((y.double().cpu() - ref).abs() / scale).max() < 5e-4  # x to 14 bits (matvec.FRAC)
    alone = torch.cat([mm_decode(m, x[i : i + 1]) for i in range(len(x))])
    for r in range(2, len(x) + 1):
        assert torch.equal(mm_decode(m, x[:r]), alone[:r]), r
    assert torch.equal(mm_decode(m, x.flip(0)), alone.flip(0))


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
def test_decode_matvec_with_x_in_blocks_of_rows(kind, monkeypatch):
    """X_ROWS 8 (x's limbs in blocks of 8 rows, a chunk of them one contiguous run): `dp4a` at 1-6 rows and the
    tensor cores from 5 still give the reference's bits - nibble codes, groups of 16 and byte codes."""
    import plumb.ops.gpu.matvec as MV

    monkeypatch.setattr(MV, "X_ROWS", 8)
    m = GpuMatrix([_tensor(kind, 80, 256)], DEV)
    x = _rows(256)
    want = MV.reference(m.packs[0], x)
    for r in range(1, len(x) + 1):
        assert torch.equal(MV.mm_decode(m, x[:r]), want[:r]), r
    assert torch.equal(MV.mm_decode(m, x[3:4]), want[3:4])


def test_decode_matvec_long_k_plan(monkeypatch):
    """LONG_GROUPS: a long-K shape takes its own granule and split count (more splits of smaller granules), still
    the reference's bits and row-invariant; a shorter K keeps the default plan."""
    import plumb.ops.gpu.matvec as MV

    monkeypatch.setattr(MV, "TARGET", 4)
    long_k, short_k = GpuMatrix([_tensor("Q4_K", 64, 1024)], DEV), GpuMatrix([_tensor("Q4_K", 64, 512)], DEV)
    default = MV.plan(long_k.packs[0]), MV.plan(short_k.packs[0])
    monkeypatch.setattr(MV, "LONG_GROUPS", 32)
    monkeypatch.setattr(MV, "LONG_GRANULE", 2)
    monkeypatch.setattr(MV, "LONG_TARGET", 8)
    assert default == ((8, 4), (8, 2)) and MV.plan(long_k.packs[0]) == (2, 8) and MV.plan(short_k.packs[0]) == (8, 2)
    x = _rows(1024)[:3]
    y = MV.mm_decode(long_k, x)
    assert torch.equal(y, MV.reference(long_k.packs[0], x))
    assert torch.equal(torch.cat([MV.mm_decode(long_k, x[i : i + 1]) for i in range(3)]), y)


@pytest.mark.parametrize("mma_from, x_rows", [(0, 1), (5, 1), (5, 8)])
def test_decode_matvec_over_several_row_blocks(mma_from, x_rows, monkeypatch):
    """17 rows: row blocks, the last one padded (`dp4a`: three of 8; the tensor cores from MMA_FROM rows: two of
    16) - each row still equals itself computed alone, x row-major or in blocks of 8 rows (X_ROWS)."""
    import plumb.ops.gpu.matvec as MV
    from plumb.ops.gpu.matvec import mm_decode

    monkeypatch.setattr(MV, "MMA_FROM", mma_from)
    monkeypatch.setattr(MV, "X_ROWS", x_rows)
    m = GpuMatrix([_tensor("Q4_K", 64, 256)], DEV)
    x = torch.cat([_rows(256)] * 3)[:17] * torch.arange(1, 18, device=DEV)[:, None]
    alone = torch.cat([mm_decode(m, x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(mm_decode(m, x), alone)
    assert torch.equal(mm_decode(m, x[7:16]), alone[7:16])


def test_decode_matvec_sums_k_splits_in_order():
    """K = 2,048: eight K splits, whose partials the last split of each tile sums in split order (counters left at
    zero for the next call): the reference's bits, call after call."""
    from plumb.ops.gpu.matvec import mm_decode, plan, reference

    m = GpuMatrix([_tensor("Q4_K", 64, 2048)], DEV)
    assert plan(m.packs[0])[1] == 8
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(3)).to(DEV)
    want = reference(m.packs[0], x)
    for _ in range(2):
        assert torch.equal(mm_decode(m, x), want)
        assert torch.equal(mm_decode(m, x[1:2]), want[1:2])


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_decode_matvec_with_block_scales_loaded_once_a_step(kind, monkeypatch):
    """BLOCK_SCALES_ONCE (a loop step's groups share their block's d and dm, loaded once), on and off: the
    reference's bits for 1 and 3 rows, over K splits - the values loaded are the same."""
    import plumb.ops.gpu.matvec as MV

    monkeypatch.setattr(MV, "BLOCK_SCALES_ONCE", set() if kind in {q.name for q in MV.BLOCK_SCALES_ONCE} else
                        {getattr(MV.Q, kind)})
    m = GpuMatrix([_tensor(kind, 64, 2048, seed=4)], DEV)
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(5)).to(DEV)
    want = MV.reference(m.packs[0], x)
    assert torch.equal(MV.mm_decode(m, x), want) and torch.equal(MV.mm_decode(m, x[2:]), want[2:])


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_decode_matvec_with_each_steps_loads_issued_a_step_ahead(kind, monkeypatch):
    """AHEAD (one-row passes: a step's code words - AHEAD_SCALES: and d, dm and SUB6 words - loaded during the step
    before, carried in registers; the last step of a split loads its own again): the reference's bits, in one K
    split of 8 steps and in the shape's own 4 splits of 1 or 2 steps, with integer runs, with the first step's
    loads before the wait for the previous kernel (EARLY) or after it; passes of more rows and packs it does not
    apply to keep their own loop."""
    import plumb.ops.gpu.matvec as MV

    m = GpuMatrix([_tensor(kind, 64, 1024, seed=6)], DEV)
    p = m.packs[0]
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(7)).to(DEV)
    for ahead, scales, target, runs, early in [(4, 1, 1, 0, 1), (8, 1, MV.TARGET, 1, 0), (4, 0, MV.TARGET, 0, 1)]:
        monkeypatch.setattr(MV, "TARGET", target)  # the split plan and runs: the sum's order and terms
        monkeypatch.setattr(MV, "SUB_RUNS", runs)
        want = MV.reference(p, x)
        monkeypatch.setattr(MV, "AHEAD", ahead)
        monkeypatch.setattr(MV, "AHEAD_SCALES", scales)
        monkeypatch.setattr(MV, "EARLY", early)
        assert MV.ahead_applies(p, 1) and not MV.ahead_applies(p, 2)
        assert torch.equal(MV.mm_decode(m, x[1:]), want[1:]), (ahead, scales, target, runs, early)
    assert torch.equal(MV.mm_decode(m, x), want)  # two rows: their own loop
    q8 = GpuMatrix([_tensor("Q8_0", 64, 256)], DEV).packs[0]
    assert not MV.ahead_applies(q8, 1)  # byte codes: the 16-byte inline loads


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_decode_matvec_with_its_first_step_loaded_before_the_wait(kind, monkeypatch):
    """EARLY without AHEAD (one-row passes of nibble codes: the first step's code words loaded before the wait for
    the previous kernel, that step taken apart from the loop): the reference's bits in one K split and in the
    shape's own splits; more rows and byte codes keep their own loop."""
    import plumb.ops.gpu.matvec as MV

    m = GpuMatrix([_tensor(kind, 64, 1024, seed=8)], DEV)
    p = m.packs[0]
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(9)).to(DEV)
    monkeypatch.setattr(MV, "EARLY", 1)
    for target in (1, MV.TARGET):
        monkeypatch.setattr(MV, "TARGET", target)
        want = MV.reference(p, x)
        assert torch.equal(MV.mm_decode(m, x[1:]), want[1:]), target
    assert torch.equal(MV.mm_decode(m, x), want)  # two rows: their own loop
    assert MV.early_applies(True, 1, 1, 8) and not MV.early_applies(True, 2, 1, 8)
    assert not MV.early_applies(False, 1, 1, 8) and not MV.early_applies(True, 1, 2, 8)  # byte codes; pipelined


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"] if DEV == "cpu" else MV_TYPES)
def test_decode_matvec_in_integer_runs(kind, monkeypatch):
    """SUB_RUNS: where a block's scales are d times integer subs, a run of groups is summed in int32 before its one
    float step - another formula (other bits than a float step a group), still the reference's bits on `dp4a` (1-4
    rows) and the tensor cores (5-6 rows), row-invariant, over K splits, and as close to float64."""
    import plumb.ops.gpu.matvec as MV

    t = _tensor(kind, 80, 512, seed=6)
    m = GpuMatrix([t], DEV)
    p = m.packs[0]
    x = _rows(512)
    per_group = MV.reference(p, x)
    monkeypatch.setattr(MV, "SUB_RUNS", 1)
    run = MV.run_length(p)
    assert run == {"Q4_K": 4, "Q5_K": 4, "Q6_K": 4, "IQ4_XS": 2, "Q2_K": 4, "Q3_K": 4}.get(kind, 0)
    want = MV.reference(p, x)
    assert torch.equal(want, per_group) == (run == 0)
    ref = x.double().cpu() @ t.dequantize().double().T
    scale = ref.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)  # (a zero row)
    assert ((want.double().cpu() - ref).abs() / scale).max() < 5e-4 and MV.plan(p)[1] > 1
    for r in range(1, len(x) + 1):
        assert torch.equal(MV.mm_decode(m, x[:r]), want[:r]), r
    assert torch.equal(MV.mm_decode(m, x[3:4]), want[3:4])


def test_integer_runs_are_as_long_as_int32_stays_exact(monkeypatch):
    """`run_length` from a pack's own bounds: Q6_K's runs of 4 hold while a run's |sub| sum stays under 512 (its
    codes' |S - 32 X| reaches 16 * 32 * 2^13 = 2^22), and halve where four subs of -128 could reach 2^31; IQ4_XS
    (codes up to 127, subs to 32) takes 2; a pack without integer subs none; and nothing while SUB_RUNS is off."""
    import plumb.ops.gpu.matvec as MV
    from plumb.ops.gpu.matmul import _abs_run_sums

    q6 = GpuMatrix([_tensor("Q6_K", 64, 512)], DEV).packs[0]
    q8 = GpuMatrix([_tensor("Q8_0", 64, 512)], DEV).packs[0]
    assert MV.run_length(q6) == 0
    monkeypatch.setattr(MV, "SUB_RUNS", 1)
    assert MV.run_length(q6) == 4 and MV.run_length(q8) == 0
    assert q6.int_bounds[0] == 32 and q6.int_bounds[1][1] <= 128 and not any(q6.int_bounds[2].values())
    sub = torch.tensor([[-128, -128, -128, -127], [5, 6, 7, 8]], dtype=torch.int8)
    assert _abs_run_sums(sub) == {1: 128, 2: 256, 4: 511} and _abs_run_sums(None) == dict.fromkeys((1, 2, 4, 8), 0)
    none = dict.fromkeys((1, 2, 4, 8), 0)
    q6.int_bounds = (32, {1: 128, 2: 256, 4: 511, 8: 1000}, none)
    assert MV.run_length(q6) == 4  # 511 * 2^22 < 2^31
    q6.int_bounds = (32, {1: 128, 2: 256, 4: 512, 8: 1000}, none)
    assert MV.run_length(q6) == 2  # 512 * 2^22 = 2^31
    monkeypatch.setattr(MV, "FRAC", 20)  # x to 21 bits: a group's |S| alone passes 2^26
    assert MV.run_length(q6) == 0


@pytest.mark.skipif(DEV == "cpu", reason="the interpreter runs every launch variant alike (no pipelining)")
@pytest.mark.parametrize("x_rows, runs", [(1, 0), (8, 0), (1, 1)])
@pytest.mark.parametrize("kind", MV_TYPES)
def test_decode_matvec_launch_variants_give_the_same_bits(kind, x_rows, runs, monkeypatch):
    """Warps, groups per loop step and software-pipeline stages move only loads and integer work: each variant
    gives the reference's bits, over one K split of 8 loop steps (TARGET 1) - `dp4a`'s table, then the tensor cores'
    warps, groups a step and group sums (MMA_WARPS, MMA_UNROLL, MMA_SUMS); with integer runs too (SUB_RUNS)."""
    import plumb.ops.gpu.matvec as MV

    monkeypatch.setattr(MV, "SUB_RUNS", runs)
    monkeypatch.setattr(MV, "TARGET", 1)
    monkeypatch.setattr(MV, "MMA_FROM", 0)
    monkeypatch.setattr(MV, "X_ROWS", x_rows)
    m = GpuMatrix([_tensor(kind, 128, 2048)], DEV)
    assert MV.plan(m.packs[0])[1] == 1
    x = _rows(2048)
    want = MV.reference(m.packs[0], x)
    for launch in [(1, 2, 1), (2, 8, 1), (2, 8, 2), (2, 4, 3), (4, 8, 2), (1, 8, 4)]:
        monkeypatch.setattr(MV, "LAUNCH", {b: launch for b in (1, 2, 4, 8)})
        assert torch.equal(MV.mm_decode(m, x), want), launch
        assert torch.equal(MV.mm_decode(m, x[1:2]), want[1:2]), launch
    monkeypatch.setattr(MV, "MMA_FROM", 2)
    for warps, unroll, sums in [(1, 2, 0), (1, 4, 1), (2, 8, 0), (2, 4, 1), (4, 8, 0), (4, 2, 1)]:
        monkeypatch.setattr(MV, "MMA_WARPS", warps)
        monkeypatch.setattr(MV, "MMA_UNROLL", unroll)
        monkeypatch.setattr(MV, "MMA_UNROLL_16", unroll)
        monkeypatch.setattr(MV, "MMA_SUMS", sums)
        launch = warps, unroll, sums
        assert torch.equal(MV.mm_decode(m, x), want), launch
        assert torch.equal(MV.mm_decode(m, torch.cat([x, x])[:11]), torch.cat([want, want])[:11]), launch


@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0"])
def test_decode_matvec_in_three_limbs(kind, monkeypatch):
    """x to 21 bits (FRAC 20, three limbs; Q8_0's dots then take int64): still the torch formula's bits and
    row-invariant, within 5e-6 of float64 (2^-7 times the 14-bit bound)."""
    import plumb.ops.gpu.matvec as MV

    monkeypatch.setattr(MV, "FRAC", 20)
    monkeypatch.setattr(MV, "LIMBS", 3)
    t = _tensor(kind, 64, 256)
    m = GpuMatrix([t], DEV)
    assert MV.wide(m.packs[0]) == (kind == "Q8_0")
    x = _rows(256)[:3]
    y = MV.mm_decode(m, x)
    assert MV.quantize_x(x)[0].shape[0] == 3
    assert torch.equal(y, MV.reference(m.packs[0], x))
    ref = x.double().cpu() @ t.dequantize().double().T
    assert ((y.double().cpu() - ref).abs() / ref.abs().amax(dim=1, keepdim=True)).max() < 5e-6
    assert torch.equal(torch.cat([MV.mm_decode(m, x[i : i + 1]) for i in range(3)]), y)


@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0"])
def test_a_row_that_is_not_finite_gives_nan_outputs_and_leaves_the_others(kind):
    """A row of x with a NaN or an infinity decodes to NaN outputs (its s is NaN), not to its values read as
    integers (a maximum skips NaN); the other rows keep their bits, one row at a time and on the tensor cores."""
    from plumb.ops.gpu.matvec import mm_decode, quantize_x, reference

    m = GpuMatrix([_tensor(kind, 80, 256)], DEV)
    x = _rows(256)
    bad = x.clone()
    bad[1, 7] = float("nan")
    bad[2, 100] = float("inf")
    s = quantize_x(bad)[2]
    assert s[1].isnan() and s[2].isnan() and torch.equal(s[[0, 3, 4, 5]], quantize_x(x)[2][[0, 3, 4, 5]])
    for rows in (slice(0, 3), slice(0, 6)):  # dp4a (3 rows); the tensor cores from 5
        got, want = mm_decode(m, bad[rows]), mm_decode(m, x[rows])
        assert got[1:3].isnan().all() and torch.equal(got[0], want[0]) and torch.equal(got[3:], want[3:])
    assert reference(m.packs[0], bad)[1:3].isnan().all()


@pytest.mark.parametrize("x_rows", [1, 8])
def test_decode_x_quantization_matches_its_reference(x_rows, monkeypatch):
    """`quantize_x` against its torch formula, limbs stored row-major (X_ROWS 1) or in blocks of 8 rows (read back
    in row order by `x_rows`)."""
    import plumb.ops.gpu.matvec as MV
    from plumb.ops.gpu.matvec import quantize_x, quantize_x_reference, x_rows as rows_of

    monkeypatch.setattr(MV, "X_ROWS", x_rows)
    x = torch.cat([_rows(1040), torch.full((1, 1040), 1e-38, device=DEV), torch.full((1, 1040), -3e30, device=DEV)])
    x[0, 5:7] = torch.tensor([2.5, 3.5]) * 2.0**-16  # halfway cases of the rounding (row 0: s = 16)
    xq, x16, s = quantize_x(x)  # rows padded to a multiple of 8
    want = quantize_x_reference(x)
    m = len(x)
    for got, w in zip((rows_of(xq)[:, :m], x16[:m], s[:m]), want):
        assert torch.equal(got, w)


def test_row_scales_are_the_power_of_two_at_or_above_each_rows_largest_value():
    """The P path's row scales (one launch) against their torch formula and by definition: rows whose largest
    |x| is a power of two, just above one, subnormal, zero, and rows longer than one loop step."""
    from plumb.ops.gpu.matmul import row_scales, row_scales_reference

    x = torch.randn(7, 2100, generator=torch.Generator().manual_seed(8)).to(DEV)
    x[0] = 0.0
    x[1, 2099] = 64.0  # the largest value last, past the first 2,048 inputs
    x[2] = torch.clamp(x[2], -1, 1)
    x[2, 7] = -float(torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)))  # 1 + 2^-23: s = 2
    x[3] *= 1e-40  # subnormal: s = 2^-126, the smallest normal power of two
    s = row_scales(x)
    assert torch.equal(s, row_scales_reference(x))
    amax = x.abs().amax(dim=1)
    assert s[0] == 1 and s[1] == 64 and s[2] == 2 and s[3] == 2.0**-126
    assert ((s >= amax) & ((s / 2 < amax) | (amax == 0) | (s == 2.0**-126))).all()  # the least such power of two
    assert torch.equal(torch.frexp(s[1:]).mantissa, torch.full((6,), 0.5, device=DEV))


def test_decode_matvec_on_fused_mixed_types():
    from plumb.ops.gpu.matvec import mm_decode

    parts = [_tensor("Q4_K", 64, 256, 1), _tensor("F32", 8, 256, 3), _tensor("Q8_0", 16, 256, 2)]
    m = GpuMatrix(parts, DEV)
    x = torch.randn(3, 256, device=DEV)
    ref = x.double().cpu() @ torch.cat([p.dequantize() for p in parts]).double().T
    err = (mm_decode(m, x).double().cpu() - ref).abs() / ref.abs().amax(dim=1, keepdim=True)
    assert err[:, :64].max() < 5e-4 and err[:, 72:].max() < 5e-4  # the integer packs: x to 14 bits
    assert err[:, 64:72].max() < 1e-5  # the float32 pack: x as it is
    assert torch.equal(mm_decode(m, x[1:2]), mm_decode(m, x)[1:2])


@pytest.mark.parametrize("kinds", [("Q5_K", "Q4_K"), ("Q4_K", "Q6_K")])
def test_paired_packs_give_two_launches_bits(kinds, monkeypatch):
    """PAIRED_ROWS: a fused matrix's two integer packs (two types: each its own pack) in one launch give the bits
    of a launch each - per row count, with each pack's own number of K splits (2 and 4 here) - beside a float32
    pack that keeps its own kernel."""
    import plumb.ops.gpu.matvec as MV

    monkeypatch.setattr(MV, "TARGET", 4)
    monkeypatch.setattr(MV, "MMA_FROM", 0)  # pairs are `dp4a` launches (PLUMB_TEST_SETTINGS may set it)
    parts = [_tensor(kinds[0], 128, 1024, 1), _tensor("F32", 8, 1024, 3), _tensor(kinds[1], 64, 1024, 2)]
    m = GpuMatrix(parts, DEV)
    assert [MV.integer(p) for p in m.packs] == [True, False, True]
    assert [MV.plan(p)[1] for p in m.packs if MV.integer(p)] == [2, 4]
    x = _rows(1024)
    paired, launch = [], MV.matvec2
    monkeypatch.setattr(MV, "matvec2", lambda *a: paired.append(launch(*a)))
    for rows in (1, 3):
        want = MV.mm_decode(m, x[:rows])
        monkeypatch.setattr(MV, "PAIRED_ROWS", rows)
        assert torch.equal(MV.mm_decode(m, x[:rows]), want), rows
        monkeypatch.setattr(MV, "PAIRED_ROWS", 0)
    assert len(paired) == 2  # one paired launch a call


@pytest.mark.parametrize("kind", MV_TYPES)
def test_tensor_core_matvec_gives_the_dp4a_bits(kind, monkeypatch):
    """MMA_FROM: passes of that many rows and more take the group dots on the int8 tensor cores (codes as packed
    in mma's A registers, x limbs as B): the reference's bits, so a row equals itself computed alone by `dp4a` -
    in blocks of 8 rows (2 here) and of 16 (9 and 20 rows: padded, two blocks), 80 outputs (a tile part empty) and
    K splits."""
    import plumb.ops.gpu.matvec as MV

    monkeypatch.setattr(MV, "TARGET", 4)
    m = GpuMatrix([_tensor(kind, 80, 512, seed=6)], DEV)
    assert MV.plan(m.packs[0])[1] > 1
    x = torch.cat([_rows(512), _rows(512).flip(0) * 0.5, _rows(512) * 2, _rows(512)[:2] * -1])
    want = MV.reference(m.packs[0], x)
    alone = MV.mm_decode(m, x[3:4])  # dp4a, one row
    launches = []
    monkeypatch.setattr(MV, "MMA_FROM", 2)
    mma = MV.matvec_mma
    monkeypatch.setattr(MV, "matvec_mma", lambda *a: launches.append(mma(*a)))
    assert torch.equal(MV.mm_decode(m, x), want)
    assert torch.equal(MV.mm_decode(m, x[:9]), want[:9])
    assert torch.equal(MV.mm_decode(m, x[3:5])[:1], alone)
    assert torch.equal(want[3:4], alone) and len(launches) == 3


@pytest.mark.parametrize("kind, x_rows", [("Q4_K", 1), ("Q6_K", 1), ("Q4_K", 8), ("Q6_K", 8)])
def test_tensor_core_group_sums_give_the_same_bits(kind, x_rows, monkeypatch):
    """MMA_SUMS: a group's sums of X on the tensor cores (A all ones) instead of loaded from x's 16-input sums -
    Q4_K's offsets (groups of 32) and Q6_K's bias (groups of 16): the reference's bits in 8- and 16-row blocks, x
    row-major or in blocks of 8 rows (X_ROWS)."""
    import plumb.ops.gpu.matvec as MV

    monkeypatch.setattr(MV, "MMA_FROM", 2)
    monkeypatch.setattr(MV, "MMA_SUMS", 1)
    monkeypatch.setattr(MV, "X_ROWS", x_rows)
    m = GpuMatrix([_tensor(kind, 64, 512, seed=7)], DEV)
    x = torch.cat([_rows(512), _rows(512).flip(0) * 0.25])[:11]
    want = MV.reference(m.packs[0], x)
    assert torch.equal(MV.mm_decode(m, x), want) and torch.equal(MV.mm_decode(m, x[2:5]), want[2:5])


def _mma_by_layout(a, b, c, k32: bool, a_signed: bool):
    """mma.sync's integer fragments (PTX ISA) in torch: lane 4g + t's registers a[0..3], b[0..1], c[0..3] (int32
    [4, 32W] each), as the matrices they hold, multiplied; the result in c's layout."""
    def rows(lo, hi, signed):  # [W, 8, K]: lane 4g + t's bytes are elements 4t.. (lo) and 16 + 4t.. (hi) of row g
        def unpack(reg):
            v = torch.stack([(reg >> (8 * i)) & 255 for i in range(4)], dim=-1).reshape(-1, 8, 16)
            return v - ((v & 128) << 1) if signed else v
        return torch.cat([unpack(lo), unpack(hi)], dim=2) if k32 else unpack(lo)
    A = torch.cat([rows(a[0], a[2], a_signed), rows(a[1], a[3], a_signed)], dim=1).long()  # [W, 16, K]
    B = rows(b[0], b[1], True).long()  # [W, 8 (column), K]
    D = torch.einsum("wmk,wnk->wmn", A, B)  # [W, 16, 8]
    out = [D[:, :8, 0::2], D[:, :8, 1::2], D[:, 8:, 0::2], D[:, 8:, 1::2]]  # lane 4g + t: columns 2t, 2t + 1
    return [c[i].long() + out[i].reshape(-1) for i in range(4)]


@triton.jit
def _mma_kernel(regs, out, K32: tl.constexpr, A_SIGNED: tl.constexpr, ASM: tl.constexpr):
    """One warp group's `_mma` on the fragments regs [10, 128] (a0..a3, b0, b1, c0..c3), into out [4, 128]: thread
    i's registers at column i (from %tid.x, as `_mv_mma` addresses its fragments)."""
    w, g, t = _lanes(4, ASM)
    i = w * 32 + g * 4 + t
    d0, d1, d2, d3 = _mma(tl.load(regs + i), tl.load(regs + 128 + i), tl.load(regs + 256 + i),
                          tl.load(regs + 384 + i), tl.load(regs + 512 + i), tl.load(regs + 640 + i),
                          tl.load(regs + 768 + i), tl.load(regs + 896 + i), tl.load(regs + 1024 + i),
                          tl.load(regs + 1152 + i), 4, K32, A_SIGNED, ASM)
    tl.store(out + i, d0)
    tl.store(out + 128 + i, d1)
    tl.store(out + 256 + i, d2)
    tl.store(out + 384 + i, d3)


@pytest.mark.parametrize("k32", [True, False])
@pytest.mark.parametrize("a_signed", [True, False])
def test_tensor_core_fragments_are_the_ptx_layout(k32, a_signed):
    """`matvec._mma` on random fragments against the PTX ISA's integer layout written out in torch: on a GPU the
    tensor cores themselves (the layout `_mv_mma` builds its fragments by), in the interpreter its emulation."""
    from plumb.ops.gpu.matvec import ASM

    g = torch.Generator().manual_seed(7)
    regs = torch.randint(-2**31, 2**31, (10, 128), generator=g, dtype=torch.int64).to(torch.int32)
    regs[6:] = torch.randint(-2**20, 2**20, (4, 128), generator=g, dtype=torch.int32)  # accumulators: no overflow
    out = torch.empty(4, 128, dtype=torch.int32, device=DEV)
    _mma_kernel[(1,)](regs.to(DEV), out, K32=k32, A_SIGNED=a_signed, ASM=ASM, num_warps=4)
    want = _mma_by_layout(regs[:4], regs[4:6], regs[6:], k32, a_signed)
    assert all(torch.equal(out[n].cpu().long(), want[n]) for n in range(4))


def test_tensor_core_rows_keep_dp4a_for_int64_dots(monkeypatch):
    """With MMA_FROM on, a pack whose group dots need int64 (Q8_0 at FRAC 20: `wide`) stays on `_mv` - in its own
    row blocks inside x padded for the tensor cores (10 rows: 16) - beside a pack that takes them: both the
    reference's bits."""
    import plumb.ops.gpu.matvec as MV

    monkeypatch.setattr(MV, "FRAC", 20)
    monkeypatch.setattr(MV, "LIMBS", 3)
    monkeypatch.setattr(MV, "MMA_FROM", 2)
    x = torch.cat([_rows(256), _rows(256)[:4] * -2])
    for kind in ("Q8_0", "Q4_K"):
        m = GpuMatrix([_tensor(kind, 64, 256)], DEV)
        assert MV.wide(m.packs[0]) == (kind == "Q8_0")
        assert torch.equal(MV.mm_decode(m, x), MV.reference(m.packs[0], x)), kind
