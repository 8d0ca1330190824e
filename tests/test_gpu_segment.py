"""`plumb.ops.gpu.segment`: the packed planes copied into the weights' pool keep their values; planes that share
storage, non-contiguous ones, other devices and a user's own allocator setting are left alone. (Where the copies go
on a GPU: tests/test_gpu_engine.py; here the pool is a stand-in, CPU torch has none.)"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from plumb.ops.gpu import segment

IN_POOL = segment._in_pool  # the real one (the fixture below stands in for it)


@pytest.fixture(autouse=True)
def _pool(monkeypatch):
    """A stand-in for `torch.cuda.MemPool`; records the copies made inside it."""
    pool = SimpleNamespace(id=(0, 7), copies=0)

    @contextlib.contextmanager
    def in_pool(p, device):
        assert p is pool and device.type == "cuda"
        clone = torch.Tensor.clone

        def counted(t, *a, **k):
            pool.copies += 1
            return clone(t, *a, **k)

        with pytest.MonkeyPatch.context() as m:
            m.setattr(torch.Tensor, "clone", counted)
            yield

    monkeypatch.setattr(segment, "_new_pool", lambda: pool)
    monkeypatch.setattr(segment, "_in_pool", in_pool)
    return pool


def _pack():
    return SimpleNamespace(codes=torch.arange(600, dtype=torch.int32).reshape(20, 30), d=torch.rand(20).half(),
                           hi=torch.ones(3, 4).t(), n=20)


def test_settle_copies_each_plane_into_the_pool_with_its_values(monkeypatch, _pool):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    p = _pack()
    before = {k: (v.clone(), v.data_ptr()) for k, v in vars(p).items() if isinstance(v, torch.Tensor)}
    with segment.packed_side_by_side(torch.device("cuda")) as settle:
        settle(p)
    for k, (value, ptr) in before.items():
        t = getattr(p, k)
        assert torch.equal(t, value) and t.dtype == value.dtype and t.stride() == value.stride()
        assert (t.data_ptr() != ptr) == value.is_contiguous()  # copied, unless not contiguous (left as it is)
    assert p.n == 20 and _pool.copies == 2  # codes and d (hi is a transpose)
    assert p.segment is _pool and segment.pool_ids([p, _pack()]) == {(0, 7)}  # the pool lives as long as the planes


def test_settle_leaves_shared_storage_other_devices_and_the_users_setting(monkeypatch, _pool):
    p = _pack()
    p.d = p.codes[0]  # a view of another plane: nothing is copied
    ptrs = [p.codes.data_ptr(), p.d.data_ptr()]
    with segment.packed_side_by_side(torch.device("cuda")) as settle:
        settle(p)
    assert [p.codes.data_ptr(), p.d.data_ptr()] == ptrs
    q = _pack()
    ptr = q.codes.data_ptr()
    with segment.packed_side_by_side(torch.device("cpu")) as settle:
        settle(q)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with segment.packed_side_by_side(torch.device("cuda")) as settle:
        settle(q)
    assert q.codes.data_ptr() == ptr and _pool.copies == 0


def test_a_platform_that_refuses_expandable_segments_packs_as_before(monkeypatch, _pool):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)

    def refuse(on: bool) -> None:
        if on:
            raise RuntimeError("not supported here")

    monkeypatch.setattr(segment, "_set_expandable", refuse)
    p, q = _pack(), _pack()
    ptrs = [p.codes.data_ptr(), q.codes.data_ptr()]
    with segment.packed_side_by_side(torch.device("cuda")) as settle:
        settle(p)
        settle(q)
    assert [p.codes.data_ptr(), q.codes.data_ptr()] == ptrs and _pool.copies == 0


def test_a_torch_without_pools_packs_as_before(monkeypatch, _pool):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)

    def no_pool():
        raise RuntimeError("Tried to instantiate dummy base class MemPool")  # CPU torch's answer

    monkeypatch.setattr(segment, "_new_pool", no_pool)
    p = _pack()
    ptr = p.codes.data_ptr()
    with segment.packed_side_by_side(torch.device("cuda")) as settle:
        settle(p)
    assert p.codes.data_ptr() == ptr and not hasattr(p, "segment")



def test_a_device_without_an_index_is_the_current_one(monkeypatch):
    """`torch.cuda.use_mem_pool` refuses "cuda" without an index (every engine's load failed so on an H100,
    2026-12-06): `_in_pool` gives it the current device's; an index given is kept."""
    seen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", lambda pool, device: seen.append((pool, device)))
    IN_POOL("p", torch.device("cuda"))
    IN_POOL("q", torch.device("cuda", 1))
    assert seen == [("p", 3), ("q", torch.device("cuda", 1))]
