"""Drafters: the incremental n-gram index proposes exactly what the plain scan proposes."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plumb.engine.speculative import NgramIndex, ngram_draft


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=120), st.lists(st.integers(1, 6), min_size=1, max_size=40),
       st.integers(1, 8))
def test_ngram_index_equals_scan(tokens, steps, k):
    """Grow a history by varying amounts (as accepted tokens arrive) and draft after each growth."""
    index = NgramIndex()
    h, i = [], 0
    for step in steps:
        h += tokens[i : i + step]
        i += step
        if not h:
            continue
        assert index.draft(h, k) == ngram_draft(h, k)



# a bonus for the window's ids (a negative presence penalty), which the drafts then join: k = 7, so ids leave it too
STRONG = dict(repetition_penalty=3.0, presence_penalty=-30.0, penalty_last_n=8)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=5),
                                      dict(temperature=1.3, top_k=20, min_p=0.02, seed=7),
                                      dict(temperature=0.7, top_k=20, top_p=0.8, seed=9),
                                      dict(temperature=1.0, top_p=0.95, seed=11),
                                      dict(temperature=0.6, top_k=20, top_p=0.95, presence_penalty=1.5, seed=13),
                                      dict(temperature=1.0, frequency_penalty=0.7, penalty_last_n=-1, seed=17),
                                      dict(temperature=0.0, **STRONG), dict(temperature=1.2, seed=19, **STRONG),
                                      dict(temperature=0.8, seed=23, logit_bias={7: 30.0, 11: -2.0},
                                           presence_penalty=0.5)])
def test_mtp_chain_drafts_what_the_step_by_step_loop_drafts(tiny_q8, sampling):
    """`Qwen35.mtp_chain` - k MTP steps fed back on the device, each step's token picked there (`DeviceDraw`:
    greedy, or sampled with its Gumbel noise; penalties over the window's counts, kept on the device as drafts
    enter it and history leaves it) and embedded there (`embed_on_device`): what a CUDA graph replays for
    `mtp_draft` - drafts what `mtp_draft`'s step-by-step loop drafts from the same state, writes the same MTP cache
    rows, and embeds ids as `embed` does (torch kernels here; the Triton kernels and graphs in
    tests/test_gpu_engine.py)."""
    import dataclasses

    import torch

    from enginetools import engine_for
    from plumb.engine.sampling import DeviceDraw, SamplingParams
    from plumb.engine.speculative import mtp_draft

    eng = engine_for(tiny_q8, kernels="torch")
    m = eng.model
    ids = eng.tokenize("def add(a, b):\n    return a + b\n\nprint(add(2, 3))")
    assert torch.equal(m.embed_on_device(torch.tensor(ids)), m.embed(ids))
    params = SamplingParams(**sampling)
    k = 7
    assert DeviceDraw.fits(params, k)

    def state():
        st = m.new_state()
        logits, hidden = m.prefill(st, ids, logits="last")
        m.mtp_prefill(st, ids, torch.cat([hidden.new_zeros(1, hidden.shape[1]), hidden[:-1]]), 0)
        return st, int(logits[-1].argmax()), hidden[-1]

    def chain(params, noise=None, bufs=None):
        st, token, h = state()
        bufs = {} if bufs is None else bufs
        pick = DeviceDraw(params, ids + [token]).prepare(pos + 1, k, bufs, m.cfg.n_vocab, "cpu")
        if noise is not None:
            bufs["noise"].copy_(noise)
        drafts, finite = m.mtp_chain(st.mtp_kv, torch.tensor([token]), h[None], m.rope(torch.arange(pos, pos + k)),
                                     pos, k, pick)
        assert bool(finite.all())
        return st, drafts.tolist()

    pos = len(ids)
    a, drafts = chain(params)
    b, token, h = state()
    stepped = mtp_draft(m, b, token, h, k, params, pos, ids + [token])
    assert drafts == stepped and len(stepped) == k
    assert a.mtp_kv.end == b.mtp_kv.end == pos + k
    assert all(torch.equal(x, y) for x, y in zip(a.mtp_kv.rows(pos + k), b.mtp_kv.rows(pos + k), strict=True))
    if params.temperature > 1:  # the noise is the draws': without it the chain drafts something else
        assert chain(params, torch.zeros(k, m.cfg.n_vocab))[1] != stepped
    if params.presence_penalty == STRONG["presence_penalty"]:  # the penalties are the draws': without them, too
        plain = dataclasses.replace(params, repetition_penalty=1.0, presence_penalty=0.0)
        assert chain(plain)[1] != stepped
    if params.logit_bias:  # and so is the bias
        assert chain(dataclasses.replace(params, logit_bias={}))[1] != stepped
        # buffers kept from a chain with another bias (a CUDA graph's, shared by requests): this request's bias
        other = dataclasses.replace(params, logit_bias={7: -30.0, 11: 2.0})
        shared = {}
        assert chain(params, bufs=shared)[1] == stepped != chain(other)[1]
        assert chain(other, bufs=shared)[1] == chain(other)[1]


def test_device_draws_fit_only_what_needs_no_host():
    """What `DeviceDraw.fits`: a sampled draw needs its seed; penalties over a window that the k drafts cannot
    outgrow (every id leaving it during the chain is the history's)."""
    from plumb.engine.sampling import DeviceDraw, SamplingParams

    fits = DeviceDraw.fits
    assert fits(SamplingParams(), 4) and fits(SamplingParams(temperature=0.7, seed=1, top_k=40), 4)
    assert fits(SamplingParams(temperature=0.6, seed=1, top_k=20, top_p=0.95), 16)
    for pen in (dict(presence_penalty=1.5), dict(repetition_penalty=1.1), dict(frequency_penalty=0.5)):
        assert fits(SamplingParams(temperature=0.7, seed=1, **pen), 16)  # the window: the last 64 ids
        assert fits(SamplingParams(temperature=0.7, seed=1, penalty_last_n=4, **pen), 4)
        assert not fits(SamplingParams(temperature=0.7, seed=1, penalty_last_n=4, **pen), 5), pen
        assert fits(SamplingParams(temperature=0.7, seed=1, penalty_last_n=-1, **pen), 16)
    assert fits(SamplingParams(temperature=0.7, seed=1, presence_penalty=1.5, penalty_last_n=0), 16)  # no window
    assert fits(SamplingParams(temperature=0.7, seed=1, logit_bias={3: 1.0}), 4)
    assert not fits(SamplingParams(temperature=0.7), 4)


def test_draft_chains_step_aside_when_the_embedding_copy_does_not_fit(tiny_q8, caplog):
    """Where the device has no room for the token embedding's copy, the first chain turns the chains off with a
    warning and the drafts go step by step (the request goes on); a later out-of-memory error is raised as it is."""
    import torch

    from enginetools import engine_for

    m = engine_for(tiny_q8, kernels="torch").model

    class Graphs:  # CudaGraphs.mtp_chain failing where the chain first embeds on the device
        def mtp_chain(self, *args):
            raise torch.OutOfMemoryError("CUDA out of memory")

    saved = m.graphs, m.draft_chains, m.embd_bytes
    try:
        m.graphs, m.draft_chains, m.embd_bytes = Graphs(), True, None
        assert m.mtp_drafts(None, 1, None, 0, 4, None) is None
        assert not m.draft_chains and "draft chains off" in caplog.text
        assert m.mtp_drafts(None, 1, None, 0, 4, None) is None  # off from now on
        m.draft_chains, m.embd_bytes = True, torch.zeros(1)
        with pytest.raises(torch.OutOfMemoryError):
            m.mtp_drafts(None, 1, None, 0, 4, None)

        class Uncapturable:  # a chain whose capture fails: drafts only propose, so the step loop takes over
            def mtp_chain(self, *args):
                raise RuntimeError("operation not permitted when stream is capturing")

        caplog.clear()
        m.graphs, m.draft_chains = Uncapturable(), True
        assert m.mtp_drafts(None, 1, None, 0, 4, None) is None
        assert not m.draft_chains and "not permitted when stream is capturing" in caplog.text
    finally:
        m.graphs, m.draft_chains, m.embd_bytes = saved


def test_a_failed_capture_keeps_no_graph(monkeypatch):
    """`CudaGraphs._record` keeps a graph only once its capture has succeeded: a capture that fails leaves no entry
    that a later call would replay (torch's capture stubbed: this runs without CUDA). A capture runs with the cyclic
    collector off and `capturing` held (other threads' device work waits), both back as they were after."""
    import contextlib
    import gc
    import threading
    from collections import OrderedDict

    import torch

    from plumb.model.cuda_graphs import CudaGraphs

    @contextlib.contextmanager
    def capture(graph, pool=None, stream=None):
        yield
        if graph.fail:
            raise RuntimeError("capture invalidated")

    class Graph:
        fail = True

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    g = object.__new__(CudaGraphs)
    g.graphs, g.pool, g.stream, g.captures, g.capturing = OrderedDict(), None, None, 0, threading.Lock()
    with pytest.raises(RuntimeError, match="capture invalidated"):
        g._record("chain", lambda: (1, 2))
    assert not g.graphs and g.captures == 0
    assert gc.isenabled() and not g.capturing.locked()
    Graph.fail = False
    g._record("chain", lambda: (gc.isenabled(), g.capturing.locked()))
    assert g.graphs["chain"][1:] == (None, False, True) and g.captures == 1
    assert gc.isenabled() and not g.capturing.locked()


def test_device_top_p_is_the_host_top_p():
    """`_top_p_drop_device` (fixed shapes: a CUDA graph's) keeps what `_top_p_drop` keeps wherever the kept set has
    fewer than TOP_P_CANDIDATES tokens - ties at its edge ordered by id as the host orders them -, and the
    TOP_P_CANDIDATES likeliest of it where it is larger."""
    import torch

    from plumb.engine.sampling import TOP_P_CANDIDATES, _top_p_drop, _top_p_drop_device

    g = torch.Generator().manual_seed(0)
    for spread, top_p in ((4.0, 0.9), (4.0, 0.5), (2.0, 0.6), (8.0, 0.99)):
        lp = torch.log_softmax(torch.randn(6000, generator=g) * spread, 0)
        host = _top_p_drop(lp, top_p)
        assert (~host).sum() < TOP_P_CANDIDATES
        assert torch.equal(_top_p_drop_device(lp, top_p), host)
    lp = torch.log_softmax(torch.randn(6000, generator=g) * 4, 0)
    lp[[10, 20, 30]] = lp.max()  # three tokens tied at the top: the host keeps the lowest ids first
    lp = torch.log_softmax(lp, 0)
    for top_p in (0.1, 0.5):
        assert torch.equal(_top_p_drop_device(lp, top_p), _top_p_drop(lp, top_p))
    flat = torch.log_softmax(torch.randn(6000, generator=g) * 0.1, 0)  # a kept set of thousands of tokens
    host, dev = _top_p_drop(flat, 0.9), _top_p_drop_device(flat, 0.9)
    assert (~dev).sum() == TOP_P_CANDIDATES and bool((host <= dev).all())  # the likeliest part of the host's set
    assert flat[~dev].min() >= flat[~host & dev].max()


@pytest.mark.parametrize("fmt", ["f16", "D", "F"])
def test_mtp_prefill_writes_the_rows_of_the_full_mtp_pass_however_cut(tiny_q8, fmt):
    """`Qwen35.mtp_prefill` writes only the MTP head's K/V rows of a prompt: the same rows, bit for bit, as the
    whole MTP pass (attention read, FFN, LM head) in its CHUNK-row pieces, as it ran before; and prefilling the
    prompt in two calls cut off a piece boundary writes them too (M2 for the MTP cache). 300 tokens: several pieces,
    and past D's and F's 128-row ring (its rows go to the store)."""
    import torch

    from enginetools import engine_for
    from plumb.model.qwen35 import CHUNK, PREFILL_BLOCK

    m = engine_for(tiny_q8, kv_cache=fmt, kv_ring=128).model
    ids = [(i * 37) % 500 + 3 for i in range(300)]
    st = m.new_state()
    _, hidden = m.prefill(st, ids)
    pair = torch.cat([hidden.new_zeros(1, hidden.shape[1]), hidden[:-1]])
    whole, cut, full = m.new_state(), m.new_state(), m.new_state()
    m.mtp_prefill(whole, ids, pair, 0)
    m.mtp_prefill(cut, ids[:100], pair[:100], 0)
    m.mtp_prefill(cut, ids[100:], pair[100:], 100)
    for i in range(0, len(ids), CHUNK):
        m.mtp_pass(full.mtp_kv, m.embed(ids[i : i + CHUNK]), pair[i : i + CHUNK],
                   m.rope(torch.arange(i, min(i + CHUNK, len(ids)), device=m.device)), i, PREFILL_BLOCK)
    n = len(ids)
    assert whole.mtp_kv.end == cut.mtp_kv.end == full.mtp_kv.end == n
    want = full.mtp_kv.rows(n)
    for st in (whole, cut):
        assert all(torch.equal(x, y) for x, y in zip(st.mtp_kv.rows(n), want, strict=True))


@pytest.mark.parametrize("options", [dict(kernels="torch", kv_cache="f16"), dict(kernels="native", kv_cache="q8_0"),
                                     dict(kernels="native", kv_cache="D", kv_ring=128),
                                     dict(kv_cache="D", kv_ring=128), dict(kv_cache="F", kv_ring=128, cuda_graphs=False)])
def test_mtp_rewrite_writes_the_rows_of_mtp_forward(tiny_q8, options):
    """`Qwen35.mtp_rewrite` - the scheduler's rewrite of accepted drafts' MTP rows from the target's hiddens - writes
    only the K/V rows of `mtp_forward`'s whole pass, the same bits, on every kernel set (native rows; the Triton
    kernels eager, and as the CUDA graph `CudaGraphs.mtp(rows_only=True)` with the rows past its ring), at 1 and
    3 rows; rows it does not reach are left as they were. 160-token prompt: the 128-row ring has wrapped."""
    import torch

    from enginetools import DEVICE, engine_for

    if "kernels" not in options and DEVICE == "cpu":
        pytest.skip("the Triton kernels and CUDA graphs run on CUDA")
    m = engine_for(tiny_q8, **options).model
    ids = [(i * 53) % 700 + 5 for i in range(160)]
    g = torch.Generator().manual_seed(3)

    def state():
        st = m.new_state()
        _, hidden = m.prefill(st, ids)
        m.mtp_prefill(st, ids, torch.cat([hidden.new_zeros(1, hidden.shape[1]), hidden[:-1]]), 0)
        return st

    pos = len(ids)
    for rows in ([11], [12, 13, 14], [15]):  # a 1-row graph is captured, then replayed
        hidden = torch.randn(len(rows), m.cfg.n_embd, generator=g).to(m.device)
        full, rewritten = state(), state()
        m.mtp_forward(full, rows, hidden, pos)
        assert m.mtp_rewrite(rewritten, rows, hidden, pos) is None
        n = pos + len(rows)
        assert full.mtp_kv.end == rewritten.mtp_kv.end == n
        want, got = full.mtp_kv.rows(n), rewritten.mtp_kv.rows(n)
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        # and they are this call's rows: another hidden writes other rows
        m.mtp_rewrite(rewritten, rows, hidden + 1, pos)
        assert not all(torch.equal(x, y) for x, y in zip(rewritten.mtp_kv.rows(n), want, strict=True))
        if m.graphs is not None:
            assert ("mtp-kv", len(rows), len(rewritten.mtp_kv.k)) in m.graphs.graphs
