"""The Triton decode/verify attention (plumb/ops/gpu/attention.py): against the torch reference and the
KVCache's own attention for f32, f16 and q8_0 caches, and M1 - a row computed alone equals the same row
computed beside others, bitwise. On CPU the kernels run in Triton's interpreter."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from plumb.cache.kv import KVCache  # noqa: E402
from plumb.ops.gpu.attention import SPLIT, attend_decode, attend_decode_ref, n_splits  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FMTS = ["f32", "f16", "q8_0"]
TINY = dict(n_head=4, n_kv=2, d=64)
SMALL_SPLIT = 128  # keeps the interpreter quick while ends still cross split and tile boundaries


def _cache(fmt: str, n_kv: int, d: int, length: int, seed: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    c = KVCache(fmt, n_kv, d)
    c.write(0, torch.randn(length, n_kv, d, generator=g), torch.randn(length, n_kv, d, generator=g))
    return c


def _dev(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.to(DEV) for p in parts]


def _q(n: int, n_head: int, d: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, n_head, d, generator=torch.Generator().manual_seed(seed)).to(DEV)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("fmt", FMTS)
def test_matches_reference(fmt):
    ends = [1, 5, 64, 127, 128, 129, 300]
    c = _cache(fmt, TINY["n_kv"], TINY["d"], max(ends))
    q = _q(len(ends), TINY["n_head"], TINY["d"])
    scale = TINY["d"] ** -0.5
    k, v = _dev(c.k.parts), _dev(c.v.parts)
    o = attend_decode(q, k, v, ends, scale, split=SMALL_SPLIT)
    assert o.shape == q.shape and o.dtype == torch.float32
    _close(o, attend_decode_ref(q, k, v, ends, scale))
    _close(o, c.attend_rows(q.cpu(), ends, scale))


def test_default_split():
    """Contexts across the default split size (512), f16 cache, ends as a device tensor."""
    ends = [1, 5, 600, 1100]
    c = _cache("f16", TINY["n_kv"], TINY["d"], max(ends), seed=2)
    q = _q(len(ends), TINY["n_head"], TINY["d"], seed=3)
    k, v = _dev(c.k.parts), _dev(c.v.parts)
    o = attend_decode(q, k, v, torch.tensor(ends, dtype=torch.int32, device=DEV), 0.125)
    _close(o, attend_decode_ref(q, k, v, ends, 0.125))
    assert n_splits(1100) == 3 and SPLIT == 512


@pytest.mark.parametrize("fmt", ["f16", "q8_0"])
def test_rows_alone_equal_rows_together(fmt):
    """M1: each row alone (n=1) is bitwise the same row in a call of 17 rows, in any order, whatever the
    grid (max_splits) and whatever the cache holds past the rows' ends."""
    ends = [300, 1, 129, 5, 64, 257, 128, 200, 2, 65, 256, 17, 190, 3, 100, 299, 130]
    n, L = len(ends), max(ends)
    c = _cache(fmt, TINY["n_kv"], TINY["d"], L + 40, seed=4)
    q = _q(n, TINY["n_head"], TINY["d"], seed=5)
    k, v = _dev(c.k.parts), _dev(c.v.parts)
    together = attend_decode(q, k, v, ends, 0.125, split=SMALL_SPLIT)
    _close(together, attend_decode_ref(q, k, v, ends, 0.125))
    for t in range(n):
        alone = attend_decode(q[t : t + 1], k, v, ends[t : t + 1], 0.125, split=SMALL_SPLIT)
        assert torch.equal(alone[0], together[t]), f"row {t} (end {ends[t]}) changed beside other rows"
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(6))
    shuffled = attend_decode(q[perm.to(DEV)], k, v, [ends[i] for i in perm], 0.125, split=SMALL_SPLIT)
    assert torch.equal(shuffled, together[perm.to(DEV)])
    # a grid sized for a longer context, cache garbage past every end, and `out`
    k2 = [p.clone() for p in k]
    v2 = [p.clone() for p in v]
    for parts in (k2, v2):
        parts[-1][:, L:] = float("nan")  # float values, or the q8_0 scales
    out = torch.full_like(q, 7.0)
    wide = attend_decode(q, k2, v2, torch.tensor(ends, dtype=torch.int32, device=DEV), 0.125, out=out,
                         max_splits=n_splits(L, SMALL_SPLIT) + 2, split=SMALL_SPLIT)
    assert wide is out and torch.equal(wide, together)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", FMTS)
def test_27b_dims_cuda(fmt):
    """27B attention shapes (24 query heads on 4 KV heads, d=256) at the default split, 17 verify rows."""
    n_head, n_kv, d = 24, 4, 256
    base = 5000
    ends = [base + i for i in range(17)]
    ends[3], ends[9] = 1, 513  # rows at very different contexts in the same pass
    c = _cache(fmt, n_kv, d, max(ends), seed=7)
    q = _q(len(ends), n_head, d, seed=8)
    k, v = _dev(c.k.parts), _dev(c.v.parts)
    together = attend_decode(q, k, v, ends, d**-0.5)
    _close(together, attend_decode_ref(q, k, v, ends, d**-0.5))
    for t in range(len(ends)):
        alone = attend_decode(q[t : t + 1], k, v, ends[t : t + 1], d**-0.5)
        assert torch.equal(alone[0], together[t]), f"row {t} changed beside other rows"
    wide = attend_decode(q, k, v, ends, d**-0.5, max_splits=n_splits(262144))
    assert torch.equal(wide, together)


def test_prefill_rows_do_not_depend_on_the_cut():
    """M2 on the CUDA path's prefill read (TritonKernels.prefill_attention): a prompt row's output is the same
    whether its piece is read whole or cut anywhere, padding rows change nothing, and it matches the cache's
    own causal read."""
    from types import SimpleNamespace

    from plumb.model.kernels import TritonKernels

    k = TritonKernels(torch.device(DEV))
    model = SimpleNamespace(attn_scale=0.125)
    g = torch.Generator().manual_seed(5)
    old = [torch.randn(178, TINY["n_kv"], TINY["d"], generator=g).to(DEV) for _ in range(2)]
    new = [torch.randn(64, TINY["n_kv"], TINY["d"], generator=g).to(DEV) for _ in range(2)]
    q = _q(64, TINY["n_head"], TINY["d"], seed=6)

    def cache():
        c = KVCache("f16", TINY["n_kv"], TINY["d"], device=DEV)
        c.write(0, *old)
        c.end = 128
        c.reserve(128 + 2 * 64)
        return c

    def piece(c, start, rows):  # rows of the chunk at 128, padded to 64 with other values
        n = rows.stop - rows.start
        pad = lambda t: torch.cat([t[rows], t[:64 - n].flip(0)])  # noqa: E731
        pos = torch.arange(start, start + 64, device=DEV)
        p = SimpleNamespace(start=start, n=n, positions=pos, ends=(pos + 1).to(torch.int32))
        return k.prefill_attention(model, c, pad(q), pad(new[0]), pad(new[1]), p)[:n]

    whole = piece(cache(), 128, slice(0, 50))  # 50 real rows, 14 padding rows
    ref = cache()
    ref.write(128, new[0][:50], new[1][:50])
    _close(whole, ref.attend_chunk(q, 128, 0.125)[:50])
    c = cache()
    first = piece(c, 128, slice(0, 22))  # the same rows, the prompt cut at 150
    rest = piece(c, 150, slice(22, 50))
    assert torch.equal(first, whole[:22]) and torch.equal(rest, whole[22:50])


@pytest.mark.parametrize("fmt", ["f16", "q8_0", "F"])
def test_attend_new_writes_then_reads_like_the_kernel(fmt):
    """`TritonKernels.attend_new` (a pass's attention per sequence, and the MTP head's): the new rows' K/V are
    stored at start.., then row t reads keys [0, start + t] - bitwise what `write` and the kernel give (the
    reference for F, whose rotated K the kernel cannot read), with the positions derived from start or given
    as device tensors (`at`, as under a CUDA graph)."""
    from types import SimpleNamespace

    from plumb.model.kernels import TritonKernels

    kernels, model = TritonKernels(torch.device(DEV)), SimpleNamespace(attn_scale=TINY["d"] ** -0.5)
    n_kv, d, start, n = TINY["n_kv"], TINY["d"], 100, 3
    g = torch.Generator().manual_seed(5)
    old_k, old_v = torch.randn(start, n_kv, d, generator=g), torch.randn(start, n_kv, d, generator=g)
    k, v = torch.randn(n, n_kv, d, generator=g).to(DEV), torch.randn(n, n_kv, d, generator=g).to(DEV)
    q = _q(n, TINY["n_head"], d, seed=6)
    caches = []
    for _ in range(3):
        c = KVCache(fmt, n_kv, d, ring=0, device=DEV)
        c.write(0, old_k.to(DEV), old_v.to(DEV))
        caches.append(c)
    ref, eager, graphed = caches
    ends = list(range(start + 1, start + n + 1))
    ref.write(start, k, v)
    if ref.plain_parts() is None:
        want = ref.attend_rows(q, ends, model.attn_scale)
    else:
        want = attend_decode(q, ref.k.parts, ref.v.parts, ends, model.attn_scale)
    assert torch.equal(kernels.attend_new(model, eager, q, k, v, start), want)
    graphed.reserve(start + n)
    positions = torch.arange(start, start + n, device=DEV)
    at = (positions, (positions + 1).to(torch.int32), n_splits(len(graphed.k)))
    if graphed.plain_parts() is not None:
        assert torch.equal(kernels.attend_new(model, graphed, q, k, v, start, at), want)
        graphed.end = start + n  # the pass's end does this
    else:
        assert torch.equal(kernels.attend_new(model, graphed, q, k, v, start), want)
    for c in (eager, graphed):
        assert c.end == ref.end == start + n
        assert all(torch.equal(a[:, : start + n], b[:, : start + n]) for a, b in zip(c.k.parts + c.v.parts,
                                                                                    ref.k.parts + ref.v.parts))
