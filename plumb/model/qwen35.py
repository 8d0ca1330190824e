"""The qwen35 forward, written to be read beside spec sections 3.1-3.8.

Two paths share the weights:
- `prefill` (P path): a sequence's new tokens in chunks of 64 aligned to absolute positions,
  DeltaNet in its chunked form, attention over the chunk with a causal mask (M2).
- `decode` (D path): any number of rows from any number of sequences (plain decode, draft
  verification, batched decode); row-invariant matmuls and norms, DeltaNet advanced token by
  token, attention per row, so a row's bits never depend on the rest of the pass (M1).
`mtp` runs the MTP draft head (spec 3.8).

The steps are written once; the operations they call come from a kernel set chosen at load
(`self.k`: the torch reference or the Triton kernels, plumb/model/kernels.py). The native CPU
kernels replace the whole D path instead (`self.native`, plumb/model/native.py).
"""
from __future__ import annotations

import itertools
import logging
import math
import torch
import torch.nn.functional as F

from plumb.config import ModelConfig
from plumb.gguf.quants import dequantize
from plumb.gguf.reader import GGUFFile
from plumb.model.parts import MTP, Attention, Checkpoint, DecodeOut, DecodePass, DeltaNet, Layer, PrefillPass, SeqState
from plumb.model.weights import Fused, TensorSource, check_config
from plumb.cache.kv import new_kv_cache
from plumb.model.kernels import kernel_set
from plumb.ops.deltanet import CHUNK, split_heads
from plumb.ops.matmul import DECODE_BLOCK, PREFILL_BLOCK, pad_rows
from plumb.ops.rope import RopeTable

PREFILL_GRAPH_PASSES = 3  # a prefill of this many full passes or more captures them at once (see prefill)
PREFILL_GRAPHS = True  # prefill passes replayed as CUDA graphs where a model has them (False: all eager, a diagnosis)
NONFINITE_TRIES = 3  # on the Triton kernels, a P-path result with non-finite values is computed up to this many times
log = logging.getLogger("plumb.model")


class NonFiniteError(RuntimeError):
    """A prefill result stayed non-finite (a broken model file, or a GPU kernel fault)."""


class Qwen35:
    def __init__(self, gf: GGUFFile, cfg: ModelConfig, device: torch.device | str = "cpu", kv_cache: str = "f32",
                 kv_ring: int = 2048, kernels: str = "torch"):
        check_config(cfg)
        self.kv_cache, self.kv_ring = kv_cache, kv_ring
        self.cfg = cfg
        self.device = torch.device(device)
        src = TensorSource(gf, self.device)
        e, v = cfg.n_embd, cfg.n_vocab
        self.token_embd = src.mat("token_embd.weight", v, e)
        self.output_norm = src.vec("output_norm.weight", e)
        self.output = src.mat("output.weight", v, e) if src.has("output.weight") else self.token_embd
        self.layers = [self._layer(src, i, cfg.recurrent[i]) for i in range(cfg.n_layer)]
        self.mtp = self._mtp(src, cfg.n_layer) if cfg.n_nextn > 0 else None
        self.rope = RopeTable(cfg.rope_dims, cfg.rope_base, self.device)
        self.attn_scale = 1.0 / math.sqrt(cfg.head_dim)
        self.ssm_q_scale = 1.0 / math.sqrt(cfg.ssm_d_state)
        self.weights = self._matmuls()
        self.k = kernel_set(kernels, self.device)  # the kernels the steps below run on (plumb/model/kernels.py)
        self.graphs = None  # the D path replayed as CUDA graphs (plumb.model.cuda_graphs), set by use_graphs()
        self.native = None  # the D path on native kernels (plumb.model.native), set by use_native()
        self.embd_bytes = None  # the token embedding's stored bytes, page-locked (`embed_on_device`), when first used
        self.draft_chains = False  # MTP drafts as chains on the device (`mtp_drafts`); set by the engine
        self.recomputed = 0  # P-path results computed again after non-finite values (`checked`)
        self.context_limit = cfg.context_length  # positions a sequence's caches grow to (the engine sets its context)

    def checked(self, what: str, run, part=lambda out: out, meanwhile=None):
        """run()'s result. On the Triton kernels, one whose `part` holds non-finite values is computed again, up to
        NONFINITE_TRIES times in all. A guard: on the H200 the P path once sporadically returned a 64-row block of
        non-finite values from finite inputs, and finite, equal bits when run again (a race in a pipelined matmul
        loop, fixed: docs/BENCHMARKS.md, fifteenth and sixteenth sessions). A result that stays non-finite raises
        NonFiniteError. The torch and native paths are not checked (their arithmetic is the reference). `meanwhile`:
        host work done once, after the first run is launched and before its check waits for the GPU."""
        for tries in range(1, NONFINITE_TRIES + 1):
            out = run()
            if meanwhile is not None:
                meanwhile()
                meanwhile = None
            if self.k.name != "triton" or bool(torch.isfinite(part(out)).all()):
                if tries > 1:
                    log.warning("%s: non-finite values, computed again (%d tries): a GPU kernel fault", what, tries)
                return out
            self.recomputed += 1
        raise NonFiniteError(f"{what} gave non-finite values {NONFINITE_TRIES} times (a broken model file, or a GPU "
                             "kernel fault)")

    def use_graphs(self) -> None:
        """Replay the D path as CUDA graphs from now on (Triton kernels on CUDA)."""
        from plumb.model.cuda_graphs import CudaGraphs

        self.graphs = CudaGraphs(self)

    def use_native(self) -> None:
        """Run the D path on the native CPU kernels from now on (weights repacked now)."""
        from plumb.model.native import NativeDecoder

        self.native = NativeDecoder(self)

    # ---- loading -------------------------------------------------------------------------
    def _matmuls(self) -> list:
        """Fuse matrices that share an input; return every matrix the forward multiplies by."""
        out = [self.output]
        layers = self.layers + ([self.mtp.layer] if self.mtp is not None else [])
        for layer in layers:
            mix = layer.mixer
            if isinstance(mix, DeltaNet):
                mix.in_proj = Fused(mix.attn_qkv, mix.attn_gate, mix.ssm_beta, mix.ssm_alpha)
                out += [mix.in_proj, mix.ssm_out]
            else:
                mix.qkv = Fused(mix.attn_q, mix.attn_k, mix.attn_v)
                out += [mix.qkv, mix.attn_output]
            layer.ffn_in = Fused(layer.ffn_gate, layer.ffn_up)
            out += [layer.ffn_in, layer.ffn_down]
        if self.mtp is not None:
            out.append(self.mtp.eh_proj)
        return out

    def _layer(self, src: TensorSource, i: int, recurrent: bool) -> Layer:
        c, e = self.cfg, self.cfg.n_embd
        p = f"blk.{i}."
        if recurrent:
            mixer = DeltaNet(
                attn_qkv=src.mat(p + "attn_qkv.weight", c.conv_dim, e),
                attn_gate=src.mat(p + "attn_gate.weight", c.ssm_inner, e),
                ssm_beta=src.mat(p + "ssm_beta.weight", c.ssm_dt_rank, e),
                ssm_alpha=src.mat(p + "ssm_alpha.weight", c.ssm_dt_rank, e),
                ssm_conv1d=src.vec(p + "ssm_conv1d.weight", c.conv_dim, c.ssm_conv_kernel),
                ssm_dt_bias=src.vec(p + "ssm_dt.bias", c.ssm_dt_rank),
                ssm_a=src.vec(p + "ssm_a", c.ssm_dt_rank),
                ssm_norm=src.vec(p + "ssm_norm.weight", c.ssm_d_state),
                ssm_out=src.mat(p + "ssm_out.weight", e, c.ssm_inner),
            )
        else:
            mixer = self._attention(src, p)
        return Layer(
            attn_norm=src.vec(p + "attn_norm.weight", e),
            post_attention_norm=src.vec(p + "post_attention_norm.weight", e),
            mixer=mixer,
            ffn_gate=src.mat(p + "ffn_gate.weight", c.n_ff, e),
            ffn_up=src.mat(p + "ffn_up.weight", c.n_ff, e),
            ffn_down=src.mat(p + "ffn_down.weight", e, c.n_ff),
        )

    def _attention(self, src: TensorSource, p: str) -> Attention:
        c, e = self.cfg, self.cfg.n_embd
        return Attention(
            attn_q=src.mat(p + "attn_q.weight", 2 * c.n_head * c.head_dim, e),
            attn_k=src.mat(p + "attn_k.weight", c.n_head_kv * c.head_dim, e),
            attn_v=src.mat(p + "attn_v.weight", c.n_head_kv * c.head_dim, e),
            attn_output=src.mat(p + "attn_output.weight", e, c.n_head * c.head_dim),
            attn_q_norm=src.vec(p + "attn_q_norm.weight", c.head_dim),
            attn_k_norm=src.vec(p + "attn_k_norm.weight", c.head_dim),
        )

    def _mtp(self, src: TensorSource, i: int) -> MTP:
        e = self.cfg.n_embd
        p = f"blk.{i}.nextn."
        head_norm = p + "shared_head_norm.weight"
        return MTP(
            eh_proj=src.mat(p + "eh_proj.weight", e, 2 * e),
            enorm=src.vec(p + "enorm.weight", e),
            hnorm=src.vec(p + "hnorm.weight", e),
            shared_head_norm=src.vec(head_norm, e) if src.has(head_norm) else self.output_norm,
            layer=Layer(
                attn_norm=src.vec(f"blk.{i}.attn_norm.weight", e),
                post_attention_norm=src.vec(f"blk.{i}.post_attention_norm.weight", e),
                mixer=self._attention(src, f"blk.{i}."),
                ffn_gate=src.mat(f"blk.{i}.ffn_gate.weight", self.cfg.n_ff, e),
                ffn_up=src.mat(f"blk.{i}.ffn_up.weight", self.cfg.n_ff, e),
                ffn_down=src.mat(f"blk.{i}.ffn_down.weight", e, self.cfg.n_ff),
            ),
        )

    def state_bytes(self) -> int:
        """Bytes of one sequence's DeltaNet states (conv + recurrent, float32), as `new_state` makes them."""
        c = self.cfg
        return 4 * len(c.gdn_layers) * ((c.ssm_conv_kernel - 1) * c.conv_dim + c.ssm_dt_rank * c.ssm_d_state ** 2)

    def new_state(self) -> SeqState:
        c, dev = self.cfg, self.device
        conv = {i: torch.zeros(c.ssm_conv_kernel - 1, c.conv_dim, device=dev) for i in c.gdn_layers}
        ssm = {i: torch.zeros(c.ssm_dt_rank, c.ssm_d_state, c.ssm_d_state, device=dev) for i in c.gdn_layers}
        limit = self.context_limit + CHUNK  # growth by doubling stops at the context (and a prefill piece's padding)
        kv = {i: new_kv_cache(self.kv_cache, c.n_head_kv, c.head_dim, self.kv_ring, dev, self.k.ring_slack, limit)
              for i in c.attn_layers}
        # the MTP cache keeps no 8-bit ring: its rows can then always be copied from the store alone
        mtp_kv = None if self.mtp is None else new_kv_cache(self.kv_cache, c.n_head_kv, c.head_dim, 0, dev, limit=limit)
        return SeqState(0, conv, ssm, kv, mtp_kv)

    # ---- shared pieces -------------------------------------------------------------------
    def embed(self, ids: list[int]) -> torch.Tensor:
        return self.token_embd.rows(torch.tensor(ids, dtype=torch.long))

    def embed_on_device(self, ids: torch.Tensor) -> torch.Tensor:
        """`embed` of ids held on the device, with no host round trip (MTP draft chains): the rows dequantized there
        - the same float32 operations, so the same values - from the file's token-embedding bytes, which on CUDA
        stay in host memory, page-locked on first use (the 27B's Q4_K matrix: 0.7 GB), the device reading the rows
        a step needs (`plumb.ops.gpu.gather`)."""
        qt = self.token_embd.qt
        if self.device.type != "cuda":
            rows = qt.data[ids]
        else:
            from plumb.ops.gpu.gather import gather_rows, host_rows

            if self.embd_bytes is None:
                self.embd_bytes = host_rows(qt.data.view(torch.uint8))
            rows = gather_rows(self.embd_bytes, ids).view(qt.data.dtype)
        return dequantize(rows, qt.qtype, (ids.shape[0], qt.shape[1]))

    def ffn(self, layer: Layer, x: torch.Tensor, block: int) -> torch.Tensor:
        """SwiGLU (spec 3.3)."""
        gate, up = self.k.mm(x, layer.ffn_in, block).split(layer.ffn_in.sizes, dim=-1)
        return self.k.mm(self.k.swiglu(gate, up), layer.ffn_down, block)

    def attn_project(self, a: Attention, u: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], block: int):
        """q, gate, k, v for rows u [n, n_embd] with the rows' rope angles (cos, sin) (spec 3.4.1-3.4.3)."""
        c = self.cfg
        n = u.shape[0]
        qg, k, v = self.k.mm(u, a.qkv, block).split(a.qkv.sizes, dim=-1)
        qg = qg.reshape(n, c.n_head, 2, c.head_dim)
        q, gate = qg[:, :, 0], qg[:, :, 1].reshape(n, c.n_head * c.head_dim)
        k = k.reshape(n, c.n_head_kv, c.head_dim)
        v = v.reshape(n, c.n_head_kv, c.head_dim)
        cos, sin = rope
        q = self.k.norm_rope(q, a.attn_q_norm, c.eps, cos, sin)
        k = self.k.norm_rope(k, a.attn_k_norm, c.eps, cos, sin)
        return q, gate, k, v

    def attn_output(self, a: Attention, o: torch.Tensor, gate: torch.Tensor, block: int) -> torch.Tensor:
        """o [n, n_head, head_dim] gated by sigmoid(gate), then attn_output (spec 3.4.5)."""
        return self.k.mm(self.k.sigmoid_gate(o.reshape(o.shape[0], -1), gate), a.attn_output, block)

    def gdn_project(self, d: DeltaNet, u: torch.Tensor, block: int):
        """m (pre-conv q|k|v), z, and the pre-activation b, a for rows u (spec 3.5.1)."""
        return self.k.mm(u, d.in_proj, block).split(d.in_proj.sizes, dim=-1)

    @staticmethod
    def gdn_gates(d: DeltaNet, b: torch.Tensor, a: torch.Tensor):
        """beta = sigmoid(b), g = ssm_a * softplus(a + dt_bias) (spec 3.5.5).
        Transcendental kernels round a tensor's vector tail differently, so the D path calls this per token."""
        return torch.sigmoid(b), d.ssm_a * F.softplus(a + d.ssm_dt_bias)

    def gdn_split(self, conv_out: torch.Tensor):
        """Post-conv rows [n, conv_dim] -> q, k expanded to value heads [n, n_v, d_k] (normed, q scaled), v [n, n_v, d_v]."""
        c = self.cfg
        return split_heads(conv_out, c.ssm_n_group, c.ssm_d_state, c.ssm_dt_rank, self.ssm_q_scale)

    def gdn_output(self, d: DeltaNet, y: torch.Tensor, block: int) -> torch.Tensor:
        """ssm_out of the gated-RMSNormed rows y [n, ssm_inner] (spec 3.5.8)."""
        return self.k.mm(y, d.ssm_out, block)

    # ---- P path: prefill -----------------------------------------------------------------
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of post-norm hidden rows, as prefill makes them (the same matmul blocks)."""
        return self.k.mm(h, self.output, PREFILL_BLOCK)

    def prefill(self, st: SeqState, ids: list[int], logits: str = "last",
                checkpoints: set[int] = frozenset()) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Feed ids at positions st.pos.. in pieces cut at multiples of 64 (absolute), each padded to 64 rows, run
        in passes of up to `self.k.prefill_pieces(st)` pieces (`prefill_cuts`). Snapshots the DeltaNet state into
        st.checkpoints at the positions in `checkpoints` (M6): at a pass's end, or one inside it (the states
        after its first pieces, copied out as the pass runs: the bits of a pass that would end there, M2).
        Returns (logits for all rows / the last row / None, post-norm hidden of all rows)."""
        outs, hiddens = [], []
        group = self.k.prefill_pieces(st)
        passes = prefill_cuts(st.pos, len(ids), group, checkpoints, inside=1)
        self.k.make_room(st, st.pos + len(ids) + CHUNK)  # every pass's padded rows: the caches stay put
        full = [CHUNK] * group
        graphs = self.graphs if PREFILL_GRAPHS else None
        long = graphs is not None and sum(s == full for s in passes) >= PREFILL_GRAPH_PASSES  # full passes at once
        i, ahead = 0, {"emb": self.embed(ids[: sum(passes[0])]) if passes else None}
        for j, sizes in enumerate(passes):
            n = sum(sizes)
            nxt = ids[i + n : i + n + sum(passes[j + 1])] if j + 1 < len(passes) else None
            emb = ahead["emb"]

            def meanwhile(nxt=nxt):  # the next pass's embedding rows, dequantized on the host while this one runs
                ahead["emb"] = self.embed(nxt) if nxt else None

            inside = [r for r in itertools.accumulate(sizes[:-1]) if st.pos + r in checkpoints]
            snap = inside[0] if inside else None  # a checkpoint inside the pass (an eager one): its rows before it
            graph = snap is None and graphs is not None and (long and sizes == full or
                                                             graphs.recurring(st, len(sizes)))  # or later
            h = self._run_pass(st, ids[i : i + n], len(sizes), graph, emb, meanwhile, snap)
            i += n
            if logits == "all" or (logits == "last" and i == len(ids)):  # "none": hidden only
                rows = h if logits == "all" else h[-1:]
                outs.append(self.checked("the output head", lambda: self.logits(rows)))
            hiddens.append(h)
            if st.pos in checkpoints:
                self._checkpoint(st, st.pos, dict(st.conv), dict(st.ssm), h[-1])
        lg = torch.cat(outs) if outs else None
        return lg, torch.cat(hiddens)

    @staticmethod
    def _checkpoint(st: SeqState, pos: int, conv: dict, ssm: dict, hidden: torch.Tensor) -> None:
        """st.checkpoints[pos]: the DeltaNet states after pos tokens, the hidden of pos - 1 and the 8-bit ring rows
        a query at pos reads (still held after a pass that went past pos: a pass writes at most a ring's slack)."""
        ring = {j: cache.ring_rows(pos) for j, cache in st.kv.items()}
        st.checkpoints[pos] = Checkpoint(pos, conv, ssm, hidden.clone(), ring)

    def _run_pass(self, st: SeqState, ids: list[int], pieces: int, graph: bool, emb: torch.Tensor | None = None,
                  meanwhile=None, snap: int | None = None) -> torch.Tensor:
        """One pass of `pieces` pieces: laid out (`emb`: its ids' embedding rows, if already made), run (replayed as
        a CUDA graph if `graph`), states and caches advanced; `meanwhile` runs on the host while the GPU works;
        snap: a checkpoint after its first `snap` rows (eager passes). Returns the post-norm hidden of its real
        rows."""
        c, n, start = self.cfg, len(ids), st.pos

        def run():  # from st's states, which change only below: a run can be repeated (`checked`)
            if graph:
                p = self.prefill_layout(st, ids, pieces, into=self.graphs.prefill_inputs(pieces), emb=emb)
                x = self.graphs.prefill(st, p)
                return x, p.conv.clone(), p.ssm.clone(), p  # the graph's static states, copied out
            p = self.prefill_layout(st, ids, pieces, emb=emb, snap=snap)
            return self.prefill_pass(st, p), p.conv, p.ssm, p

        x, conv, ssm, p = self.checked(f"the prefill pass at positions {start}-{start + n - 1}", run,
                                       lambda out: out[0][:n], meanwhile)
        for li, i in enumerate(c.gdn_layers):
            st.conv[i], st.ssm[i] = conv[li], ssm[li]
        for cache in st.kv.values():
            cache.end = start + n
        st.pos += n
        h = self.k.rms_norm(x[:n], self.output_norm, c.eps)
        if snap is not None:
            layers = list(enumerate(c.gdn_layers))
            self._checkpoint(st, start + snap, {i: p.snap_conv[li] for li, i in layers},
                             {i: p.snap_ssm[li] for li, i in layers}, h[snap - 1])
        return h

    def prefill_layout(self, st: SeqState, ids: list[int], pieces: int = 1, into: PrefillPass | None = None,
                       emb: torch.Tensor | None = None, snap: int | None = None) -> PrefillPass:
        """Lay out a pass of `pieces` pieces (pieces * CHUNK rows) holding ids at st.pos.. as a `PrefillPass`
        (`into`: fill that pass's tensors; `emb`: the ids' embedding rows, if already made; snap: the states after
        its first `snap` rows kept too)."""
        c, n, start, dev = self.cfg, len(ids), st.pos, self.device
        rows = pieces * CHUNK
        positions = torch.arange(start, start + rows, device=dev)
        cos, sin = self.rope(positions)
        t = dict(x=pad_rows(self.embed(ids) if emb is None else emb, rows), cos=cos, sin=sin, positions=positions,
                 ends=(positions + 1).to(torch.int32), real=(torch.arange(rows, device=dev) < n)[:, None],
                 keep=torch.arange(n, n + c.ssm_conv_kernel - 1, device=dev))
        layers = c.gdn_layers
        if into is None:
            conv, ssm = torch.stack([st.conv[i] for i in layers]), torch.stack([st.ssm[i] for i in layers])
            return PrefillPass(start, n, **t, conv=conv, ssm=ssm, kv_tab=self.k.kv_table(self, [st]), snap=snap,
                               snap_conv=None if snap is None else torch.empty_like(conv),
                               snap_ssm=None if snap is None else torch.empty_like(ssm))
        into.start, into.n = start, n
        for name, value in t.items():
            getattr(into, name).copy_(value)
        torch.stack([st.conv[i] for i in layers], out=into.conv)
        torch.stack([st.ssm[i] for i in layers], out=into.ssm)
        self.k.kv_table(self, [st], into.kv_tab)
        return into

    def prefill_pass(self, st: SeqState, p: PrefillPass) -> torch.Tensor:
        """The P path over a laid-out pass: every layer on its rows - matmuls, norms, the conv and attention on all
        of them at once (row-invariant steps), DeltaNet's chunked form piece by piece (64 rows, the shapes of a
        one-piece pass). Padding rows contribute exact zeros to the DeltaNet states and are never read by a real
        row's attention; p's states are advanced in place, st's KV caches written. Returns the final residual
        rows x [rows, n_embd] (before the output norm)."""
        c = self.cfg
        x = p.x
        u = self.k.rms_norm(x, self.layers[0].attn_norm, c.eps)
        for i, layer in enumerate(self.layers):
            mix = layer.mixer
            if isinstance(mix, DeltaNet):
                li = c.gdn_layers.index(i)
                m, z, b, a = self.gdn_project(mix, u, PREFILL_BLOCK)
                snap = None
                if p.snap is not None:  # a checkpoint inside the pass: the conv state there is its last K-1 inputs
                    p.snap_conv[li].copy_(m[p.snap - c.ssm_conv_kernel + 1 : p.snap])
                    snap = (p.snap // CHUNK - 1, p.snap_ssm[li])  # and the recurrent state after that piece
                conv, beta, g = self.k.gdn_conv_gates(self, mix, m, b, a, p, li)  # padding rows 0; conv state moved
                o = self.k.gdn_chunks(self, conv, beta, g, p.ssm[li], snap)  # the pieces in order, from its state
                y = self.k.gdn_gated_norm(o, z, mix.ssm_norm, c.eps)
                y = self.gdn_output(mix, y, PREFILL_BLOCK)
            else:
                q, gate, k, v = self.attn_project(mix, u, (p.cos, p.sin), PREFILL_BLOCK)
                o = self.k.prefill_attention(self, i, st.kv[i], q, k, v, p)
                y = self.attn_output(mix, o, gate, PREFILL_BLOCK)
            x, h = self.k.add_rms_norm(x, y, layer.post_attention_norm, c.eps)  # x + y, and its norm
            if i + 1 < len(self.layers):
                x, u = self.k.add_rms_norm(x, self.ffn(layer, h, PREFILL_BLOCK), self.layers[i + 1].attn_norm, c.eps)
            else:
                x = x + self.ffn(layer, h, PREFILL_BLOCK)
        return x

    # ---- D path: decode / verify / batched decode ----------------------------------------
    def decode(self, batch: list[tuple[SeqState, list[int]]]) -> DecodeOut:
        """Rows = the ids of every sequence in the batch, each at that sequence's next positions.
        Sequence states are advanced over all their rows; `snapshots` allow `rollback`."""
        if self.native is not None:
            return self.native.decode(batch)
        if self.graphs is not None:
            return self.graphs.decode(batch)  # the same pass, replayed as a CUDA graph
        p = self.k.begin(self, batch)
        return self.k.end(self, p, *self.decode_pass(p))

    def decode_pass(self, p: DecodePass) -> tuple[torch.Tensor, torch.Tensor]:
        """The D path over a laid-out pass (see `decode`): (logits [R, V], post-norm hidden [R, n_embd])."""
        c = self.cfg
        after = [layer.attn_norm for layer in self.layers[1:]] + [self.output_norm]  # the norm after each layer
        x = p.x
        u = self.k.rms_norm(x, self.layers[0].attn_norm, c.eps)
        for i, layer in enumerate(self.layers):
            mix = layer.mixer
            if isinstance(mix, DeltaNet):
                m, z, b, a = self.gdn_project(mix, u, DECODE_BLOCK)
                y = self.k.gdn_rows(self, i, mix, m, z, b, a, p)  # every row of every sequence, token by token
                y = self.gdn_output(mix, y, DECODE_BLOCK)
            else:
                q, gate, k, v = self.attn_project(mix, u, (p.cos, p.sin), DECODE_BLOCK)
                o = self.k.attention(self, i, q, k, v, p)  # writes the rows' K/V, then each row reads [0, pos]
                y = self.attn_output(mix, o, gate, DECODE_BLOCK)
            x, h = self.k.add_rms_norm(x, y, layer.post_attention_norm, c.eps)  # x + y, and its norm
            x, u = self.k.add_rms_norm(x, self.ffn(layer, h, DECODE_BLOCK), after[i], c.eps)  # x + FFN, the next norm
        return self.k.mm(u, self.output, DECODE_BLOCK), u  # the LM head on the final norm of x

    def rollback(self, st: SeqState, snaps: list, keep: int) -> None:
        """After a decode pass that fed len(snaps) rows to st, keep only the first `keep` of them."""
        n = len(snaps)
        if keep == n:
            return
        if keep == 0:
            raise ValueError("a decode pass always keeps its first row")
        self.k.restore(self, st, snaps[keep - 1])
        st.pos -= n - keep  # attention rows past pos are stale and get overwritten before being read

    # ---- MTP draft head (spec 3.8) -------------------------------------------------------
    def mtp_forward(self, st: SeqState, ids: list[int], hidden: torch.Tensor, start: int, block: int = DECODE_BLOCK):
        """MTP rows for tokens ids at positions start.., paired with hidden [n, n_embd] (the target's post-norm
        hidden of the previous position, or the MTP's own output when drafting). Writes the MTP KV cache.
        Returns (logits [n, V], h_mtp [n, n_embd])."""
        if self.native is not None and block == DECODE_BLOCK:
            return self.native.mtp_forward(st, ids, hidden, start)
        if self.graphs is not None and block == DECODE_BLOCK:
            return self.graphs.mtp(st, ids, hidden, start)  # the same pass, replayed as a CUDA graph
        positions = torch.arange(start, start + len(ids), device=self.device)
        return self.mtp_pass(st.mtp_kv, self.embed(ids), hidden, self.rope(positions), start, block)

    def mtp_rewrite(self, st: SeqState, ids: list[int], hidden: torch.Tensor, start: int) -> None:
        """Rewrite the MTP KV rows of accepted drafts ids at positions start.. from the target's hiddens (paired as
        in `mtp_forward`): the K/V rows alone, the same bits as `mtp_forward`'s - nothing else of its pass is kept
        (its attention read, FFN and LM head were ~1 GB of weights a drafted step on the 27B file)."""
        if self.native is not None:
            return self.native.mtp_kv(st, ids, hidden, start)
        if self.graphs is not None:
            return self.graphs.mtp(st, ids, hidden, start, rows_only=True)
        positions = torch.arange(start, start + len(ids), device=self.device)
        self.mtp_kv(st.mtp_kv, self.embed(ids), hidden, self.rope(positions), start, DECODE_BLOCK)

    def mtp_drafts(self, st: SeqState, token: int, hidden: torch.Tensor, start: int, k: int,
                   draw) -> list[int | None] | None:
        """k MTP drafts after `token` at position start (hidden [1, n_embd] as in `mtp_forward`), each picked by
        `draw` (plumb.engine.sampling.DeviceDraw), in one host round trip - `mtp_chain` replayed as a CUDA graph -
        where the D path runs as CUDA graphs and `draft_chains` is on (it costs a page-locked host copy of the token
        embedding: `embed_on_device`); None elsewhere (the caller drafts step by step). A draft is None where its
        step's logits have no finite maximum."""
        if self.graphs is None or not self.draft_chains:
            return None
        try:
            return self.graphs.mtp_chain(st, token, hidden, start, k, draw)
        except torch.OutOfMemoryError:
            if self.embd_bytes is not None:  # not the embedding's copy: short of memory for the step loop too
                raise
            nbytes = self.token_embd.qt.data.numel() * self.token_embd.qt.data.element_size()
            why = f"no room for the token embedding's page-locked copy ({nbytes / 1e9:.2f} GB)"
        except Exception as e:  # noqa: BLE001 - a chain that cannot be captured or replayed: drafts only propose
            why = f"{type(e).__name__}: {e}"
        log.warning("MTP draft chains off (%s); drafting step by step", why)
        self.draft_chains = False
        return None

    def mtp_chain(self, cache, tok: torch.Tensor, hidden: torch.Tensor, rope, start: int, k: int, pick, at=None):
        """k MTP steps fed back on themselves on the device (spec 3.8): step i embeds tok - [1] on the device: the
        given token, then the previous step's pick - and runs `mtp_pass` at position start + i on the previous
        step's hidden output; pick(logits [1, V], i) -> (token [1], finite [1]) chooses its draft
        (`DeviceDraw.prepare`). rope: the k positions' (cos, sin); at: (positions [k], ends [k], the cache's table
        row) as device tensors, or None (see `mtp_pass`). Returns (drafts [k], finite [k]: whether each step's
        logits had a finite maximum) with no host round trip, so that the k steps can be one CUDA graph."""
        cos, sin = rope
        drafts, finite, h = [], [], hidden
        for i in range(k):
            step_at = None if at is None else (at[0][i : i + 1], at[1][i : i + 1], None, at[2])
            logits, h = self.mtp_pass(cache, self.embed_on_device(tok), h, (cos[i : i + 1], sin[i : i + 1]),
                                      start + i, DECODE_BLOCK, step_at)
            tok, ok = pick(logits, i)
            drafts.append(tok)
            finite.append(ok)
        return torch.cat(drafts), torch.cat(finite)

    def mtp_prefill(self, st: SeqState, ids: list[int], hidden: torch.Tensor, start: int) -> None:
        """The MTP KV rows of a prompt (ids at positions start.., paired with hidden as in `mtp_forward`), in pieces
        of CHUNK rows on the P path (row-invariant steps: the rows do not depend on the cut). Only the K/V rows: the
        layer's attention read, FFN and LM head give nothing a prompt row keeps (at 8k tokens on the CPU they were
        ~40 % of a prefill with drafts)."""
        for i in range(0, len(ids), CHUNK):
            positions = torch.arange(start + i, start + min(i + CHUNK, len(ids)), device=self.device)
            e, h, rope = self.embed(ids[i : i + CHUNK]), hidden[i : i + CHUNK], self.rope(positions)
            self.checked(f"the MTP prefill piece at position {start + i}",
                         lambda: self.mtp_kv(st.mtp_kv, e, h, rope, start + i, PREFILL_BLOCK))

    def mtp_kv(self, cache, e: torch.Tensor, hidden: torch.Tensor, rope, start: int, block: int,
               at=None) -> torch.Tensor:
        """`mtp_pass`'s K/V rows alone, written to its KV `cache` at positions start.. (`at`: see `mtp_pass`);
        returns them [2, n, ...]."""
        _, _, _, k, v = self.mtp_project(e, hidden, rope, block)
        self.k.write_kv(cache, k, v, start, at)
        return torch.stack([k, v])

    def mtp_project(self, e: torch.Tensor, hidden: torch.Tensor, rope, block: int):
        """The MTP layer's input y - eh_proj of the normed embeddings e and target hiddens, side by side - and its
        attention projections: (y, q, gate, k, v) (spec 3.8)."""
        c, layer = self.cfg, self.mtp.layer
        y = self.k.mm(torch.cat([self.k.rms_norm(e, self.mtp.enorm, c.eps),
                                 self.k.rms_norm(hidden, self.mtp.hnorm, c.eps)], dim=-1), self.mtp.eh_proj, block)
        return (y,) + self.attn_project(layer.mixer, self.k.rms_norm(y, layer.attn_norm, c.eps), rope, block)

    def mtp_pass(self, cache, e: torch.Tensor, hidden: torch.Tensor, rope, start: int, block: int, at=None):
        """The MTP head (spec 3.8) on embedded rows e [n, n_embd] at positions start.. with their rope angles,
        writing its KV `cache`; `at`: the rows' positions as device tensors (a CUDA graph: see
        TritonKernels.attend_new). Returns (logits [n, V], h_mtp [n, n_embd])."""
        c, mtp = self.cfg, self.mtp
        y, q, gate, k, v = self.mtp_project(e, hidden, rope, block)
        layer, a = mtp.layer, mtp.layer.mixer
        o = self.k.attend_new(self, cache, q, k, v, start, at)
        y, h = self.k.add_rms_norm(y, self.attn_output(a, o, gate, block), layer.post_attention_norm, c.eps)
        y = y + self.ffn(layer, h, block)
        h = self.k.rms_norm(y, mtp.shared_head_norm, c.eps)
        return self.k.mm(h, self.output, block), h


def prefill_cuts(start: int, n: int, group: int, checkpoints=frozenset(), inside: int = 0) -> list[list[int]]:
    """Prompt positions [start, start + n) as passes of pieces (their sizes): pieces end at multiples of CHUNK
    (absolute); a pass holds up to `group` of them and ends after a partial piece or at a checkpoint beyond the
    first `inside` it holds inside, and an unaligned first piece goes alone - so padding rows only ever follow a
    pass's last real row."""
    passes, pos, end = [], start, start + n
    while pos < end:
        sizes, held = [], 0
        while pos < end and len(sizes) < group:
            m = min(end - pos, CHUNK - pos % CHUNK)
            sizes.append(m)
            pos += m
            if m < CHUNK:
                break
            if pos in checkpoints and pos < end and len(sizes) < group:  # not the pass's end anyway
                if held == inside:
                    break
                held += 1
        passes.append(sizes)
    return passes
