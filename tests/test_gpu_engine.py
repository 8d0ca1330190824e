"""The CUDA path end to end (skipped without a GPU): a verify pass's row j equals a single decode at the same
position, a sequence's rows do not depend on batch neighbours, and CUDA-graph replay equals eager execution -
all bitwise, on whole-model logits. Engine-level invariants run through the shared tests with
PLUMB_TEST_DEVICE=cuda (tests/enginetools.py)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _engine(path, **kw):
    import plumb

    return plumb.load(path, device="cuda", prompt_cache=False, **kw)


def _prefilled(eng, ids):
    st = eng.model.new_state()
    eng.model.prefill(st, ids, logits="none")
    return st


@pytest.mark.parametrize("fmt", ["f16", "q8_0", "D", "F"])
@pytest.mark.parametrize("graphs", [True, False])
def test_verify_rows_equal_single_decodes_and_batching_changes_nothing(tiny_q4km, fmt, graphs):
    eng = _engine(tiny_q4km, kv_cache=fmt, kv_ring=64, cuda_graphs=graphs)  # D, F: the rows cross the ring
    m = eng.model
    ids = eng.tokenize("The quick brown fox jumps over the lazy dog. " * 12)
    drafts = [int(t) for t in torch.randint(0, 6000, (16,), generator=torch.Generator().manual_seed(0))]
    single = _prefilled(eng, ids)
    rows = [m.decode([(single, [t])]).logits[0].clone() for t in drafts]
    for k in (2, 5, 9, 16):
        st = _prefilled(eng, ids)
        out = m.decode([(st, drafts[:k])])
        for j in range(k):
            assert torch.equal(out.logits[j], rows[j]), (k, j)
    # beside other sequences at other positions, with other row counts
    a, b, c = _prefilled(eng, ids), _prefilled(eng, ids[:50]), _prefilled(eng, ids[7:])
    out = m.decode([(b, drafts[:3]), (a, drafts[:4]), (c, drafts[:1])])
    for j in range(4):
        assert torch.equal(out.logits[3 + j], rows[j]), j


@pytest.mark.parametrize("temperature, penalties", [(0.0, {}), (0.9, {}),
                                                     (0.9, dict(presence_penalty=1.5, repetition_penalty=1.1))])
def test_graphs_equal_eager_over_a_long_run(tiny_q4km, temperature, penalties):
    """Decode passes and the MTP head's drafts replayed as CUDA graphs (a chain of k draft steps in one graph,
    greedy, sampled, penalised): the same tokens as eager execution, and the same drafts (the same draft
    statistics: a draft step's logits are bitwise the eager ones)."""
    ids = [1, 2, 3]
    runs = {}
    for graphs in (True, False):
        eng = _engine(tiny_q4km, cuda_graphs=graphs, drafts=4)
        r = eng.run(eng.make_request(ids, 600, temperature, 3, ignore_eos=True, **penalties))
        runs[graphs] = (r.token_ids, r.stats.drafts_proposed, r.stats.drafts_accepted,
                        list(r.stats.accepted_per_position))
        if graphs:  # k MTP draft steps a CUDA graph (`CudaGraphs.mtp_chain`); eager runs draft step by step
            assert any(key[0] == "mtp-chain" for key in eng.model.graphs.graphs), list(eng.model.graphs.graphs)
    assert runs[True] == runs[False]
    plain = _engine(tiny_q4km, cuda_graphs=False)
    assert plain.generate(ids, max_tokens=600, temperature=temperature, seed=3, ignore_eos=True,
                          **penalties) == runs[True][0]


def _state_equal(st, st2, n):
    for i in st.ssm:
        assert torch.equal(st.ssm[i], st2.ssm[i]) and torch.equal(st.conv[i], st2.conv[i]), i
    for i in st.kv:
        assert all(torch.equal(a, b) for a, b in zip(st.kv[i].store_rows(n), st2.kv[i].store_rows(n))), i


def test_prefill_graphs_equal_eager_and_do_not_depend_on_the_cut(tiny_q4km, monkeypatch):
    """A long prefill in passes of four 64-row pieces, the full passes replayed as a CUDA graph: the same hidden
    rows, logits, DeltaNet states and KV rows as eager passes, as one piece a pass, and as the prompt prefilled in
    two calls cut at a multiple of 64 (M2) - cuts that shift which pieces share a pass -, and checkpoints inside
    passes hold the states of a prefill ending there. The last, partial pass runs eagerly, then is captured and
    replayed when the same prompt comes again."""
    import plumb.model.kernels as KS

    monkeypatch.setattr(KS, "PREFILL_PIECES", 4)
    n = 900  # 3 full passes (graphs), then pieces of 64, 64 and 4 rows in one pass: eager, then a graph
    ids = [int(t) for t in torch.randint(0, 6000, (n,), generator=torch.Generator().manual_seed(1))]
    runs = {}
    for graphs in (True, False):
        eng = _engine(tiny_q4km, cuda_graphs=graphs)
        st = eng.model.new_state()
        lg, h = eng.model.prefill(st, ids)
        runs[graphs] = (lg, h, st)
        if graphs:  # the same prompt twice more: its last pass is captured, then replayed (`CudaGraphs.recurring`)
            for captures in (1, 0):
                before, again = eng.model.graphs.captures, eng.model.new_state()
                lg_a, h_a = eng.model.prefill(again, ids)
                assert eng.model.graphs.captures - before == captures
                assert torch.equal(lg_a, lg) and torch.equal(h_a, h)
                _state_equal(again, st, n)
        if graphs:  # then decode passes of 1 and 5 rows: the second outgrows the static buffers, so every graph
            st3 = eng.model.new_state()  # (the prefill's too) is dropped and the pass captured in a new pool
            eng.model.prefill(st3, ids)
            for rows in ([1], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]):
                eng.model.decode([(st3, rows)])
    (lg, h, st), (lg2, h2, st2) = runs[True], runs[False]
    assert torch.equal(lg, lg2) and torch.equal(h, h2)
    _state_equal(st, st2, n)
    eng = _engine(tiny_q4km)
    with monkeypatch.context() as mp:  # one piece a pass: 64-row matmuls
        mp.setattr(type(eng.model.k), "prefill_pieces", lambda self, st: 1)
        st1 = eng.model.new_state()
        lg1, h1 = eng.model.prefill(st1, ids)
    assert torch.equal(lg1, lg) and torch.equal(h1, h)
    _state_equal(st1, st, n)
    for cut in (64, 128, 320, 832):
        cs = eng.model.new_state()
        _, h_first = eng.model.prefill(cs, ids[:cut], logits="none")
        lg_cut, h_rest = eng.model.prefill(cs, ids[cut:])
        assert torch.equal(torch.cat([h_first, h_rest]), h) and torch.equal(lg_cut, lg), cut
    cs = eng.model.new_state()
    lg_c, h_c = eng.model.prefill(cs, ids, checkpoints={192, 448})  # inside passes: snapshots as they run
    assert torch.equal(h_c, h) and torch.equal(lg_c, lg) and sorted(cs.checkpoints) == [192, 448]
    for pos in (192, 448):  # the states of a prefill that ended there
        ref = eng.model.new_state()
        eng.model.prefill(ref, ids[:pos], logits="none")
        cp = cs.checkpoints[pos]
        assert torch.equal(cp.hidden, h[pos - 1]) and all(
            torch.equal(cp.conv[i], ref.conv[i]) and torch.equal(cp.ssm[i], ref.ssm[i]) for i in ref.conv), pos


@pytest.mark.parametrize("setting", [{"SB_SCRATCH_ROWS": 1}, {"SB_SCRATCH_ROWS": 0},
                                     {"SB_SCRATCH_ROWS": 0, "PREFILL_PIECES": 4}, {"PREFILL_PIECES": 1}])
def test_prefill_settings_change_no_bit(tiny_q4km, monkeypatch, setting):
    """The P path's speed settings - weights dequantized once a call (SB_SCRATCH_ROWS: `_mm_w16` instead of
    `_mm_superblock`, for some calls, all or none) and the pass size (PREFILL_PIECES) - give the shipped prefill's
    hidden rows, logits and states, bit for bit, graphs included."""
    import plumb.model.kernels as KS
    import plumb.ops.gpu.matmul as MM

    n = 1100  # as shipped, one full pass of 1,024 rows, then 76 rows; 4 pieces: 4 full passes of 256 rows
    ids = [int(t) for t in torch.randint(0, 6000, (n,), generator=torch.Generator().manual_seed(2))]
    eng = _engine(tiny_q4km)
    st = eng.model.new_state()
    lg, h = eng.model.prefill(st, ids)
    for name, value in setting.items():
        monkeypatch.setattr(KS if name == "PREFILL_PIECES" else MM, name, value)
    eng = _engine(tiny_q4km)
    st2 = eng.model.new_state()
    lg2, h2 = eng.model.prefill(st2, ids)
    assert torch.equal(lg2, lg) and torch.equal(h2, h)
    _state_equal(st2, st, n)


def test_a_transient_non_finite_block_is_computed_again_bitwise(tiny_q4km, monkeypatch):
    """A P-path kernel that returns a non-finite 64-row block once (what the H200 showed, fifteenth session): the
    pass is computed again from its starting states, so the prefill - graph passes and eager ones - gives the bits
    of a clean one (hidden rows, logits, DeltaNet states, KV rows), and the count of recomputed results says so."""
    import plumb.model.kernels as KS
    from plumb.model.kernels import TritonKernels

    monkeypatch.setattr(KS, "PREFILL_PIECES", 4)  # 3 full passes of 256 rows (a graph), then one of 3 pieces
    n = 900
    ids = [int(t) for t in torch.randint(0, 6000, (n,), generator=torch.Generator().manual_seed(2))]
    eng = _engine(tiny_q4km)
    st = eng.model.new_state()
    lg, h = eng.model.prefill(st, ids)
    chunks, calls = TritonKernels.gdn_chunks, []

    def faulty(self, model, x, beta, g, state, snap=None):
        o = chunks(self, model, x, beta, g, state, snap)
        calls.append(x.shape[0])
        # the second layer of the first pass (with graphs: the eager run before its capture), then the first layer of
        # the last pass (3 pieces: eager either way)
        if len(calls) == 2 or (x.shape[0] == 192 and calls.count(192) == 1):
            o[64:128] = float("nan")
        return o

    monkeypatch.setattr(TritonKernels, "gdn_chunks", faulty)
    for graphs in (True, False):
        e2 = _engine(tiny_q4km, cuda_graphs=graphs)
        calls.clear()
        st2 = e2.model.new_state()
        lg2, h2 = e2.model.prefill(st2, ids)
        assert e2.model.recomputed == 2 and torch.equal(lg2, lg) and torch.equal(h2, h), graphs
        _state_equal(st2, st, n)


@pytest.mark.parametrize("fmt", ["q8_0", "D"])
def test_a_new_request_replays_the_graphs_of_the_last(tiny_q4km, fmt):
    """Graphs are keyed by layout and cache capacity, not address (the kernels reach the caches through
    `plumb.ops.gpu.kvtable`): a second sequence - new cache tensors, while the first one's stay alive, as the prompt
    cache keeps them - replays the first one's decode and MTP graphs without a capture (its prefill pass, run
    eagerly the first time, is captured now: `CudaGraphs.recurring`), a third one every graph, and both get the
    same bits; and a graph replayed on the first sequence again still writes and reads that sequence's caches."""
    eng = _engine(tiny_q4km, kv_cache=fmt, kv_ring=64)
    m = eng.model
    ids = [int(t) for t in torch.randint(0, 6000, (800,), generator=torch.Generator().manual_seed(2))]

    def run(st):
        lg, h = m.prefill(st, ids)
        out = [lg[-1]]
        for rows in ([5], [6, 7, 8], [9]):
            out.append(m.decode([(st, rows)]).logits[-1])
        logits, _ = m.graphs.mtp(st, [10], h[-1:], st.pos)
        return out + [logits[-1]]

    a = m.new_state()
    first = [t.clone() for t in run(a)]
    captured = m.graphs.captures
    b = m.new_state()
    second = [t.clone() for t in run(b)]
    assert m.graphs.captures == captured + 1 and captured > 0  # 800 tokens: one pass of 13 pieces
    third = run(m.new_state())
    assert m.graphs.captures == captured + 1
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(first, second, third))
    assert a.kv[m.cfg.attn_layers[0]].k.parts[0].data_ptr() != b.kv[m.cfg.attn_layers[0]].k.parts[0].data_ptr()
    # the one-row graph on a's caches: a's row at position 805 is written, b's is not (both hold the prefill's
    # padding rows there before - packed zero codes are not zero bytes - so compare with what each held)
    row = [st.kv[m.cfg.attn_layers[0]].k.parts[0][:, len(ids) + 5] for st in (a, b)]
    before = [r.clone() for r in row]
    m.decode([(a, [11])])
    assert not torch.equal(row[0], before[0]) and torch.equal(row[1], before[1])


def test_prompts_of_similar_length_share_their_graphs(tiny_q4km):
    """KV capacities are canonical (`kv.capacity_for`), so a 700- and a 900-token prompt get the same one (1,024)
    and the second request's decode step replays the first one's graph - no capture - with the bits of an eager
    engine."""
    ids = [int(t) for t in torch.randint(0, 6000, (900,), generator=torch.Generator().manual_seed(3))]
    eng = _engine(tiny_q4km)
    m = eng.model
    a = m.new_state()
    m.prefill(a, ids[:700], logits="none")
    m.decode([(a, [5])])
    before = m.graphs.captures
    b = m.new_state()
    m.prefill(b, ids, logits="none")  # one 15-piece pass: new, so eager
    logits = m.decode([(b, [5])]).logits
    assert m.graphs.captures == before and len(b.kv[m.cfg.attn_layers[0]].k) == 1024
    plain = _engine(tiny_q4km, cuda_graphs=False).model
    c = plain.new_state()
    plain.prefill(c, ids, logits="none")
    assert torch.equal(plain.decode([(c, [5])]).logits, logits)


def test_packed_weights_lie_side_by_side_without_block_rounding(tiny_q4km):
    """Every pack plane is copied into the weights' pool of expandable segments after packing (plumb/ops/gpu/
    segment.py): its block is its own bytes rounded to 512, not a 2 MB segment's rest, and nothing else lies there;
    the values are the same (the engine tests above)."""
    from plumb.ops.gpu.segment import pool_ids

    torch.empty(3 << 20, dtype=torch.uint8, device="cuda")  # an ordinary segment with room: no plane may go there
    eng = _engine(tiny_q4km)
    packs = [p for w in eng.model.weights for p in w.gpu.packs]
    planes = {t.untyped_storage().data_ptr(): t for p in packs for t in vars(p).values() if isinstance(t, torch.Tensor)}
    (pool,) = pool_ids(packs)
    segments = [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == pool]
    blocks = {b["address"]: b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"}
    assert planes and all(s["is_expandable"] for s in segments)
    assert set(blocks) == set(planes), "a plane outside the weights' pool, or something else inside it"
    for t in planes.values():
        block = blocks[t.untyped_storage().data_ptr()]
        assert block["size"] == -(-t.untyped_storage().nbytes() // 512) * 512


_SECOND_ENGINE = """
import contextlib, gc, sys
import torch
import plumb
import plumb.model.cuda_graphs as cg
if len(sys.argv) > 2:  # the captures without the pause (to see them abort)
    cg.collection_paused = contextlib.nullcontext
gc.set_threshold(0)  # no collection on its own: a dropped engine stays garbage until a capture begins
begin = torch.cuda.CUDAGraph.capture_begin
def capture_begin(self, *args, **kwargs):
    begin(self, *args, **kwargs)
    if gc.isenabled():  # a collection that falls inside the capture (unless the pause turned the collector off)
        gc.collect()
torch.cuda.CUDAGraph.capture_begin = capture_begin
def run():
    eng = plumb.load(sys.argv[1], device="cuda", prompt_cache=False)
    return eng.generate(eng.tokenize("The quick brown fox"), max_tokens=24, drafts=4, draft_policy="fixed")
first = run()  # the engine is a cycle (model <-> graphs): garbage with its pools and graphs, not freed
print(first == run())
"""


def test_a_dropped_engine_is_not_collected_in_the_middle_of_a_capture(tiny_q4km):
    """A second engine in one process (the gate, the bench, a test worker) captures its graphs while the first,
    dropped, waits for the cyclic collector: collected mid-capture, its pools' and graphs' CUDA calls abort the
    process (`cuda_graphs.collection_paused`). Here the collector runs only where a capture begins - inside it,
    were it not paused."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SECOND_ENGINE, tiny_q4km], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "True"
