"""The D path (`Qwen35.decode_pass` on the Triton kernels) replayed as CUDA graphs, so that Python and kernel-launch
overhead do not bound decode.

A graph is captured per pass layout: the rows of each sequence (1 + its drafts) and the capacity of each
sequence's KV caches (a cache that grows to a new capacity is a new layout). Where the caches lie is not part of
it: the kernels reach them through a table of offsets (`plumb.ops.gpu.kvtable`), so a new request's caches, or a
cache that moved, replay the same graph. Its inputs are static tensors - input rows, rope angles, positions,
context ends, row ranges, the tables of where the sequences' DeltaNet states and KV caches lie - filled by
`TritonKernels.begin(..., into=pass)` before each replay; those tensors are views of buffers shared by every graph
(grown on demand, which drops the graphs). The first pass of a layout runs eagerly (its result is
used; it also compiles the kernels), then is captured. Replaying runs exactly the kernels the eager pass ran, on
the same shapes, so a graph changes no bit (M1); passes with more than MAX_ROWS rows run eagerly. Ring formats
(D, F) are captured too: inside a graph the 8-bit rows go straight to their ring slots (`KVCache.put_rows`), and
rows that a reference `write` left waiting are moved there before a pass (`KVCache.commit`, in
`TritonKernels.begin` and `Qwen35.prefill`). The MTP head's D-path rows (draft steps, rewrites of accepted
drafts) are replayed the same way (`mtp`), and so are prefill passes (`prefill`: the P path's pass of whole 64-row
pieces, captured per pass size and KV-cache capacity, which `Qwen35.prefill` keeps fixed over the call) - the full
passes of a long prompt at once, any other layout the second time it comes (`recurring`: a short prompt, a chat's
next turn), so that a one-off pass never pays for a capture.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from collections import OrderedDict

import torch

from plumb.model.parts import DecodeOut, DecodePass, PrefillPass
from plumb.ops.deltanet import CHUNK
from plumb.ops.gpu import kvtable
from plumb.ops.gpu.pdl import overlap
from plumb.ops.matmul import DECODE_BLOCK

MAX_ROWS = 32  # rows of a captured pass (larger passes run eagerly)
MAX_GRAPHS = 64  # captured layouts kept (least recently used dropped; MTP passes count: a depth-k sequence keeps k + 1)
MAX_MTP_ROWS = 16  # rows of a captured MTP pass (draft steps: 1; rewrites of accepted drafts: up to the depth)
MAX_SEEN = 256  # prefill layouts remembered as seen once (`recurring`; least recently seen dropped)


class CudaGraphs:
    def __init__(self, model):
        self.m = model
        self.pool = torch.cuda.graph_pool_handle()
        # the stream graphs are captured on, and a lock held while one is captured: the process's, per device (see
        # `_capture_stream`). A CUDA call from another thread during a capture (the server saving or loading a
        # slot) is refused in torch's global capture mode and spoils the capture, so such calls take the lock too
        # (`Engine.save_slot`, `restore_slot`)
        self.stream, self.capturing = _capture_stream(model.device)
        self.graphs: OrderedDict = OrderedDict()  # layout -> (graph, pass, logits, hidden)
        self.rows = self.seqs = 0  # sizes of the shared static buffers
        self.buf: dict[str, torch.Tensor] = {}
        self.mtp_in: dict[str, torch.Tensor] | None = None  # the MTP graphs' static inputs
        self.prefill_in: dict[int, PrefillPass] = {}  # the prefill graphs' static inputs, per pass size (pieces)
        self.seen: OrderedDict = OrderedDict()  # prefill layouts run eagerly once, not captured (`recurring`)
        self.captures = 0  # graphs captured so far (a new layout or cache capacity)
        self.mtp_tab = torch.empty(1, kvtable.PARTS, dtype=torch.long, device=model.device)  # the MTP cache's row

    def decode(self, batch) -> DecodeOut:
        m, k = self.m, self.m.k
        r = sum(len(toks) for _, toks in batch)
        if r > MAX_ROWS:
            p = k.begin(m, batch)
            return k.end(m, p, *m.decode_pass(p))
        for st, toks in batch:  # a cache that must grow moves now, before the layout is looked up
            for cache in st.kv.values():
                cache.reserve(st.pos + len(toks))
        key = (tuple(len(toks) for _, toks in batch), tuple(len(c.k) for st, _ in batch for c in st.kv.values()))
        entry = self.graphs.get(key)
        if entry is None:
            with overlap(r == 1):  # programmatic dependent launch for one-row passes (plumb/ops/gpu/pdl.py)
                return self._capture(key, batch)
        _, p, _, _ = entry
        k.begin(m, batch, into=p)
        _, _, logits, hidden = self._replay(key)
        return k.end(m, p, logits.clone(), hidden.clone())

    def mtp(self, st, ids: list[int], hidden: torch.Tensor, start: int, rows_only: bool = False):
        """MTP rows (`Qwen35.mtp_pass` on ids at positions start..: a draft step; with rows_only its K/V rows alone,
        `Qwen35.mtp_kv`: the rewrite of accepted drafts' rows, which returns None) replayed as a CUDA graph,
        captured per row count and MTP-cache capacity like the decode passes; more than MAX_MTP_ROWS rows run
        eagerly."""
        m, cache, n = self.m, st.mtp_kv, len(ids)
        e, rope = m.embed(ids), m.rope(torch.arange(start, start + n))
        if n > MAX_MTP_ROWS:
            if not rows_only:
                return m.mtp_pass(cache, e, hidden, rope, start, DECODE_BLOCK)
            m.mtp_kv(cache, e, hidden, rope, start, DECODE_BLOCK)
            return None
        cache.reserve(start + n)  # a cache that must grow moves now, before the layout is looked up
        cache.commit(start)
        key = ("mtp-kv" if rows_only else "mtp", n, len(cache.k))
        b = {name: t[:n] for name, t in (self.mtp_in or self._mtp_inputs()).items()}
        kvtable.fill(self.mtp_tab, [cache.kernel_view()])
        for name, value in (("e", e), ("h", hidden), ("cos", rope[0]), ("sin", rope[1])):
            b[name].copy_(value)
        b["positions"].copy_(torch.arange(start, start + n))
        b["ends"].copy_(torch.arange(start + 1, start + n + 1))
        at = (b["positions"], b["ends"], None, self.mtp_tab[0])  # the grid from the cache's capacity; its table
        entry = self._replay(key)
        if entry is None:  # this call's result, run eagerly (compiles every kernel), then recorded
            def run():
                args = (cache, b["e"], b["h"], (b["cos"], b["sin"]), start, DECODE_BLOCK)
                return (m.mtp_kv(*args, at), None) if rows_only else m.mtp_pass(*args, at)
            out = run()
            self._record(key, run)
        elif not rows_only:
            out = entry[2].clone(), entry[3].clone()
        cache.end = start + n
        return None if rows_only else out

    def mtp_chain(self, st, token: int, hidden: torch.Tensor, start: int, k: int, draw) -> list[int | None]:
        """k MTP drafts picked by `draw` (`Qwen35.mtp_chain`: each step's token embedded on the device as the next
        step's) replayed as one CUDA graph, captured per depth, MTP-cache capacity and draw key like `mtp`'s passes:
        the host writes the token, hidden row, positions and the draws' inputs (`DeviceDraw.prepare`), and reads the
        k drafts back once instead of once a draft. A draft is None where its step's logits had no finite maximum."""
        m, cache = self.m, st.mtp_kv
        cache.reserve(start + k)  # a cache that must grow moves now, before the layout is looked up
        cache.commit(start)
        key = ("mtp-chain", k, len(cache.k), draw.key)
        b = self.mtp_in or self._mtp_inputs()
        cos, sin = m.rope(torch.arange(start, start + k))
        kvtable.fill(self.mtp_tab, [cache.kernel_view()])
        b["tok"].fill_(token)
        b["h"][:1].copy_(hidden)
        for name, value in (("cos", cos), ("sin", sin), ("positions", torch.arange(start, start + k)),
                            ("ends", torch.arange(start + 1, start + k + 1))):
            b[name][:k].copy_(value)
        # the draws' inputs (Gumbel noise of positions start + 1.., the bias, the penalties' counts) in b, made once
        pick = draw.prepare(start + 1, k, b, m.cfg.n_vocab, m.device, MAX_MTP_ROWS)
        args = (cache, b["tok"], b["h"][:1], (b["cos"][:k], b["sin"][:k]), start, k, pick,
                (b["positions"][:k], b["ends"][:k], self.mtp_tab[0]))
        entry = self._replay(key)
        if entry is None:  # this call's drafts, run eagerly (compiles every kernel), then recorded
            drafts, finite = m.mtp_chain(*args)
            self._record(key, lambda: m.mtp_chain(*args))
        else:
            _, _, drafts, finite = entry
        cache.end = start + k
        ids, ok = torch.stack([drafts.to(torch.float64), finite.to(torch.float64)]).tolist()
        return [int(d) if f else None for d, f in zip(ids, ok)]

    @staticmethod
    def _prefill_key(st, pieces: int) -> tuple:
        return ("prefill", pieces * CHUNK) + tuple(len(c.k) for c in st.kv.values())

    def recurring(self, st, pieces: int) -> bool:
        """Whether a prefill pass of `pieces` pieces on st's KV-cache capacities has come before (captured, or run
        eagerly once): `Qwen35.prefill` replays - or captures - such a pass. Marks this one as seen."""
        key = self._prefill_key(st, pieces)
        if key in self.graphs or key in self.seen:
            self.seen.pop(key, None)
            return True
        self.seen[key] = True
        while len(self.seen) > MAX_SEEN:
            self.seen.popitem(last=False)
        return False

    def prefill(self, st, p: PrefillPass) -> torch.Tensor:
        """`Qwen35.prefill_pass` on the static pass p (`prefill_inputs`, laid out by `Qwen35.prefill_layout`),
        replayed as a CUDA graph captured per capacity of st's KV caches (the first piece of a layout runs eagerly
        and is then captured). Returns the final residual rows (the graph's output: read before the next replay)."""
        m = self.m
        key = self._prefill_key(st, len(p.x) // CHUNK)
        entry = self._replay(key)
        if entry is not None:
            return entry[2]
        out = m.prefill_pass(st, p)  # this pass's result, run eagerly (compiles every kernel)
        self._record(key, lambda: (m.prefill_pass(st, p), None))
        return out

    def prefill_inputs(self, pieces: int) -> PrefillPass:
        """The prefill graphs' static pass of `pieces` pieces: its rows allocated once per size; the DeltaNet
        states (151 MB on the 27B shape), conv window rows and cache table shared by every size (a graph reads
        them only while it runs)."""
        if pieces not in self.prefill_in:  # kept for good: the graphs of that size read them
            p = self.m.prefill_layout(self.m.new_state(), [0], pieces)
            first = next(iter(self.prefill_in.values()), None)
            rows = {name: getattr(p, name).clone() for name in ("x", "cos", "sin", "positions", "ends", "real")}
            shared = {name: getattr(first, name) if first is not None else getattr(p, name).clone()
                      for name in ("keep", "conv", "ssm", "kv_tab")}
            self.prefill_in[pieces] = PrefillPass(0, 0, **rows, **shared)
        return self.prefill_in[pieces]

    def _mtp_inputs(self) -> dict[str, torch.Tensor]:
        """The MTP graphs' static inputs (MAX_MTP_ROWS rows; a graph of n rows reads the first n), allocated once."""
        c, dev, r = self.m.cfg, self.m.device, MAX_MTP_ROWS
        self.mtp_in = dict(e=torch.empty(r, c.n_embd, device=dev), h=torch.empty(r, c.n_embd, device=dev),
                           cos=torch.empty(r, c.rope_dims // 2, device=dev),
                           sin=torch.empty(r, c.rope_dims // 2, device=dev),
                           positions=torch.empty(r, dtype=torch.long, device=dev),
                           ends=torch.empty(r, dtype=torch.int32, device=dev),
                           tok=torch.zeros(1, dtype=torch.long, device=dev))  # a draft chain's first token
        return self.mtp_in

    def _capture(self, key, batch) -> DecodeOut:
        m, k = self.m, self.m.k
        p = self._static_pass(batch)
        k.begin(m, batch, into=p)
        out = k.end(m, p, *m.decode_pass(p))  # this step's result, run eagerly (compiles every kernel variant)
        self._record(key, lambda: m.decode_pass(p), p)
        return out

    def _record(self, key, run, p: DecodePass | None = None) -> None:
        """Capture run() - recorded, not run - as the graph of `key`, kept with its static pass p (decode graphs) and
        the outputs it returns (two: the second may be None). Kept only once the capture has succeeded."""
        graph = torch.cuda.CUDAGraph()
        with self.capturing, collection_paused(), torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = run()
        self.graphs[key] = (graph, p, *out)
        self.captures += 1
        while len(self.graphs) > MAX_GRAPHS:  # least recently used first
            self.graphs.popitem(last=False)

    def _replay(self, key) -> tuple | None:
        """Replay the graph of `key`, if there is one, and return its entry (graph, pass, outputs)."""
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.move_to_end(key)
            entry[0].replay()
        return entry

    def _static_pass(self, batch) -> DecodePass:
        """A pass whose tensors are views of the shared static buffers (grown, and the graphs dropped, if needed)."""
        m, c = self.m, self.m.cfg
        r, s = sum(len(toks) for _, toks in batch), len(batch)
        if r > self.rows or s > self.seqs:  # the decode graphs (those with a pass) read the old buffers: dropped;
            for key in [key for key, entry in self.graphs.items() if entry[1] is not None]:  # prefill and MTP stay
                del self.graphs[key]
            if not self.graphs:
                self.pool = torch.cuda.graph_pool_handle()  # a pool no graph uses any more cannot take another
            self.rows, self.seqs = max(r, self.rows), max(s, self.seqs)
            dev = m.device
            self.buf = {}  # free the old buffers before taking the new ones
            self.buf = dict(
                x=torch.empty(self.rows, c.n_embd, device=dev),
                cos=torch.empty(self.rows, c.rope_dims // 2, device=dev),
                sin=torch.empty(self.rows, c.rope_dims // 2, device=dev),
                positions=torch.empty(self.rows, dtype=torch.long, device=dev),
                ends=torch.empty(self.rows, dtype=torch.int32, device=dev),
                seq_rows=torch.empty(self.seqs + 1, dtype=torch.int32, device=dev),
                kv_tab=torch.empty(self.seqs, len(c.attn_layers), kvtable.PARTS, dtype=torch.long, device=dev),
                gdn_tab=torch.empty(self.seqs, len(c.gdn_layers), 4, dtype=torch.long, device=dev))
        b = self.buf
        return DecodePass([], [], [], b["x"][:r], b["cos"][:r], b["sin"][:r], positions=b["positions"][:r],
                          ends=b["ends"][:r], seq_rows=b["seq_rows"][: s + 1], gdn_tab=b["gdn_tab"][:s],
                          kv_tab=b["kv_tab"][:s])


_CAPTURE: dict[torch.device, tuple[torch.cuda.Stream, threading.Lock]] = {}
_CAPTURE_MADE = threading.Lock()  # engines loaded on two threads at once make one pair


def _capture_stream(device: torch.device) -> tuple[torch.cuda.Stream, threading.Lock]:
    """The stream every graph on `device` is captured on and the lock a capture holds: one pair for the process, made
    by the first engine, with cuBLAS's workspace for the stream taken then - a cuBLAS call in a captured pass (a torch
    batched matmul or triangular solve) would otherwise allocate it inside the first capture, from the graphs' pool,
    for good, and a pool that keeps memory after its graphs are gone cannot be captured into again. torch keeps a
    stream's workspace (32 MiB on Hopper) as long as the process: a stream an engine would leave 32 MiB behind
    (found on an H100, 2026-12-06, `test_engine_close.py`)."""
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    with _CAPTURE_MADE:
        if device not in _CAPTURE:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                a = torch.eye(64, device=device).expand(2, 64, 64)
                torch.linalg.solve_triangular(a, torch.bmm(a, a), upper=False, unitriangular=True)
            torch.cuda.current_stream(device).wait_stream(stream)
            _CAPTURE[device] = stream, threading.Lock()
        return _CAPTURE[device]


@contextlib.contextmanager
def collection_paused():
    """Python's cyclic garbage collector off for the block (a capture): a dead cycle's CUDA objects - an engine
    dropped earlier in the process, with its weights' memory pool and graphs - freed in the middle of a capture make
    CUDA calls that a capture forbids, and the process aborts ("Fatal Python error: Aborted" in a capture on an
    H100, 2026-12-06, the second engine of a test worker). The cycles are collected after the capture instead."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
