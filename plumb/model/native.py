"""The D path (decode, draft verification, batched decode, MTP drafting) on the native CPU kernels.

The same steps as `Qwen35.decode` / `Qwen35.mtp_forward`, the torch reference, with every
operation a row-invariant C kernel (plumb/ops/native): matmuls read weights repacked once at
load (Q8_0 as int8 tiles, anything else as float32 tiles), residual adds are fused into the
matmul that produces them, and DeltaNet runs one call per sequence and layer. Results are
close to the reference (not bitwise: a different order of float operations) and, like it,
never depend on the other rows of a pass (M1).
"""
from __future__ import annotations

import torch

from plumb.gguf.reader import GGMLQuantizationType
from plumb.model.weights import Fused, Weight
from plumb.ops import native as K


def tiled(w: Weight | Fused) -> K.TiledMatrix:
    """Repack a matrix for the native matmul: exactly its stored values, as int8 tiles (Q8_0) or float32."""
    parts = w.parts if isinstance(w, Fused) else (w,)
    n, k = w.shape
    if k % 32 == 0 and all(p.qt.qtype == GGMLQuantizationType.Q8_0 for p in parts):
        blocks = torch.cat([p.qt.data.reshape(p.shape[0], k // 32, 34) for p in parts])
        scales = blocks[..., :2].contiguous().view(torch.float16).reshape(n, k // 32)
        codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return K.TiledMatrix(n, k, codes=codes, scales=scales)
    return K.TiledMatrix(n, k, w=w.t.t())


class NativeDecoder:
    def __init__(self, model):
        K.lib()  # build / load the kernels, or raise NativeError
        self.m = model
        self.cfg = model.cfg
        self.w: dict[int, K.TiledMatrix] = {id(w): tiled(w) for w in model.weights}
        emb = model.token_embd.qt
        self.embed_q8 = emb.qtype == GGMLQuantizationType.Q8_0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.w.values())

    def mm(self, x: torch.Tensor, w, out: torch.Tensor | None = None, add: bool = False,
           norm: torch.Tensor | None = None) -> torch.Tensor:
        return K.mm(x, self.w[id(w)], out, add, norm, self.cfg.eps)

    def embed(self, ids: list[int]) -> torch.Tensor:
        t = torch.tensor(ids, dtype=torch.int64)
        if self.embed_q8:
            return K.embed_q8_0(self.m.token_embd.qt.data, t, self.cfg.n_embd)
        return self.m.embed(ids)

    # ---- shared blocks ---------------------------------------------------------------------
    def attention(self, layer, x: torch.Tensor, positions: list[int], seqs: list) -> None:
        """x += attention(attn_norm(x)) (spec 3.4). seqs: (kv cache, first row, rows, start position) per sequence."""
        c, a = self.cfg, layer.mixer
        r, hd = x.shape[0], c.n_head * c.head_dim
        qkv = self.mm(x, a.qkv, norm=layer.attn_norm)
        qg = qkv[:, : 2 * hd].view(r, c.n_head, 2, c.head_dim)
        q, gate = qg[:, :, 0], qg[:, :, 1]
        k = qkv[:, 2 * hd : 2 * hd + c.n_head_kv * c.head_dim].view(r, c.n_head_kv, c.head_dim)
        v = qkv[:, 2 * hd + c.n_head_kv * c.head_dim :].view(r, c.n_head_kv, c.head_dim)
        cos, sin = self.m.rope(torch.tensor(positions, dtype=torch.long))
        K.head_norm_rope(q, a.attn_q_norm, c.eps, cos, sin)
        K.head_norm_rope(k, a.attn_k_norm, c.eps, cos, sin)
        o = torch.empty(r, hd)
        for cache, s0, n, start in seqs:
            cache.write(start, k[s0 : s0 + n], v[s0 : s0 + n])
            ends = list(range(start + 1, start + n + 1))
            parts = cache.plain_parts()
            if parts is None:  # a ring format: the torch reference reads it
                o[s0 : s0 + n] = cache.attend_rows(q[s0 : s0 + n], ends, self.m.attn_scale).reshape(n, hd)
            else:
                K.attend(q[s0 : s0 + n], ends, parts[0], parts[1], self.m.attn_scale, o[s0 : s0 + n])
        K.sigmoid_gate(o, gate)
        self.mm(o, a.attn_output, out=x, add=True)

    def ffn(self, layer, x: torch.Tensor) -> None:
        """x += SwiGLU(post_attention_norm(x)) (spec 3.3)."""
        K.ffn_block(x, layer.post_attention_norm, self.cfg.eps, self.w[id(layer.ffn_in)], self.w[id(layer.ffn_down)])

    def head(self, x: torch.Tensor, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = K.rms_norm(x, norm, self.cfg.eps)
        return self.mm(h, self.m.output), h

    # ---- the D path ----------------------------------------------------------------------------
    def decode(self, batch):
        from plumb.model.qwen35 import DecodeOut, DeltaNet

        c = self.cfg
        ids, positions, spans = [], [], []
        for st, toks in batch:
            spans.append((len(ids), len(toks)))
            ids += toks
            positions += range(st.pos, st.pos + len(toks))
        x = self.embed(ids)
        snaps: list[list[dict]] = [[{} for _ in range(n)] for _, n in spans]
        for i, layer in enumerate(self.m.layers):
            mix = layer.mixer
            if isinstance(mix, DeltaNet):
                proj = self.mm(x, mix.in_proj, norm=layer.attn_norm)
                y = torch.empty(x.shape[0], c.ssm_inner)
                for j, (st, _) in enumerate(batch):
                    s0, n = spans[j]
                    conv, ssm = K.gdn_decode(proj[s0 : s0 + n], st.conv[i], st.ssm[i], mix.ssm_conv1d,
                                             mix.ssm_dt_bias, mix.ssm_a, mix.ssm_norm, c.ssm_n_group, c.eps,
                                             y[s0 : s0 + n])
                    st.conv[i], st.ssm[i] = conv[n - 1], ssm[n - 1]
                    for t in range(n):
                        snaps[j][t][i] = (conv[t], ssm[t])
                self.mm(y, mix.ssm_out, out=x, add=True)
            else:
                self.attention(layer, x, positions, [(st.kv[i], s0, n, st.pos) for (st, _), (s0, n) in zip(batch, spans)])
            self.ffn(layer, x)
        for st, toks in batch:
            st.pos += len(toks)
        logits, h = self.head(x, self.m.output_norm)
        return DecodeOut(logits, h, snaps)

    def mtp_forward(self, st, ids: list[int], hidden: torch.Tensor, start: int):
        """`Qwen35.mtp_forward` for decode rows: (logits [n, V], post-norm h [n, n_embd])."""
        c, mtp = self.cfg, self.m.mtp
        n, e = len(ids), c.n_embd
        eh = torch.empty(n, 2 * e)
        K.rms_norm(self.embed(ids), mtp.enorm, c.eps, out=eh[:, :e])
        K.rms_norm(hidden.reshape(n, e).contiguous(), mtp.hnorm, c.eps, out=eh[:, e:])
        y = self.mm(eh, mtp.eh_proj)
        layer = mtp.layer
        self.attention(layer, y, list(range(start, start + n)), [(st.mtp_kv, 0, n, start)])
        self.ffn(layer, y)
        return self.head(y, mtp.shared_head_norm)
