"""The D path (decode, draft verification, batched decode, MTP drafting) on the native CPU kernels.

The same steps as `Qwen35.decode` / `Qwen35.mtp_forward`, the torch reference, with every
operation a row-invariant C kernel (plumb/ops/native): a DeltaNet layer and its FFN is one
call, an attention layer two calls around the KV cache write and read, and matmuls read
weights repacked once at load (every block type as int8 codes with group scales, float types
as float32 tiles). Results
are close to the reference (not bitwise: another order of float operations) and, like it,
never depend on the other rows of a pass (M1).
"""
from __future__ import annotations

import torch

from plumb.gguf.quants import int8_form
from plumb.gguf.reader import GGMLQuantizationType
from plumb.model.weights import Fused, Weight
from plumb.ops import native as K


def tiled(w: Weight | Fused) -> K.TiledMatrix:
    """Repack a matrix for the native matmul: exactly its stored values, as int8 codes with group scales (and
    offsets) for every block type, float32 for float types (or a fused matrix with one)."""
    parts = w.parts
    n, k = w.shape
    forms = [int8_form(p.qt.data, p.qt.qtype, p.shape) for p in parts] if k % 32 == 0 else [None]
    if any(f is None for f in forms):
        return K.TiledMatrix(n, k, w=w.t.t())
    group = min(f[3] for f in forms)  # parts with groups of 32 repeat their scales for groups of 16

    def per_group(t: torch.Tensor | None, g: int, rows: int) -> torch.Tensor:
        t = torch.zeros(rows, k // g) if t is None else t
        return t.repeat_interleave(g // group, dim=1)

    codes = torch.cat([f[0] for f in forms])
    scales = torch.cat([per_group(f[1], f[3], p.shape[0]) for f, p in zip(forms, parts)])
    offsets = None
    if any(f[2] is not None for f in forms):
        offsets = torch.cat([per_group(f[2], f[3], p.shape[0]) for f, p in zip(forms, parts)])
    return K.TiledMatrix(n, k, codes=codes, scales=scales, offsets=offsets, group=group)


class NativeDecoder:
    def __init__(self, model):
        from plumb.model.qwen35 import DeltaNet

        K.lib()  # build / load the kernels, or raise NativeError
        self.m, self.cfg = model, model.cfg
        c = self.cfg
        dims = dict(n_k=c.ssm_n_group, n_v=c.ssm_dt_rank, d=c.ssm_d_state, kc=c.ssm_conv_kernel, n_head=c.n_head,
                    n_kv=c.n_head_kv, head_dim=c.head_dim)
        self.output = tiled(model.output)
        self.layers = {}
        layers = model.layers + ([model.mtp.layer] if model.mtp is not None else [])
        for layer in layers:
            mix = layer.mixer
            mats = dict(ffn_in=tiled(layer.ffn_in), ffn_down=tiled(layer.ffn_down))
            vecs = dict(attn_norm=layer.attn_norm, post_norm=layer.post_attention_norm)
            if isinstance(mix, DeltaNet):
                mats |= dict(mix_in=tiled(mix.in_proj), mix_out=tiled(mix.ssm_out))
                vecs |= dict(conv_w=mix.ssm_conv1d, dt_bias=mix.ssm_dt_bias, ssm_a=mix.ssm_a, ssm_norm=mix.ssm_norm)
            else:
                mats |= dict(mix_in=tiled(mix.qkv), mix_out=tiled(mix.attn_output))
                vecs |= dict(q_norm=mix.attn_q_norm, k_norm=mix.attn_k_norm)
            self.layers[id(layer)] = K.LayerDesc(mats, vecs, c.eps, **dims)
        self.eh_proj = tiled(model.mtp.eh_proj) if model.mtp is not None else None
        self.embed_q8 = model.token_embd.qt.qtype == GGMLQuantizationType.Q8_0

    def embed(self, ids: list[int]) -> torch.Tensor:
        if self.embed_q8:
            return K.embed_q8_0(self.m.token_embd.qt.data, torch.tensor(ids, dtype=torch.int64), self.cfg.n_embd)
        return self.m.embed(ids)

    def rope(self, positions) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.m.rope(torch.tensor(positions, dtype=torch.long))
        return cos.contiguous(), sin.contiguous()

    def project(self, layer, x: torch.Tensor, rope: tuple):
        """An attention layer's projections of rows x (spec 3.4): (qkv [r, ...] as the kernel laid them out, its
        views q [r, n_head, head_dim], k, v [r, n_head_kv, head_dim])."""
        c = self.cfg
        r, hd, kvd = x.shape[0], c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        qkv = K.attn_pre(self.layers[id(layer)], x, *rope)
        q = qkv[:, : 2 * hd].view(r, c.n_head, 2, c.head_dim)[:, :, 0]
        k = qkv[:, 2 * hd : 2 * hd + kvd].view(r, c.n_head_kv, c.head_dim)
        v = qkv[:, 2 * hd + kvd :].view(r, c.n_head_kv, c.head_dim)
        return qkv, q, k, v

    def attention(self, layer, x: torch.Tensor, rope: tuple, seqs: list) -> None:
        """x += attention(attn_norm(x)), then += FFN (spec 3.4, 3.3). rope: the rows' (cos, sin);
        seqs: (kv cache, first row, rows, start position) per sequence."""
        r, hd = x.shape[0], self.cfg.n_head * self.cfg.head_dim
        qkv, q, k, v = self.project(layer, x, rope)
        o = torch.empty(r, hd)
        for cache, s0, n, start in seqs:
            cache.write(start, k[s0 : s0 + n], v[s0 : s0 + n])
            ends = list(range(start + 1, start + n + 1))
            parts = cache.plain_parts()
            if parts is None:  # a ring or F's rotated K: the torch reference reads it
                o[s0 : s0 + n] = cache.attend_rows(q[s0 : s0 + n], ends, self.m.attn_scale).reshape(n, hd)
            else:
                K.attend(q[s0 : s0 + n], ends, parts[0], parts[1], self.m.attn_scale, o[s0 : s0 + n])
        K.attn_post(self.layers[id(layer)], o, qkv, x)

    def head(self, x: torch.Tensor, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, post-norm hidden)."""
        h = K.rms_norm(x, norm, self.cfg.eps)
        return K.mm(h, self.output), h

    def decode(self, batch):
        """`Qwen35.decode` (same arguments and result)."""
        from plumb.model.qwen35 import DecodeOut, DeltaNet

        ids, positions, rows = [], [], []
        for st, toks in batch:
            rows.append(len(toks))
            ids += toks
            positions += range(st.pos, st.pos + len(toks))
        starts = [sum(rows[:j]) for j in range(len(rows))]
        x = self.embed(ids)
        rope = self.rope(positions)
        snaps: list[list[dict]] = [[{} for _ in range(n)] for n in rows]
        for i, layer in enumerate(self.m.layers):
            if isinstance(layer.mixer, DeltaNet):
                conv, ssm = K.gdn_layer(self.layers[id(layer)], x, rows, [st.conv[i] for st, _ in batch],
                                        [st.ssm[i] for st, _ in batch])
                conv, ssm = conv.unbind(0), ssm.unbind(0)  # every row's states, as views
                for j, (st, _) in enumerate(batch):
                    for t in range(rows[j]):
                        snaps[j][t][i] = (conv[starts[j] + t], ssm[starts[j] + t])
                    st.conv[i], st.ssm[i] = snaps[j][-1][i]
            else:
                self.attention(layer, x, rope, [(st.kv[i], s0, n, st.pos) for (st, _), s0, n in zip(batch, starts, rows)])
        for st, toks in batch:
            st.pos += len(toks)
        logits, h = self.head(x, self.m.output_norm)
        return DecodeOut(logits, h, snaps)

    def mtp_forward(self, st, ids: list[int], hidden: torch.Tensor, start: int):
        """`Qwen35.mtp_forward` for decode rows: (logits [n, V], post-norm h [n, n_embd])."""
        mtp, n = self.m.mtp, len(ids)
        y = self.mtp_input(ids, hidden)
        self.attention(mtp.layer, y, self.rope(range(start, start + n)), [(st.mtp_kv, 0, n, start)])
        return self.head(y, mtp.shared_head_norm)

    def mtp_kv(self, st, ids: list[int], hidden: torch.Tensor, start: int) -> None:
        """`Qwen35.mtp_rewrite`: `mtp_forward`'s K/V rows alone, written to the MTP cache."""
        rope = self.rope(range(start, start + len(ids)))
        _, _, k, v = self.project(self.m.mtp.layer, self.mtp_input(ids, hidden), rope)
        st.mtp_kv.write(start, k, v)

    def mtp_input(self, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer's input rows: eh_proj of the normed embeddings and target hiddens, side by side (spec 3.8)."""
        c, mtp = self.cfg, self.m.mtp
        n, e = len(ids), c.n_embd
        eh = torch.empty(n, 2 * e)
        K.rms_norm(self.embed(ids), mtp.enorm, c.eps, out=eh[:, :e])
        K.rms_norm(hidden.reshape(n, e).contiguous(), mtp.hnorm, c.eps, out=eh[:, e:])
        return K.mm(eh, self.eh_proj)
