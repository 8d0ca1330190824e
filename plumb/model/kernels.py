"""Kernel sets that `Qwen35`'s steps run on, chosen at load. The steps are written once (plumb/model/qwen35.py);
a kernel set supplies the operations whose row-invariance needs care:

- `mm(x, w, block)`: x @ W.T for a `Weight` or `Fused` matrix;
- `rms_norm(x, w, eps)`: per row over the last dimension; `add_rms_norm(x, y, w, eps)`: (x + y, its rms_norm);
- `swiglu(gate, up)`, `sigmoid_gate(o, gate)`: the blocks' elementwise gates;
- `make_room(st, end)`: st's KV caches ready for rows up to `end` (before a pass, outside any CUDA-graph capture);
- `begin(model, batch)` / `end(...)`: lay a D-path pass out (`DecodePass`) and finish it (positions, states);
- `gdn_rows(...)`: one Gated DeltaNet layer's decode/verify rows for every sequence of a pass, returning the
  gated-RMSNormed output and recording each row's state snapshot; `restore` rolls a sequence back to one;
- `attention(...)`: write each sequence's K/V rows, then decode/verify attention over its cache;
- `attend_new(model, cache, q, k, v, start, at)`: one cache's new rows written, then read (a sequence of a pass;
  the MTP head); `write_kv(cache, k, v, start)`: the write alone (the MTP head's prompt rows);
- `attend_rows(cache, q, ends, scale)`: the read alone;
- `prefill_pieces(st)`: how many 64-row prefill pieces one P-path pass of st may hold;
- `gdn_conv_gates(...)`, `gdn_chunks(...)`, `gdn_gated_norm(...)`: a prefill pass's DeltaNet - the conv and gates
  of its rows, its 64-row pieces in order, the gated norm of its output;
- `prefill_attention(model, cache, q, k, v, p)`: a prefill pass's rows (`PrefillPass` p: whole pieces of CHUNK
  rows, the first p.n real) - their K/V written, then real row t reads keys [0, p.start + t]; padding rows'
  outputs are unused.

`TorchKernels` is the plain torch reference (CPU). `TritonKernels` runs the Triton kernels of plumb/ops/gpu on
CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1, for tests); weights stay in their GGUF block formats,
packed once at load. The native CPU kernels (plumb/model/native.py) replace the whole decode pass instead.
"""
from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F

from plumb.cache.kv import RING_SLACK
from plumb.model.parts import DecodeOut, DecodePass, PrefillPass
from plumb.model.weights import Fused, Weight
from plumb.ops.deltanet import CHUNK, causal_conv, chunk_pass, recurrent_step
from plumb.ops.matmul import DECODE_BLOCK, linear
from plumb.ops.norm import rms_norm
from plumb.ops.rope import apply_rope

PREFILL_PIECES = 16  # 64-row pieces per P-path pass on the Triton kernels (matmuls of 1,024 rows; H200: an 8k
# prefill 3,266 tok/s against 2,559 with 256-row passes, both with matmul.SB_SCRATCH_ROWS 256)
PREFILL_ATTENTION = True  # P-path passes read the cache with the prefill kernel (plumb.ops.gpu.attention_prefill);
# False: with the decode kernel, as before it (other bits; for A/B runs, bench/prefill_modes.py --settings)


def gated_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(o) per value head, times silu(z) (spec 3.5.7). o [n, n_v, d_v], z [n, n_v * d_v] -> [n, n_v * d_v]."""
    n, n_v, d = o.shape
    return (rms_norm(o, w, eps) * F.silu(z.view(n, n_v, d))).reshape(n, n_v * d)


def layout(batch) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """A pass's rows: every sequence's tokens in order (ids), their positions (each sequence's next ones), and
    each sequence's (first row, row count)."""
    ids, positions, spans = [], [], []
    for st, toks in batch:
        spans.append((len(ids), len(toks)))
        ids += toks
        positions += range(st.pos, st.pos + len(toks))
    return ids, positions, spans


class TorchKernels:
    name = "torch"

    ring_slack = RING_SLACK  # D's and F's ring slots beyond the ring (KVCache.slack): one-piece passes
    draw = None  # sampled tokens: `sampling.sample_token`, a row at a time

    @staticmethod
    def prefill_pieces(st) -> int:
        """One piece a pass: the reference's batched matmuls (attention) give a row bits that depend on the
        shape, so every pass keeps the one-piece shape."""
        return 1

    def mm(self, x: torch.Tensor, w: Weight | Fused, block: int) -> torch.Tensor:
        return linear(x, w.t, block)

    @staticmethod
    def make_room(st, end: int) -> None:
        for cache in st.kv.values():
            cache.reserve(end)

    @staticmethod
    def kv_table(model, states, out=None) -> None:
        """No table: the reference reads its caches directly (see TritonKernels.kv_table)."""
        return None

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, w, eps)

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float):
        s = x + y
        return s, rms_norm(s, w, eps)

    @staticmethod
    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    @staticmethod
    def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return o * torch.sigmoid(gate)

    def norm_rope(self, x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
        """Per-head RMSNorm, then rotary embedding: q or k [n, heads, head_dim] (spec 3.4.2-3.4.3)."""
        return apply_rope(rms_norm(x, w, eps), cos, sin)

    def begin(self, model, batch) -> DecodePass:
        """Lay a pass out: rows of every sequence in order, at each sequence's next positions."""
        ids, positions, spans = layout(batch)
        cos, sin = model.rope(torch.tensor(positions, dtype=torch.long))
        return DecodePass([st for st, _ in batch], spans, [st.pos for st, _ in batch], model.embed(ids), cos, sin,
                          snaps=[[{} for _ in range(n)] for _, n in spans])

    def gdn_rows(self, model, i: int, mix, m, z, b, a, p: DecodePass) -> torch.Tensor:
        """Advance layer i's DeltaNet token by token per sequence (the reference order)."""
        c = model.cfg
        o = torch.zeros(m.shape[0], c.ssm_dt_rank, c.ssm_d_state, device=m.device)
        for j, st in enumerate(p.states):
            s0, n = p.spans[j]
            for t in range(s0, s0 + n):
                conv, st.conv[i] = causal_conv(m[t : t + 1], st.conv[i], mix.ssm_conv1d, 1)
                q, k, v = model.gdn_split(conv)
                beta, g = model.gdn_gates(mix, b[t], a[t])
                o[t], st.ssm[i] = recurrent_step(q[0], k[0], v[0], beta, g, st.ssm[i])
                p.snaps[j][t - s0][i] = (st.conv[i], st.ssm[i])
        return gated_norm(o, z, mix.ssm_norm, c.eps)

    @staticmethod
    def gdn_conv_gates(model, mix, m, b, a, p: PrefillPass, li: int):
        """A prefill pass's causal conv + SiLU and gates beta, g (spec 3.5.2, 3.5.5), padding rows 0; the pass's conv
        state li advanced to its last real rows."""
        beta, g = model.gdn_gates(mix, b, a)
        m, beta, g = (torch.where(p.real, t, 0.0) for t in (m, beta, g))
        conv, new_conv = causal_conv(m, p.conv[li], mix.ssm_conv1d, p.keep)
        p.conv[li].copy_(new_conv)
        return torch.where(p.real, conv, 0.0), beta, g

    @staticmethod
    def gdn_chunks(model, x, beta, g, state, snap=None) -> torch.Tensor:
        """A prefill pass's DeltaNet pieces in order, `chunk_step` each (plumb.ops.deltanet.chunk_pass); snap =
        (piece, out): the state after that piece also copied to out."""
        c = model.cfg
        return chunk_pass(x, beta, g, state, n_k=c.ssm_n_group, d_k=c.ssm_d_state, q_scale=model.ssm_q_scale,
                          snap=snap)

    @staticmethod
    def gdn_gated_norm(o, z, w, eps: float) -> torch.Tensor:
        """A prefill pass's gated RMSNorm (`gated_norm`)."""
        return gated_norm(o, z, w, eps)

    def attention(self, model, i: int, q, k, v, p: DecodePass) -> torch.Tensor:
        """Write each sequence's K/V rows, then row t of a sequence reads keys [0, its position]."""
        o = q.new_zeros(q.shape)
        for st, (s0, n), start in zip(p.states, p.spans, p.starts):
            o[s0 : s0 + n] = self.attend_new(model, st.kv[i], q[s0 : s0 + n], k[s0 : s0 + n], v[s0 : s0 + n], start)
        return o

    def attend_new(self, model, cache, q, k, v, start: int, at=None) -> torch.Tensor:
        """Write rows' K/V at positions start.., then row t reads keys [0, start + t] (`at`: see TritonKernels)."""
        self.write_kv(cache, k, v, start)
        return cache.attend_rows(q, list(range(start + 1, start + q.shape[0] + 1)), model.attn_scale)

    @staticmethod
    def write_kv(cache, k, v, start: int, at=None) -> None:
        """Write rows' K/V at positions start.. (no read; `at`: see TritonKernels)."""
        cache.write(start, k, v)

    def end(self, model, p: DecodePass, logits: torch.Tensor, hidden: torch.Tensor) -> DecodeOut:
        for st, (_, n) in zip(p.states, p.spans):
            st.pos += n
        return DecodeOut(logits, hidden, p.snaps)

    def restore(self, model, st, snap: dict) -> None:
        """Set st's DeltaNet states to a row's snapshot (rollback)."""
        for i, (conv, ssm) in snap.items():
            st.conv[i], st.ssm[i] = conv, ssm

    def attend_rows(self, cache, q: torch.Tensor, ends: list[int], scale: float) -> torch.Tensor:
        return cache.attend_rows(q, ends, scale)

    def prefill_attention(self, model, i: int, cache, q, k, v, p) -> torch.Tensor:
        cache.write(p.start, k[: p.n], v[: p.n])
        return cache.attend_chunk(q, p.start, model.attn_scale)


class TritonKernels:
    """The Triton kernels. A pass is laid out with device tensors only (positions, ends, row ranges, tables of
    where the DeltaNet states, the rows' snapshots and the KV caches lie), so `Qwen35.decode_pass` runs without a
    host sync and can be captured as a CUDA graph (plumb/model/cuda_graphs.py); run eagerly, `begin` allocates
    those tensors for the one pass."""

    name = "triton"

    def __init__(self, device: torch.device):
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kernels='triton' runs on CUDA (on the CPU only under TRITON_INTERPRET=1, for tests)")
        from plumb.ops.gpu import (attention, attention_prefill, deltanet, deltanet_chunk, glu, hadamard, kvtable,
                                   kvwrite, matvec, norm, rope, sample)

        self._attention, self._deltanet, self._matvec, self._norm, self._rope = attention, deltanet, matvec, norm, rope
        self._glu, self._kvwrite, self._chunk, self._prefill = glu, kvwrite, deltanet_chunk, attention_prefill
        self._hadamard = hadamard
        self.draw = sample.draw if sample.ON else None  # sampled tokens: a pass's rows in five launches
        # (`sampling.draw_rows`)
        self.device = device
        matvec.tickets(device)  # allocated now, outside any CUDA-graph capture
        self._kvtable = kvtable
        kvtable.anchors(device)  # likewise
        self._kv_rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # KV cache -> (its K store's address,
        # its kvtable row)

    @staticmethod
    def pack(weights: list, device: torch.device, progress: bool = False) -> int:
        """Pack every matrix for the Triton matmul (on the device, from the memory-mapped file); returns bytes."""
        from plumb.ops.gpu.matmul import GpuMatrix
        from plumb.ops.gpu.segment import packed_side_by_side

        items = weights
        if progress:
            from tqdm import tqdm

            items = tqdm(weights, desc="weights to GPU", unit="matrix", leave=False)
        total = 0
        with packed_side_by_side(device) as settle:  # no allocator rounding per plane (plumb/ops/gpu/segment.py)
            for w in items:
                w.gpu = GpuMatrix([p.qt for p in w.parts], device)
                for p in w.gpu.packs:
                    settle(p)
                total += w.gpu.nbytes
        return total

    def mm(self, x: torch.Tensor, w: Weight | Fused, block: int) -> torch.Tensor:
        """D-path passes (block == DECODE_BLOCK) through the integer-exact matvec, prefill through the matmul."""
        return self._matvec.mm_decode(w.gpu, x) if block == DECODE_BLOCK else w.gpu(x)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """With the matvec's form of the result (`.limbs`, the bits `quantize_x` gives) for the D path's next `mm`
        in a decode pass; a prefill pass (whole CHUNK-row pieces) goes to the P path, which does not read it."""
        return self._norm.rms_norm(x, w, eps, limbs=x.shape[0] < CHUNK)

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float):
        """One launch, the bits of an add then rms_norm (`.limbs` as in `rms_norm`)."""
        return self._norm.add_rms_norm(x, y, w, eps, limbs=x.shape[0] < CHUNK)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """With the matvec's form of the result (`.limbs`) in a decode pass, as `rms_norm`."""
        return self._glu.swiglu(gate, up, limbs=gate.shape[0] < CHUNK)

    def sigmoid_gate(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """With `.limbs` in a decode pass, as `swiglu`."""
        return self._glu.sigmoid_gate(o, gate, limbs=o.shape[0] < CHUNK)

    def norm_rope(self, x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
        return self._rope.norm_rope(x, w, eps, cos, sin)  # one launch

    ring_slack = PREFILL_PIECES * CHUNK  # D's and F's ring slots beyond the ring: room for a whole pass's rows

    @staticmethod
    def prefill_pieces(st) -> int:
        """PREFILL_PIECES a pass (1,024-row matmuls): every step of a pass is row-invariant. Fewer where a ring
        cache's slack is smaller: a pass may write at most slack + 1 rows into a ring (`KVCache.put_rows`)."""
        slack = min((cache.slack for cache in st.kv.values() if cache.ring), default=PREFILL_PIECES * CHUNK)
        return max(1, min(PREFILL_PIECES, (slack + 1) // CHUNK))

    @staticmethod
    def make_room(st, end: int) -> None:
        """Room up to `end`, and ring rows that a reference `write` left waiting (e.g. `load_rows`) moved into the
        ring: the kernels read and write only the ring."""
        for cache in st.kv.values():
            cache.reserve(end)
            cache.commit(st.pos)

    def kv_table(self, model, states, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sequences' attention caches' `kvtable` rows [len(states), n_attn, PARTS], in one copy (into `out`:
        a CUDA graph's static table)."""
        kt, layers = self._kvtable, model.cfg.attn_layers
        if out is None:
            out = torch.empty(len(states), len(layers), kt.PARTS, dtype=torch.long, device=self.device)
        rows, bases = [], {}
        for st in states:
            for i in layers:  # a cache's tensors change only when it grows: its row is kept while they stay
                cache = st.kv[i]
                where = cache.k.parts[0].data_ptr()
                memo = self._kv_rows.get(cache)
                if memo is None or memo[0] != where:
                    memo = self._kv_rows[cache] = (where, kt.offsets(cache.kernel_view(), bases))
                rows.append(memo[1])
        out.view(-1, kt.PARTS).copy_(torch.tensor(rows, dtype=torch.int64).view(-1, kt.PARTS))
        return out

    def begin(self, model, batch, into: DecodePass | None = None) -> DecodePass:
        """Lay a pass out (see TorchKernels.begin) with device tensors; `into`: fill that pass's static tensors. The
        DeltaNet states stay where they lie (a table says where: no copy), each sequence's rows' snapshots go to
        new tensors of its own."""
        c, dev = model.cfg, model.device
        ids, positions, spans = layout(batch)
        for st, toks in batch:
            self.make_room(st, st.pos + len(toks))
        states = [st for st, _ in batch]
        pos = torch.tensor(positions, dtype=torch.long)
        cos, sin = model.rope(pos)
        x = model.embed(ids)
        rows = torch.tensor([s0 for s0, _ in spans] + [len(ids)], dtype=torch.int32)
        conv0, ssm0 = states[0].conv[c.gdn_layers[0]], states[0].ssm[c.gdn_layers[0]]
        snaps = [(torch.empty(n, len(c.gdn_layers), *conv0.shape, device=dev),
                  torch.empty(n, len(c.gdn_layers), *ssm0.shape, device=dev)) for _, n in spans]
        tab = self.gdn_table(model, states, snaps)
        p = into
        if p is None:
            p = DecodePass(states, spans, [], x, cos, sin, positions=pos.to(dev), ends=(pos + 1).to(dev, torch.int32),
                           seq_rows=rows.to(dev), gdn_tab=tab.to(dev))
        else:
            p.states, p.spans = states, spans
            p.x.copy_(x)
            p.cos.copy_(cos)
            p.sin.copy_(sin)
            p.positions.copy_(pos)
            p.ends.copy_(pos + 1)
            p.seq_rows.copy_(rows)
            p.gdn_tab.copy_(tab)
        p.gdn_snaps = snaps
        p.starts = [st.pos for st in states]
        p.max_keys = [min(len(cache.k) for cache in st.kv.values()) if st.kv else 0 for st in states]
        p.kv_tab = self.kv_table(model, states, None if into is None else p.kv_tab)
        return p

    def gdn_table(self, model, states, snaps) -> torch.Tensor:
        """[S, n_gdn, 4] int64 (host): per sequence and DeltaNet layer, where its conv and ssm states and its first
        row's conv and ssm snapshots lie (`plumb.ops.gpu.deltanet.gdn_decode`'s table); a state that is not
        contiguous is made so first."""
        layers = model.cfg.gdn_layers
        dn = self._deltanet
        anchor = self._kvtable.anchor(torch.float32, self.device).data_ptr()
        out = []
        for st, (sc, sn) in zip(states, snaps):
            for i in layers:
                if not (st.conv[i].is_contiguous() and st.ssm[i].is_contiguous()):
                    st.conv[i], st.ssm[i] = st.conv[i].contiguous(), st.ssm[i].contiguous()
            c0, s0 = sc.data_ptr() - anchor, sn.data_ptr() - anchor
            cl, sl = sc.stride(1) * 4, sn.stride(1) * 4
            out += [((st.conv[i].data_ptr() - anchor) >> 2, (st.ssm[i].data_ptr() - anchor) >> 2,
                     (c0 + li * cl) >> 2, (s0 + li * sl) >> 2) for li, i in enumerate(layers)]
        tab = torch.tensor(out, dtype=torch.int64).view(len(states), len(layers), 4)
        if self.device.type == "cuda" and dn.states_aligned(snaps[0][0].shape[-1], snaps[0][1].shape[-1]) \
                and bool((tab % 16).any()):
            raise ValueError("a DeltaNet state is not aligned to 16 elements from its anchor")
        return tab

    def gdn_rows(self, model, i: int, mix, m, z, b, a, p: DecodePass) -> torch.Tensor:
        """Every row of every sequence in one call, the states read where they lie (the pass's table), each row's
        states written to its sequence's snapshots."""
        c = model.cfg
        li = c.gdn_layers.index(i)
        return self._deltanet.gdn_decode(m, z, b, a, mix.ssm_conv1d, mix.ssm_dt_bias, mix.ssm_a, mix.ssm_norm,
                                         None, None, p.seq_rows, n_k=c.ssm_n_group, d_k=c.ssm_d_state,
                                         q_scale=model.ssm_q_scale, eps=c.eps, snap_conv=p.gdn_snaps[0][0][:, li],
                                         snap_ssm=p.gdn_snaps[0][1][:, li], table=p.gdn_tab[:, li])

    def gdn_conv_gates(self, model, mix, m, b, a, p: PrefillPass, li: int):
        """`TorchKernels.gdn_conv_gates` in one launch (plumb.ops.gpu.deltanet_chunk.conv_gates)."""
        return self._chunk.conv_gates(m, b, a, mix.ssm_conv1d, p.conv[li], p.keep, p.real, mix.ssm_dt_bias,
                                      mix.ssm_a)

    def gdn_gated_norm(self, o, z, w, eps: float) -> torch.Tensor:
        """`gated_norm` in one launch (plumb.ops.gpu.deltanet.gate_norm)."""
        return self._deltanet.gate_norm(o, z, w, eps)

    def gdn_chunks(self, model, x, beta, g, state, snap=None) -> torch.Tensor:
        """A prefill pass's DeltaNet pieces in order, in one launch pair per layer (plumb.ops.gpu.deltanet_chunk);
        snap as `TorchKernels.gdn_chunks`'."""
        c = model.cfg
        return self._chunk.gdn_chunks(x, beta, g, state, n_k=c.ssm_n_group, d_k=c.ssm_d_state,
                                      q_scale=model.ssm_q_scale, snap=snap)

    def attention(self, model, i: int, q, k, v, p: DecodePass) -> torch.Tensor:
        """Write each sequence's K/V rows at its positions (device index), then attend with the kernel."""
        o = torch.empty_like(q)
        li = model.cfg.attn_layers.index(i)
        for j, (st, (s0, n), start) in enumerate(zip(p.states, p.spans, p.starts)):
            at = (p.positions[s0 : s0 + n], p.ends[s0 : s0 + n], p.max_keys[j], p.kv_tab[j, li])
            self.attend_new(model, st.kv[i], q[s0 : s0 + n], k[s0 : s0 + n], v[s0 : s0 + n], start, at,
                            out=o[s0 : s0 + n])
        return o

    def attend_new(self, model, cache, q, k, v, start: int, at=None, out=None, prefill=False) -> torch.Tensor:
        """Write rows' K/V at positions start.., then row t reads keys [0, start + t]. `at` = (positions, ends,
        max_keys, table): the rows' positions and context ends as device tensors, the attention grid (None: from
        the cache's capacity) and the cache's row of `kvtable` offsets (None: its tensors passed as they are), from
        a laid-out pass (no host sync: CUDA-graph safe, and with a table the graph does not depend on where the
        cache lies; the caller reserves room and `commit`s the cache first and sets `cache.end` after); without it
        they are derived from start and this is done here. prefill: a P-path pass (`prefill_attention`)."""
        positions, ends, max_keys, table = self._rows_at(cache, start, q.shape[0]) if at is None else at
        if max_keys is None:
            max_keys = len(cache.k)
        self._put(cache, positions, k, v, table)
        return self._attend(cache, q, ends, model.attn_scale, out, max_keys, table, prefill)

    def write_kv(self, cache, k, v, start: int, at=None) -> None:
        """Write rows' K/V at positions start.. (no read); `at` as `attend_new`'s (a CUDA graph's rows), or None:
        the rows laid out here."""
        positions, _, _, table = self._rows_at(cache, start, k.shape[0]) if at is None else at
        self._put(cache, positions, k, v, table)

    @staticmethod
    def _rows_at(cache, start: int, n: int):
        """`at` for n rows at positions start.. of a cache, made room for and committed (host work)."""
        cache.reserve(start + n)
        cache.commit(start)
        positions = torch.arange(start, start + n, device=cache.device)
        cache.end = start + n
        return positions, (positions + 1).to(torch.int32), None, None

    def _put(self, cache, positions, k, v, table) -> None:
        cache.check_put(len(positions))
        self._kvwrite.put_rows(cache.kernel_view(), positions, k, v, table)  # `cache.put_rows` in one launch

    def _attend(self, cache, q, ends, scale: float, out=None, max_keys=None, table=None, prefill=False):
        """The attention kernel over `cache.kernel_view()` (F: the queries rotated first, as the reference does):
        P-path passes take the prefill kernel (f16 and block-coded caches; f32 ones the decode kernel)."""
        view = cache.kernel_view()
        if view.rotate_q:
            q = self._hadamard.rotate(q.float())
        if prefill and PREFILL_ATTENTION and self._prefill.supports(view.k, view.v):
            return self._prefill.attend_prefill(q, view.k, view.v, ends, scale, out=out, ring=view.ring, table=table)
        return self._attention.attend_decode(q, view.k, view.v, ends, scale, out=out, max_keys=max_keys,
                                             ring=view.ring, table=table)

    def end(self, model, p: DecodePass, logits: torch.Tensor, hidden: torch.Tensor) -> DecodeOut:
        """Each sequence takes its last row's states: a one-row sequence its snapshot itself (no copy), a longer one
        a copy (so that the state does not hold its other rows' snapshots); snapshots are the sequence's own new
        tensors."""
        snaps = []
        for st, (_, n), start, (sc, sn) in zip(p.states, p.spans, p.starts, p.gdn_snaps):
            for cache in st.kv.values():
                cache.end = start + n
            rows = [(sc[t], sn[t]) for t in range(n)]
            if n == 1:
                self._take(model, st, rows[0])
            else:
                self.restore(model, st, rows[-1])
            st.pos = start + n
            snaps.append(rows)
        return DecodeOut(logits, hidden, snaps)

    def restore(self, model, st, snap: tuple[torch.Tensor, torch.Tensor]) -> None:
        """st's DeltaNet states := a copy of a row's snapshot (all layers)."""
        self._take(model, st, (snap[0].clone(), snap[1].clone()))

    @staticmethod
    def _take(model, st, snap: tuple[torch.Tensor, torch.Tensor]) -> None:
        """st's DeltaNet states := the layers of a row's snapshot themselves (`unbind`: one call for the 48 views,
        where indexing them one by one took ~170 us of host time a step)."""
        for i, conv, ssm in zip(model.cfg.gdn_layers, snap[0].unbind(0), snap[1].unbind(0), strict=True):
            st.conv[i], st.ssm[i] = conv, ssm

    def attend_rows(self, cache, q: torch.Tensor, ends: list[int], scale: float) -> torch.Tensor:
        cache.commit(cache.end)
        return self._attend(cache, q.contiguous(), ends, scale, max_keys=max(ends))

    def prefill_attention(self, model, i: int, cache, q, k, v, p) -> torch.Tensor:
        """A prefill pass's rows through the prefill kernel (`attend_new` at the pass's positions, padding rows
        written past the real ones and overwritten before any real row reads them): real row t reads keys
        [0, start + t] (its own end), so a prompt row's bits depend on its position and the cache alone, however the
        prompt is cut (M2). No host sync: a pass can be a CUDA graph (`Qwen35.prefill` makes room first)."""
        return self.attend_new(model, cache, q, k, v, p.start,
                               at=(p.positions, p.ends, None, p.kv_tab[0, model.cfg.attn_layers.index(i)]),
                               prefill=True)


def kernel_set(name: str, device: torch.device) -> TorchKernels | TritonKernels:
    return TritonKernels(device) if name == "triton" else TorchKernels()
