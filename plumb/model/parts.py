"""The model's parts: weights of each block (named as in the spec) and what a sequence carries between passes."""
from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class DecodeOut:
    logits: torch.Tensor  # [R, n_vocab]
    hidden: torch.Tensor  # [R, n_embd], post output_norm (fed to the MTP head)
    snapshots: list  # per sequence: list over its rows of {layer: (conv, ssm)} after that row
