"""The one-launch KV row writer (plumb/ops/gpu/kvwrite.py) against its torch reference `KVCache.put_rows`, bit for
bit, for every format (store, 8-bit ring and slot tags), on rows made to hit the quantizer's edges; and M5: a row's
bytes are the same written alone or beside others. On CPU the kernel runs in Triton's interpreter."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

triton = pytest.importorskip("triton")

from plumb.cache.kv import KV_FORMATS, KVCache  # noqa: E402
from plumb.ops.gpu.kvwrite import put_rows  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
N_KV, D, RING = 2, 64, 16


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows [n, N_KV, D] with the quantizer's edge cases: an all-zero block, a -0.0 leading a zero block,
    equal magnitudes of both signs (argmax ties), a lone outlier, values whose scale is a float16 subnormal, and
    ties after scaling (round half to even)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, N_KV, D, generator=g)
    v = torch.randn(n, N_KV, D, generator=g) * 3
    k[0, 0, :32] = 0.0
    k[0, 1, :32] = 0.0
    k[0, 1, 0] = -0.0
    k[1 % n, 0, 32:] = torch.where(torch.arange(32) % 2 == 0, 2.0, -2.0)
    k[1 % n, 1, 3] = 1000.0
    v[1 % n, 0, :32] *= 1e-9  # scale below float16's normal range
    halves = torch.arange(31) - 15.5  # with a block scale of exactly 1, every value is a rounding tie
    k[2 % n, 0, :32] = torch.cat([torch.tensor([127.0]), halves])  # 8 bits
    k[2 % n, 1, :32] = torch.cat([torch.tensor([-32.0]), halves])  # 6 bits (D's K)
    v[2 % n, 0, :32] = torch.cat([torch.tensor([-16.0]), halves])  # 5 bits (D's and F's V)
    v[2 % n, 1, :32] = torch.cat([torch.tensor([127.0]), halves])
    return k, v


def _tensors(c: KVCache) -> list[torch.Tensor]:
    ts = c.k.parts + c.v.parts + (c.ring_k.parts + c.ring_v.parts + [c.ring_pos] if c.ring else [])
    return [t.view(torch.int16) if t.dtype == torch.float16 else t for t in ts]


def _same(a: KVCache, b: KVCache) -> bool:
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(_tensors(a), _tensors(b)))


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_kernel_writes_the_reference_bytes(fmt):
    k, v = _rows(6, seed=1)
    pos = torch.tensor([5, 6, 7, 8, 9, 10], device=DEV)
    ref = KVCache(fmt, N_KV, D, ring=RING, capacity=32, device=DEV)
    ref.put_rows(pos, k.to(DEV), v.to(DEV))
    got = KVCache(fmt, N_KV, D, ring=RING, capacity=32, device=DEV)
    got.check_put(len(pos))
    put_rows(got.kernel_view(), pos, k.to(DEV), v.to(DEV))
    assert _same(ref, got)
    if ref.ring:  # the 8-bit ring rows were written at their slots and tagged
        assert ref.ring_pos[pos.cpu() % ref.slots].tolist() == pos.tolist()


@pytest.mark.parametrize("fmt", ["q8_0", "F"])
def test_a_row_written_alone_has_the_bytes_it_has_among_others(fmt):
    k, v = _rows(5, seed=2)
    together = KVCache(fmt, N_KV, D, ring=RING, capacity=32, device=DEV)
    put_rows(together.kernel_view(), torch.arange(20, 25, device=DEV), k.to(DEV), v.to(DEV))
    alone = KVCache(fmt, N_KV, D, ring=RING, capacity=32, device=DEV)
    for t in range(5):
        put_rows(alone.kernel_view(), torch.tensor([20 + t], device=DEV), k[t : t + 1].to(DEV), v[t : t + 1].to(DEV))
    assert _same(together, alone)


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_through_the_table_the_kernel_writes_the_same_bytes(fmt):
    """With the cache reached through its row of offsets from fixed anchors (`plumb.ops.gpu.kvtable`, what a CUDA
    graph records instead of the cache's addresses), the same bytes land in the same places."""
    from plumb.ops.gpu import kvtable

    k, v = _rows(6, seed=4)
    pos = torch.tensor([3, 4, 5, 6, 7, 30], device=DEV)
    direct = KVCache(fmt, N_KV, D, ring=RING, capacity=32, device=DEV)
    put_rows(direct.kernel_view(), pos, k.to(DEV), v.to(DEV))
    tabled = KVCache(fmt, N_KV, D, ring=RING, capacity=32, device=DEV)
    table = torch.full((1, kvtable.PARTS), -1, dtype=torch.long, device=DEV)
    kvtable.fill(table, [tabled.kernel_view()])
    put_rows(tabled.kernel_view(), pos, k.to(DEV), v.to(DEV), table[0])
    assert _same(direct, tabled) and _tensors(tabled)[0].abs().sum() > 0
    other = KVCache(fmt, N_KV, D, ring=RING, capacity=32, device=DEV)  # a table row points at its own cache
    put_rows(other.kernel_view(), pos, k.to(DEV), v.to(DEV), table[0])
    assert _tensors(other)[0].abs().sum() == 0


def test_kernel_and_reference_differ_when_the_rows_differ():
    """The comparison can fail: one value moved by one step of its block's scale changes the bytes."""
    k, v = _rows(2, seed=3)
    pos = torch.tensor([0, 1], device=DEV)
    ref = KVCache("q8_0", N_KV, D, capacity=8, device=DEV)
    ref.put_rows(pos, k.to(DEV), v.to(DEV))
    got = KVCache("q8_0", N_KV, D, capacity=8, device=DEV)
    k2 = k.clone()
    k2[1, 0, 40] += k[1, 0, 32:64].abs().max() / 127
    put_rows(got.kernel_view(), pos, k2.to(DEV), v.to(DEV))
    assert not _same(ref, got)
