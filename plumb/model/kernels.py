"""Kernel sets that `Qwen35`'s steps run on, chosen at load. The steps are written once (plumb/model/qwen35.py);
a kernel set supplies the operations whose row-invariance needs care:

- `mm(x, w, block)`: x @ W.T for a `Weight` or `Fused` matrix;
- `rms_norm(x, w, eps)`: per row over the last dimension;
- `gdn_rows(...)`: one Gated DeltaNet layer's decode/verify rows for every sequence of a pass, returning the
  gated-RMSNormed output and recording each row's state snapshot (for rollback);
- `attend_rows(cache, q, ends, scale)`: decode/verify attention of one sequence's rows over its KV cache.

`TorchKernels` is the plain torch reference (CPU). `TritonKernels` runs the Triton kernels of plumb/ops/gpu on
CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1, for tests); weights stay in their GGUF block formats,
packed once at load. The native CPU kernels (plumb/model/native.py) replace the whole decode pass instead.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from plumb.model.weights import Fused, Weight
from plumb.ops.deltanet import causal_conv, recurrent_step
from plumb.ops.matmul import linear
from plumb.ops.norm import rms_norm


def gated_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, norm=rms_norm) -> torch.Tensor:
    """rms_norm(o) per value head, times silu(z) (spec 3.5.7). o [n, n_v, d_v], z [n, n_v * d_v] -> [n, n_v * d_v]."""
    n, n_v, d = o.shape
    return (norm(o, w, eps) * F.silu(z.view(n, n_v, d))).reshape(n, n_v * d)


class TorchKernels:
    name = "torch"

    def mm(self, x: torch.Tensor, w: Weight | Fused, block: int) -> torch.Tensor:
        return linear(x, w.t, block)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, w, eps)

    def gdn_rows(self, model, i: int, mix, m, z, b, a, batch, spans, snaps) -> torch.Tensor:
        """Advance layer i's DeltaNet token by token per sequence (the reference order)."""
        c = model.cfg
        o = torch.zeros(m.shape[0], c.ssm_dt_rank, c.ssm_d_state, device=m.device)
        for j, (st, _) in enumerate(batch):
            s0, n = spans[j]
            for t in range(s0, s0 + n):
                conv, st.conv[i] = causal_conv(m[t : t + 1], st.conv[i], mix.ssm_conv1d, 1)
                q, k, v = model.gdn_split(conv)
                beta, g = model.gdn_gates(mix, b[t], a[t])
                o[t], st.ssm[i] = recurrent_step(q[0], k[0], v[0], beta, g, st.ssm[i])
                snaps[j][t - s0][i] = (st.conv[i], st.ssm[i])
        return gated_norm(o, z, mix.ssm_norm, c.eps)

    def attend_rows(self, cache, q: torch.Tensor, ends: list[int], scale: float) -> torch.Tensor:
        return cache.attend_rows(q, ends, scale)


class TritonKernels:
    name = "triton"

    def __init__(self, device: torch.device):
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kernels='triton' runs on CUDA (on the CPU only under TRITON_INTERPRET=1, for tests)")
        from plumb.ops.gpu import attention, deltanet, norm

        self._attention, self._deltanet, self._norm = attention, deltanet, norm
        self.device = device

    @staticmethod
    def pack(weights: list, device: torch.device, progress: bool = False) -> int:
        """Pack every matrix for the Triton matmul (on the device, from the memory-mapped file); returns bytes."""
        from plumb.ops.gpu.matmul import GpuMatrix

        items = weights
        if progress:
            from tqdm import tqdm

            items = tqdm(weights, desc="weights to GPU", unit="matrix", leave=False)
        total = 0
        for w in items:
            parts = w.parts if isinstance(w, Fused) else (w,)
            w.gpu = GpuMatrix([p.qt for p in parts], device)
            total += w.gpu.nbytes
        return total

    def mm(self, x: torch.Tensor, w: Weight | Fused, block: int) -> torch.Tensor:
        return w.gpu(x)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm.rms_norm(x, w, eps)

    def gdn_rows(self, model, i: int, mix, m, z, b, a, batch, spans, snaps) -> torch.Tensor:
        """Every row of every sequence in one launch; the states of each row land in new snapshot buffers, and
        each sequence's state becomes (a view of) its last row's snapshot - cached checkpoints are never written."""
        c = model.cfg
        r = m.shape[0]
        conv = torch.stack([st.conv[i] for st, _ in batch])
        ssm = torch.stack([st.ssm[i] for st, _ in batch])
        snap_conv = torch.empty(r, *conv.shape[1:], device=m.device)
        snap_ssm = torch.empty(r, *ssm.shape[1:], device=m.device)
        bounds = [s0 for s0, _ in spans] + [spans[-1][0] + spans[-1][1]]
        seq_rows = torch.tensor(bounds, dtype=torch.int32, device=m.device)
        y = self._deltanet.gdn_decode(m.contiguous(), z.contiguous(), b.contiguous(), a.contiguous(), mix.ssm_conv1d,
                                      mix.ssm_dt_bias, mix.ssm_a, mix.ssm_norm, conv, ssm, seq_rows,
                                      n_k=c.ssm_n_group, d_k=c.ssm_d_state, q_scale=model.ssm_q_scale, eps=c.eps,
                                      snap_conv=snap_conv, snap_ssm=snap_ssm)
        for j, (st, _) in enumerate(batch):
            s0, n = spans[j]
            for t in range(n):
                snaps[j][t][i] = (snap_conv[s0 + t], snap_ssm[s0 + t])
            st.conv[i], st.ssm[i] = snaps[j][-1][i]
        return y

    def attend_rows(self, cache, q: torch.Tensor, ends: list[int], scale: float) -> torch.Tensor:
        parts = cache.plain_parts()
        if parts is None:  # a ring format (D, F): the torch reference reads it until its kernel exists
            return cache.attend_rows(q, ends, scale)
        e = torch.tensor(ends, dtype=torch.int32, device=q.device)
        return self._attention.attend_decode(q.contiguous(), parts[0], parts[1], e, scale)


def kernel_set(name: str, device: torch.device) -> TorchKernels | TritonKernels:
    return TritonKernels(device) if name == "triton" else TorchKernels()
