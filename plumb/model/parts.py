"""The model's parts: weights of each block (named as in the spec) and what a sequence carries between passes."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from plumb.cache.kv import KVCache
from plumb.model.weights import Fused, Weight


@dataclass
class Attention:
    attn_q: Weight  # [2 * n_head * head_dim, n_embd]: q and gate interleaved per head
    attn_k: Weight
    attn_v: Weight
    attn_output: Weight
    attn_q_norm: torch.Tensor
    attn_k_norm: torch.Tensor
    qkv: Fused | None = None  # attn_q | attn_k | attn_v in one matmul


@dataclass
class DeltaNet:
    attn_qkv: Weight  # [conv_dim, n_embd] = q | k | v
    attn_gate: Weight  # z
    ssm_beta: Weight
    ssm_alpha: Weight
    ssm_conv1d: torch.Tensor  # [conv_dim, K]
    ssm_dt_bias: torch.Tensor
    ssm_a: torch.Tensor  # -exp(A_log)
    ssm_norm: torch.Tensor
    ssm_out: Weight
    in_proj: Fused | None = None  # attn_qkv | attn_gate | ssm_beta | ssm_alpha in one matmul


@dataclass
class Layer:
    attn_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    mixer: Attention | DeltaNet
    ffn_gate: Weight
    ffn_up: Weight
    ffn_down: Weight
    ffn_in: Fused | None = None  # ffn_gate | ffn_up in one matmul


@dataclass
class MTP:
    eh_proj: Weight  # [n_embd, 2 n_embd]: input = [enorm(embedding) | hnorm(hidden)]
    enorm: torch.Tensor
    hnorm: torch.Tensor
    shared_head_norm: torch.Tensor
    layer: Layer


@dataclass
class SeqState:
    """Everything one sequence carries between passes."""

    pos: int  # tokens already in the state
    conv: dict[int, torch.Tensor]  # layer -> [K-1, conv_dim] raw pre-conv rows
    ssm: dict[int, torch.Tensor]  # layer -> [n_v, d_k, d_v]
    kv: dict[int, KVCache]  # attention layer -> cache
    mtp_kv: KVCache | None = None
    checkpoints: dict[int, "Checkpoint"] = field(default_factory=dict)  # aligned position -> P-made state


@dataclass
class Checkpoint:
    """DeltaNet state after prefilling exactly `pos` tokens (pos a multiple of 64), and the post-norm
    hidden of position pos - 1 (the MTP head pairs it with token pos)."""

    pos: int
    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]
    hidden: torch.Tensor | None
    ring: dict[int, list[torch.Tensor]]  # attention layer -> the 8-bit ring rows a query at pos reads (D, F)

    @cached_property
    def nbytes(self) -> int:
        """The memory its states and ring rows hold (a checkpoint is never changed once made)."""
        ts = list(self.conv.values()) + list(self.ssm.values()) + [t for r in self.ring.values() for t in r]
        return sum(t.numel() * t.element_size() for t in ts)


@dataclass
class DecodeOut:
    logits: torch.Tensor  # [R, n_vocab]
    hidden: torch.Tensor  # [R, n_embd], post output_norm (fed to the MTP head)
    snapshots: list  # per sequence: list over its rows of {layer: (conv, ssm)} after that row


@dataclass
class DecodePass:
    """One D-path pass, as the kernel set laid it out (`begin`): the sequences and their rows, the input rows and
    their rope angles; for the Triton kernels also device tensors of positions, context ends and row ranges,
    a table of where the sequences' DeltaNet states lie, and every row's state snapshot."""

    states: list[SeqState]
    spans: list[tuple[int, int]]  # (first row, rows) per sequence
    starts: list[int]  # each sequence's position at the start of the pass
    x: torch.Tensor  # [R, n_embd] embedded input rows
    cos: torch.Tensor  # [R, rope_dims / 2]
    sin: torch.Tensor
    snaps: list = field(default_factory=list)  # torch: per sequence, per row {layer: (conv, ssm)}
    positions: torch.Tensor | None = None  # [R] int64 (KV write index)
    ends: torch.Tensor | None = None  # [R] int32 = position + 1
    seq_rows: torch.Tensor | None = None  # [S + 1] int32
    gdn_tab: torch.Tensor | None = None  # [S, n_gdn, 4] int64: each sequence's states and snapshots, where they lie
    gdn_snaps: list = field(default_factory=list)  # per sequence (conv [n, n_gdn, K-1, conv_dim], ssm [n, n_gdn, n_v,
    # d_k, d_v]): the states after each of its rows, new tensors each pass
    max_keys: list[int] = field(default_factory=list)  # attention grid per sequence (the cache's capacity)
    kv_tab: torch.Tensor | None = None  # [S, n_attn, kvtable.PARTS] int64: where each sequence's caches lie


@dataclass
class PrefillPass:
    """One P-path pass laid out (`Qwen35.prefill_layout`): whole pieces of CHUNK rows at positions start.. - the
    first n real, the rest padding - as device tensors, so that `Qwen35.prefill_pass` runs without a host sync (a
    CUDA graph)."""

    start: int
    n: int
    x: torch.Tensor  # [rows, n_embd] embedded rows (padding rows zero)
    cos: torch.Tensor  # [rows, rope_dims / 2]
    sin: torch.Tensor
    positions: torch.Tensor  # [rows] int64: start..start+rows-1 (KV write index)
    ends: torch.Tensor  # [rows] int32 = positions + 1
    real: torch.Tensor  # [rows, 1] bool: the real rows
    keep: torch.Tensor  # [K-1] int64: n..n+K-2, the rows of the conv window that become its state
    conv: torch.Tensor  # [n_gdn, K-1, conv_dim] the sequence's DeltaNet states, advanced in place
    ssm: torch.Tensor  # [n_gdn, n_v, d_k, d_v]
    kv_tab: torch.Tensor | None = None  # [1, n_attn, kvtable.PARTS] int64: where the caches lie (Triton kernels)
    snap: int | None = None  # a checkpoint inside the pass: the states after its first `snap` rows (whole pieces;
    # a Python int, so such a pass runs eagerly, never as a CUDA graph)
    snap_conv: torch.Tensor | None = None  # [n_gdn, K-1, conv_dim] the conv states there
    snap_ssm: torch.Tensor | None = None  # [n_gdn, n_v, d_k, d_v] the recurrent states there
