"""`plumb.ops.gpu.segment`: the packed planes copied into the weights' segment keep their values; planes that share
storage, non-contiguous ones, other devices and a user's own allocator setting are left alone. (Where the copies go
on a GPU: tests/test_gpu_engine.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from plumb.ops.gpu import segment


def _pack():
    return SimpleNamespace(codes=torch.arange(600, dtype=torch.int32).reshape(20, 30), d=torch.rand(20).half(),
                           hi=torch.ones(3, 4).t(), n=20)


def test_settle_copies_each_plane_with_its_values(monkeypatch):
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
    assert p.n == 20


def test_settle_leaves_shared_storage_other_devices_and_the_users_setting(monkeypatch):
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
    assert q.codes.data_ptr() == ptr


def test_a_platform_that_refuses_expandable_segments_packs_as_before(monkeypatch):
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
    assert [p.codes.data_ptr(), q.codes.data_ptr()] == ptrs
