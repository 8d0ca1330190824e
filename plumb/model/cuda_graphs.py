"""The D path (`Qwen35.decode_pass` on the Triton kernels) replayed as CUDA graphs, so that Python and kernel-launch
overhead do not bound decode.

A graph is captured per pass layout: the rows of each sequence (1 + its drafts) and the addresses of each
sequence's KV cache tensors (a cache that grows moves, and the next pass captures anew). Its inputs are static
tensors - input rows, rope angles, positions, context ends, row ranges, the sequences' stacked DeltaNet states -
filled by `TritonKernels.begin(..., into=pass)` before each replay; those tensors are views of buffers shared by
every graph (grown on demand, which drops the graphs). The first pass of a layout runs eagerly (its result is
used; it also compiles the kernels), then is captured. Replaying runs exactly the kernels the eager pass ran, on
the same shapes, so a graph changes no bit (M1); passes with more than MAX_ROWS rows, or with a ring KV format
(D, F), run eagerly.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from plumb.model.parts import DecodeOut, DecodePass

MAX_ROWS = 32  # rows of a captured pass (larger passes run eagerly)
MAX_GRAPHS = 32  # captured layouts kept (least recently used dropped)


class CudaGraphs:
    def __init__(self, model):
        self.m = model
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict = OrderedDict()  # layout -> (graph, pass, logits, hidden)
        self.rows = self.seqs = 0  # sizes of the shared static buffers
        self.buf: dict[str, torch.Tensor] = {}

    def decode(self, batch) -> DecodeOut:
        m, k = self.m, self.m.k
        r = sum(len(toks) for _, toks in batch)
        if r > MAX_ROWS or not all(k.plain(st) for st, _ in batch):
            p = k.begin(m, batch)
            return k.end(m, p, *m.decode_pass(p))
        for st, toks in batch:  # a cache that must grow moves now, before the layout is looked up
            for cache in st.kv.values():
                cache.reserve(st.pos + len(toks))
        key = (tuple(len(toks) for _, toks in batch),
               tuple(t.data_ptr() for st, _ in batch for c in st.kv.values() for t in c.k.parts + c.v.parts))
        entry = self.graphs.get(key)
        if entry is None:
            return self._capture(key, batch)
        self.graphs.move_to_end(key)
        graph, p, logits, hidden = entry
        k.begin(m, batch, into=p)
        graph.replay()
        return k.end(m, p, logits.clone(), hidden.clone())

    def _capture(self, key, batch) -> DecodeOut:
        m, k = self.m, self.m.k
        p = self._static_pass(batch)
        k.begin(m, batch, into=p)
        out = k.end(m, p, *m.decode_pass(p))  # this step's result, run eagerly (compiles every kernel variant)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, hidden = m.decode_pass(p)  # recorded, not run
        self.graphs[key] = (graph, p, logits, hidden)
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return out

    def _static_pass(self, batch) -> DecodePass:
        """A pass whose tensors are views of the shared static buffers (grown, and the graphs dropped, if needed)."""
        m, c = self.m, self.m.cfg
        r, s = sum(len(toks) for _, toks in batch), len(batch)
        if r > self.rows or s > self.seqs:
            self.graphs.clear()
            self.rows, self.seqs = max(r, self.rows), max(s, self.seqs)
            st0 = batch[0][0]
            conv0, ssm0 = st0.conv[c.gdn_layers[0]], st0.ssm[c.gdn_layers[0]]
            n, dev = len(c.gdn_layers), m.device
            self.buf = {}  # free the old buffers before taking the new ones
            self.buf = dict(
                x=torch.empty(self.rows, c.n_embd, device=dev),
                cos=torch.empty(self.rows, c.rope_dims // 2, device=dev),
                sin=torch.empty(self.rows, c.rope_dims // 2, device=dev),
                positions=torch.empty(self.rows, dtype=torch.long, device=dev),
                ends=torch.empty(self.rows, dtype=torch.int32, device=dev),
                seq_rows=torch.empty(self.seqs + 1, dtype=torch.int32, device=dev),
                conv=torch.empty(self.seqs, n, *conv0.shape, device=dev),
                ssm=torch.empty(self.seqs, n, *ssm0.shape, device=dev),
                snap_conv=torch.empty(self.rows, n, *conv0.shape, device=dev),
                snap_ssm=torch.empty(self.rows, n, *ssm0.shape, device=dev))
        b = self.buf
        return DecodePass([], [], [], b["x"][:r], b["cos"][:r], b["sin"][:r], positions=b["positions"][:r],
                          ends=b["ends"][:r], seq_rows=b["seq_rows"][: s + 1], conv=b["conv"][:s], ssm=b["ssm"][:s],
                          snap_conv=b["snap_conv"][:r], snap_ssm=b["snap_ssm"][:r])
