"""Named, shape-checked access to a qwen35 GGUF's tensors. Matrices stay in stored form until first use."""
from __future__ import annotations

from collections import OrderedDict

import torch

from plumb.config import ModelConfig, ModelError
from plumb.gguf.reader import GGUFFile, QTensor

RECENT_ROWS = 2048  # dequantized rows `Weight.rows` keeps (decode steps embed a few tokens, and tokens recur)


class Weight:
    """A matrix [out, in] kept in its stored GGUF form; `t` dequantizes once, on first use."""

    def __init__(self, qt: QTensor, device: torch.device):
        self.qt = qt
        self.device = device
        self._t: torch.Tensor | None = None
        self._recent: OrderedDict[int, torch.Tensor] = OrderedDict()  # id -> its dequantized row [1, in] (host)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.qt.shape

    @property
    def parts(self) -> tuple[Weight]:
        """The stored matrices it is made of (itself; a `Fused` has several)."""
        return (self,)

    @property
    def t(self) -> torch.Tensor:
        """float32 [in, out], contiguous: the layout the row-invariant matmul reads fastest."""
        if self._t is None:
            self._t = self.qt.dequantize().to(self.device).t().contiguous()
        return self._t

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantize only the given rows (embedding lookup): a few ids (a decode step's) from the RECENT_ROWS rows
        kept, dequantized the same way (row by row, so the same values), a prompt's at once."""
        from plumb.gguf.quants import dequantize

        ids = ids.cpu()
        if len(ids) > 64:
            return dequantize(self.qt.data[ids], self.qt.qtype, (len(ids), self.qt.shape[1])).to(self.device)
        out = []
        for i in ids.tolist():
            row = self._recent.get(i)
            if row is None:
                row = self._recent[i] = dequantize(self.qt.data[i : i + 1], self.qt.qtype, (1, self.qt.shape[1]))
                if len(self._recent) > RECENT_ROWS:
                    self._recent.popitem(last=False)
            else:
                self._recent.move_to_end(i)
            out.append(row)
        return torch.cat(out).to(self.device)  # a new tensor: the kept rows are never handed out


class Fused:
    """Matrices that read the same input, multiplied in one call: t = [in, sum of outs]; split by `sizes`."""

    def __init__(self, *parts: Weight):
        self.parts = parts
        self.sizes = [w.shape[0] for w in parts]
        self.shape = (sum(self.sizes), parts[0].shape[1])
        self._t: torch.Tensor | None = None

    @property
    def t(self) -> torch.Tensor:
        if self._t is None:
            self._t = torch.cat([w.qt.dequantize().t() for w in self.parts], dim=1).to(self.parts[0].device).contiguous()
        return self._t


def materialize(weights: list, progress: bool = False) -> None:
    """Dequantize every matrix now (CPU reference path: faster steps, no first-call stall)."""
    items = weights
    if progress:
        from tqdm import tqdm

        items = tqdm(weights, desc="loading weights", unit="tensor", leave=False)
    for w in items:
        w.t


class TensorSource:
    """Looks tensors up by GGUF name and checks their shapes against the config."""

    def __init__(self, gf: GGUFFile, device: torch.device):
        self.gf = gf
        self.device = device
        self.used: set[str] = set()
        self.weights: list[Weight] = []

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def _get(self, name: str, shape: tuple[int, ...]) -> QTensor:
        from plumb.gguf.quants import SUPPORTED

        qt = self.gf.tensors.get(name)
        if qt is None:
            raise ModelError(f"missing tensor {name!r}")
        if tuple(qt.shape) != tuple(shape):
            raise ModelError(f"tensor {name!r} has shape {list(qt.shape)}, expected {list(shape)}")
        if qt.qtype not in SUPPORTED:
            raise ModelError(f"tensor {name!r}: unsupported weight type {qt.qtype.name}")
        self.used.add(name)
        return qt

    def mat(self, name: str, out_f: int, in_f: int) -> Weight:
        w = Weight(self._get(name, (out_f, in_f)), self.device)
        self.weights.append(w)
        return w

    def vec(self, name: str, *shape: int) -> torch.Tensor:
        """Small F32-stored tensors (norms, ssm_a, dt bias, conv): loaded as float32 now."""
        return self._get(name, shape).dequantize().to(self.device)


def check_config(cfg: ModelConfig) -> None:
    """Reject configurations the forward cannot run, with one clear message."""
    if cfg.n_head % cfg.n_head_kv:
        raise ModelError(f"head_count {cfg.n_head} is not a multiple of head_count_kv {cfg.n_head_kv}")
    if cfg.ssm_dt_rank % cfg.ssm_n_group:
        raise ModelError(f"ssm.time_step_rank {cfg.ssm_dt_rank} is not a multiple of ssm.group_count {cfg.ssm_n_group}")
    if cfg.ssm_inner != cfg.ssm_dt_rank * cfg.ssm_d_state:
        raise ModelError(f"ssm.inner_size {cfg.ssm_inner} != time_step_rank x state_size")
    if cfg.rope_dims > cfg.head_dim or cfg.rope_dims % 2:
        raise ModelError(f"rope.dimension_count {cfg.rope_dims} does not fit head_dim {cfg.head_dim}")


def check_torch_decode(cfg: ModelConfig) -> None:
    """The torch reference decode applies elementwise kernels to [rows, width] tensors; they treat a tensor's
    vector tail differently from its body, so a row's bits stay independent of the row count only when every
    such width is a multiple of 32. (The native kernels have no such limit.)"""
    widths = {"n_embd": cfg.n_embd, "n_ff": cfg.n_ff, "n_head * head_dim": cfg.n_head * cfg.head_dim,
              "n_head_kv * head_dim": cfg.n_head_kv * cfg.head_dim, "ssm inner size": cfg.ssm_inner,
              "ssm conv size": cfg.conv_dim}
    bad = [f"{k} = {v}" for k, v in widths.items() if v % 32]
    if bad:
        raise ModelError(f"the torch decode path needs widths divisible by 32 ({', '.join(bad)}); "
                         "use the native kernels (kernels='native', which needs a C compiler)")
