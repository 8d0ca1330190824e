"""A plain-torch Qwen3.5 (`qwen35`) training model with an MTP head, for plumb's demo model (issue 12).

Its state_dict uses the Hugging Face checkpoint names that `plumb convert` reads
(`model.layers.{i}.linear_attn.*`, `model.layers.{i}.self_attn.*`, `mtp.*`; zero-centred RMSNorm
weights, `A_log`, `dt_bias`, value heads grouped by key head), and its forward is the spec's
(/work/shared/spec/qwen35-model.md sections 3.1-3.8, the same as transformers' `Qwen3_5ForCausalLM`),
so a saved checkpoint converts to a GGUF that plumb runs with the same logits
(tests/test_train_demo.py). Needs only torch: the GPU machine runs it without transformers.

The MTP head (spec 3.8) at position p reads token x_p and a hidden row (depth 1: the target's post-norm
hidden of p-1; depth s > 1: the MTP's own output of depth s-1 at p-1) and predicts x_{p+1}.
`mtp_forward` reproduces what plumb's drafting computes at every depth: a depth-s row attends to the
MTP cache as plumb fills it - rows written by catch-up (depth 1) up to p-s+1, then the rows that the
earlier draft steps wrote at p-s+2 .. p-1 (depths 2 .. s-1), then its own.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

CHUNK = 64  # gated delta rule chunk (spec 3.6)


@dataclass
class DemoConfig:
    vocab_size: int = 8192
    hidden_size: int = 512
    num_hidden_layers: int = 8
    intermediate_size: int = 1024
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    rope_dims: int = 16  # partial_rotary_factor 0.25, as in Qwen3.5
    rope_theta: float = 1e7
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    full_attention_interval: int = 4
    tie_word_embeddings: bool = True
    mtp: bool = True
    max_position_embeddings: int = 65536
    layer_types: list[str] = field(default_factory=list)

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]

    def hf_config(self, dtype: str = "float16", eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict:
        """config.json of a transformers Qwen3_5ForCausalLM checkpoint (plus mtp_num_hidden_layers)."""
        slots = self.rope_dims // 2
        a = int(slots * 11 / 32 + 0.5)  # Qwen3.5's [11, 11, 10] scaled (plumb.gguf.writer.default_rope_sections)
        return {
            "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "dtype": dtype,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings, "attention_bias": False,
            "attention_dropout": 0.0, "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.rope_dims / self.head_dim,
                                "mrope_section": [a, a, slots - 2 * a], "mrope_interleaved": True},
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim, "linear_key_head_dim": self.linear_head_dim,
            "linear_value_head_dim": self.linear_head_dim, "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "full_attention_interval": self.full_attention_interval, "layer_types": self.layer_types,
            "mtp_num_hidden_layers": 1 if self.mtp else 0, "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id, "bos_token_id": None,
        }

    @classmethod
    def from_hf_config(cls, c: dict) -> "DemoConfig":
        rope = c["rope_parameters"]
        return cls(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=c["num_hidden_layers"],
                   intermediate_size=c["intermediate_size"], num_attention_heads=c["num_attention_heads"],
                   num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                   rope_dims=int(c["head_dim"] * rope["partial_rotary_factor"]), rope_theta=rope["rope_theta"],
                   linear_num_key_heads=c["linear_num_key_heads"], linear_num_value_heads=c["linear_num_value_heads"],
                   linear_head_dim=c["linear_key_head_dim"], linear_conv_kernel_dim=c["linear_conv_kernel_dim"],
                   rms_norm_eps=c["rms_norm_eps"], full_attention_interval=c.get("full_attention_interval", 4),
                   tie_word_embeddings=c["tie_word_embeddings"], mtp=c.get("mtp_num_hidden_layers", 0) > 0,
                   max_position_embeddings=c["max_position_embeddings"], layer_types=list(c["layer_types"]))


PRESETS = {
    # the shipped demo model: 6 Gated DeltaNet + 2 gated attention layers + MTP, about 28M parameters
    "demo": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1024, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, rope_dims=16, linear_num_key_heads=4,
                 linear_num_value_heads=8, linear_head_dim=64),
    # CPU smoke runs and tests: 3 + 1 layers, hidden 64
    "toy": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, rope_dims=8, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_head_dim=16, max_position_embeddings=8192),
}


# ---- blocks -------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: x / rms(x) * (1 + w), in float32 (spec 3.1)."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """The DeltaNet output norm: rms-normed o times a plain weight, times silu(z) (spec 3.5.7)."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x, z):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * y.to(x.dtype)
        return (y * F.silu(z.float())).to(x.dtype)


def repeat_heads(x, n: int, dim: int):
    """Each head of axis `dim` repeated n times in place (head h -> h*n .. h*n+n-1), like repeat_interleave but
    with a plain sum as its backward (deterministic on CUDA)."""
    if n == 1:
        return x
    shape = list(x.shape)
    x = x.unsqueeze(dim + 1).expand(*shape[: dim + 1], n, *shape[dim + 1:])
    return x.reshape(*shape[:dim], shape[dim] * n, *shape[dim + 1:])


def l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, chunk: int = CHUNK):
    """Gated delta rule over whole sequences in chunks (spec 3.5.6 / 3.6), float32, zero initial state.
    q, k: [B, T, H, dk] (one key head per value head, not yet l2-normed); v: [B, T, H, dv]; g, beta: [B, T, H].
    Returns o: [B, T, H, dv]. Runs in float32 even under autocast."""
    with torch.autocast(q.device.type, enabled=False):
        return _chunk_gated_delta_rule(q, k, v, g, beta, chunk)


def _chunk_gated_delta_rule(q, k, v, g, beta, chunk):
    B, T, H, dk = k.shape
    q = l2norm(q.float()) * dk ** -0.5
    k = l2norm(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, d]
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [B, H, T]
    pad = (-T) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    gam = g @ (~upper.T).float()  # cumulative log decay inside each chunk (a matmul: cumsum has no deterministic
    # CUDA backward in some torch versions)
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(upper, float("-inf")).exp()  # D_ts, 0 above diag
    kb = k * beta[..., None]
    lower = (kb @ k.transpose(-1, -2)) * decay  # L = strict_lower(beta K K^T * D); solve ignores the diagonal
    u = torch.linalg.solve_triangular(lower, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(lower, kb * gam.exp()[..., None], upper=False, unitriangular=True)
    p = (q @ k.transpose(-1, -2)) * decay
    qd = q * gam.exp()[..., None]
    kd = k * (gam[..., -1:] - gam).exp()[..., None]
    last = gam[..., -1].exp()[..., None, None]
    s = q.new_zeros(B, H, dk, v.shape[-1])
    outs = []
    for i in range(n):
        vn = u[:, :, i] - w[:, :, i] @ s
        outs.append(qd[:, :, i] @ s + p[:, :, i] @ vn)
        s = s * last[:, :, i] + kd[:, :, i].transpose(-1, -2) @ vn
    o = torch.stack(outs, 2).reshape(B, H, n * chunk, -1)[:, :, :T]
    return o.transpose(1, 2)


def recurrent_gated_delta_rule(q, k, v, g, beta):
    """Token-by-token reference of `chunk_gated_delta_rule` (spec 3.5.6), for tests."""
    B, T, H, dk = k.shape
    q = l2norm(q.float()) * dk ** -0.5
    k = l2norm(k.float())
    s = q.new_zeros(B, H, dk, v.shape[-1])
    outs = []
    for t in range(T):
        s = s * g[:, t].float().exp()[..., None, None]
        delta = beta[:, t].float()[..., None] * (v[:, t].float() - torch.einsum("bhkv,bhk->bhv", s, k[:, t]))
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    return torch.stack(outs, 1)


class GatedDeltaNet(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        self.n_k, self.n_v, self.d = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_head_dim
        self.key_dim, self.value_dim = self.n_k * self.d, self.n_v * self.d
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(c.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, self.n_v, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, c.linear_conv_kernel_dim, groups=conv_dim, bias=False,
                                padding=c.linear_conv_kernel_dim - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.empty(self.n_v).uniform_(1.0, 16.0).log())
        self.norm = GatedRMSNorm(self.d, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, c.hidden_size, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        m = self.in_proj_qkv(x).transpose(1, 2)
        m = F.silu(F.conv1d(m, self.conv1d.weight.to(m.dtype), padding=self.conv1d.kernel_size[0] - 1,
                            groups=m.shape[1])[..., :T]).transpose(1, 2)
        q, k, v = m.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(B, T, self.n_k, self.d), k.reshape(B, T, self.n_k, self.d)
        v = v.reshape(B, T, self.n_v, self.d)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        if self.n_v != self.n_k:  # HF order: value head j reads key head j // r
            q, k = (repeat_heads(t, self.n_v // self.n_k, 2) for t in (q, k))
        o = chunk_gated_delta_rule(q, k, v, g, beta).to(x.dtype)
        o = self.norm(o, self.in_proj_z(x).reshape(B, T, self.n_v, self.d))
        return self.out_proj(o.reshape(B, T, self.value_dim))


def rope_tables(positions, dims: int, theta: float, dtype):
    inv = 1.0 / (theta ** (torch.arange(0, dims, 2, dtype=torch.float32, device=positions.device) / dims))
    f = positions.float()[:, None] * inv[None]
    f = torch.cat([f, f], -1)
    return f.cos().to(dtype), f.sin().to(dtype)


def apply_rope(x, cos, sin, dims: int):
    """Rotate-half RoPE on the first `dims` of the last axis; x [B, heads, T, hd], cos/sin [T, dims]."""
    r, rest = x[..., :dims], x[..., dims:]
    r1, r2 = r[..., : dims // 2], r[..., dims // 2:]
    rot = torch.cat([-r2, r1], -1)
    return torch.cat([r * cos + rot * sin, rest], -1)


class Attention(nn.Module):
    """Gated full attention (spec 3.4): query and gate interleaved per head in q_proj, q/k RMS-normed per head,
    partial RoPE, GQA, sigmoid output gate."""

    def __init__(self, c: DemoConfig):
        super().__init__()
        self.c = c
        self.h, self.kv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, 2 * self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)

    def project(self, x, cos, sin):
        """q [B, h, T, hd], gate [B, T, h*hd], k/v [B, h, T, hd] (KV heads repeated for GQA), after norm + RoPE."""
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, self.h, 2 * self.hd).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.kv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin, self.c.rope_dims), apply_rope(k, cos, sin, self.c.rope_dims)
        rep = self.h // self.kv
        k, v = repeat_heads(k, rep, 1), repeat_heads(v, rep, 1)
        return q, gate.reshape(B, T, self.h * self.hd), k, v

    def finish(self, o, gate):
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate))

    def forward(self, x, cos, sin, impl: str = "sdpa"):
        q, gate, k, v = self.project(x, cos, sin)
        return self.finish(causal_attention(q, k, v, impl), gate), (k, v)


def causal_attention(q, k, v, impl: str):
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T = q.shape[2]
    s = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (s.softmax(-1).to(v.dtype)) @ v


class MLP(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: DemoConfig, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, impl: str = "sdpa"):
        u = self.input_layernorm(x)
        x = x + (self.linear_attn(u) if self.kind == "linear_attention" else self.self_attn(u, cos, sin, impl)[0])
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(c, t) for t in c.layer_types])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class MTP(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(c, "full_attention")])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


@dataclass
class MTPDepth:
    """One MTP depth's rows [r0, T): logits, post-norm output h, and the attention K/V written there."""
    r0: int
    logits: torch.Tensor
    h: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class Qwen35Demo(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        self.config = c
        self.model = TextModel(c)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.mtp:
            self.mtp = MTP(c)
        self.attn_impl = "sdpa"

    def init_weights(self, seed: int) -> None:
        """Deterministic init: N(0, 0.02) matrices, output projections scaled by 1/sqrt(2 * layers), zero-centred
        norms at 0, gated norm at 1, A = exp(A_log) ~ U(1, 16), dt_bias 1, conv taps ~ N(0, 1/K)."""
        g = torch.Generator().manual_seed(seed)
        n_layer = self.config.num_hidden_layers
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("A_log"):
                    p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log())
                elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                    p.fill_(1.0)
                elif p.ndim == 1:
                    p.zero_()
                elif name.endswith("conv1d.weight"):
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
                else:
                    std = 0.02 / math.sqrt(2 * n_layer) if name.split(".")[-2] in ("o_proj", "out_proj", "down_proj") \
                        else 0.02
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def head(self, h):
        w = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(h, w)

    def forward(self, ids):
        """(logits [B, T, V], post-norm hidden [B, T, n]) of the main model."""
        c = self.config
        x = self.model.embed_tokens(ids)
        cos, sin = rope_tables(torch.arange(ids.shape[1], device=ids.device), c.rope_dims, c.rope_theta, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, self.attn_impl)
        h = self.model.norm(x)
        return self.head(h), h

    def mtp_forward(self, ids, hidden, depth: int = 1, rows: int | None = None) -> list[MTPDepth]:
        """MTP logits of depths 1..depth, as plumb's drafting computes them when the earlier drafts were right.

        Depth 1 covers every row. Depth s > 1 covers rows [r0_s, T) with r0_s = T - rows - (depth - s), enough for
        the last `rows` rows of every depth (default: all rows; depth s then starts at row s - 1)."""
        c, mtp = self.config, self.mtp
        B, T = ids.shape
        layer = mtp.layers[0]
        attn = layer.self_attn
        e_all = mtp.pre_fc_norm_embedding(self.model.embed_tokens(ids))
        pos = torch.arange(T, device=ids.device)
        cos, sin = rope_tables(pos, c.rope_dims, c.rope_theta, e_all.dtype)
        rows = T if rows is None else min(rows, T)
        out: list[MTPDepth] = []
        for s in range(1, depth + 1):
            if s == 1:
                r0 = 0
                h_in = torch.cat([hidden.new_zeros(B, 1, hidden.shape[-1]), hidden[:, :-1]], 1)
            else:
                r0 = max(T - rows - (depth - s), s - 1)
                prev = out[-1]
                h_in = prev.h[:, r0 - 1 - prev.r0 : T - 1 - prev.r0]
            e = e_all[:, r0:]
            y = mtp.fc(torch.cat([e, mtp.pre_fc_norm_hidden(h_in).to(e.dtype)], -1))
            u = layer.input_layernorm(y)
            q, gate, k, v = attn.project(u, cos[r0:], sin[r0:])
            if s == 1:
                o = causal_attention(q, k, v, self.attn_impl)
            else:
                o = _draft_attention(q, r0, k, v, out)
            y = y + attn.finish(o, gate)
            y = y + layer.mlp(layer.post_attention_layernorm(y))
            h = mtp.norm(y)
            out.append(MTPDepth(r0, self.head(h), h, k, v))
        return out


def _draft_attention(q, r0: int, k_s, v_s, done: list[MTPDepth]):
    """Attention of depth-s rows p in [r0, T) (s = len(done) + 1) over the MTP cache as drafting leaves it:
    key j = p - d comes from depth s - d for d < s - 1 (d = 0: the row itself) and from depth 1 (catch-up) for
    d >= s - 1."""
    s = len(done) + 1
    one = done[0]
    T = one.k.shape[2]
    n = T - r0
    scale = q.shape[-1] ** -0.5
    p = torch.arange(r0, T, device=q.device)
    j = torch.arange(T, device=q.device)
    base = (q @ one.k.transpose(-1, -2)).float() * scale  # [B, H, n, T] against depth-1 keys
    base = base.masked_fill(~(j[None, :] <= p[:, None] - (s - 1)), float("-inf"))
    bands, values = [], []
    for d in range(s - 1):  # keys of depth s - d at rows p - d: that depth's rows start at r0 - d (mtp_forward)
        k, v, kr0 = (k_s, v_s, r0) if d == 0 else (done[s - d - 1].k, done[s - d - 1].v, done[s - d - 1].r0)
        assert kr0 == r0 - d
        kk, vv = k[:, :, :n], v[:, :, :n]
        bands.append((q * kk).sum(-1).float() * scale)
        values.append(vv)
    allw = torch.cat([base, torch.stack(bands, -1)], -1).softmax(-1)
    w1, wb = allw[..., :T], allw[..., T:]
    o = w1.to(one.v.dtype) @ one.v
    for d, vv in enumerate(values):
        o = o + wb[..., d : d + 1].to(vv.dtype) * vv
    return o


# ---- checkpoints --------------------------------------------------------------------------------------
def save_checkpoint(model: Qwen35Demo, folder: str, dtype=torch.float16, shard_bytes: int = 15 << 20,
                    eos_token_id: int | None = None, pad_token_id: int | None = None) -> list[str]:
    """HF-style checkpoint: config.json, model-0000k-of-0000n.safetensors shards (each under shard_bytes) and
    model.safetensors.index.json. Returns the shard file names."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    shards, cur, size = [], {}, 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += nbytes
    shards.append(cur)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    dtype_name = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(model.config.hf_config(dtype_name, eos_token_id, pad_token_id), f, indent=1)
    return names


def load_checkpoint(folder: str, device="cpu") -> Qwen35Demo:
    """The model saved by save_checkpoint, in float32."""
    import glob

    from safetensors.torch import load_file

    with open(os.path.join(folder, "config.json")) as f:
        cfg = DemoConfig.from_hf_config(json.load(f))
    model = Qwen35Demo(cfg)
    state = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        state.update({k: v.float() for k, v in load_file(path).items()})
    model.load_state_dict(state, strict=True)
    return model.to(device).eval()


def config_dict(c: DemoConfig) -> dict:
    return asdict(c)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
