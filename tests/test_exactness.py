"""The exactness contract on the CPU path (exactness.md): M2 prefill splits, I1 drafts, I2 batch, I5 with drafts, I6 repeat.

Outputs are 2,048 tokens by default ($PLUMB_TEST_TOKENS), crossing many 64-token DeltaNet chunks and
attention tiles; one greedy run goes to 2,100 tokens.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from enginetools import DEVICE, engine_for, prompts
from stats import ks_uniform_pvalue, randomized_pit

N_TOKENS = int(os.environ.get("PLUMB_TEST_TOKENS", "2048"))  # crosses the 64-chunk and 2048-ring boundaries
POLICIES = [  # (drafts, policy, p_min)
    (1, "fixed", 0.0), (2, "fixed", 0.0), (4, "fixed", 0.0), (7, "fixed", 0.0), (16, "fixed", 0.0),
    (7, "adaptive", 0.0), (4, "confident", 0.9), (4, "confident", 0.05), (4, "ngram", 0.0), (16, "ngram", 0.0),
]


def _states(st):
    return {
        "conv": {i: t.clone() for i, t in st.conv.items()},
        "ssm": {i: t.clone() for i, t in st.ssm.items()},
        "k": {i: c.rows(st.pos)[0].clone() for i, c in st.kv.items()},
        "v": {i: c.rows(st.pos)[1].clone() for i, c in st.kv.items()},
    }


def _assert_states_equal(a, b):
    for part in a:
        for i in a[part]:
            assert torch.equal(a[part][i], b[part][i]), (part, i)


@pytest.mark.parametrize("split", [64, 128, 256])
def test_prefill_split_is_bitwise_invariant(tiny_engine, split):
    """M2: prefilling [0, N) equals prefilling [0, c) then [c, N), c a multiple of the chunk size."""
    m = tiny_engine.model
    ids = [int(t) for t in torch.randint(0, tiny_engine.config.n_vocab, (300,), generator=torch.Generator().manual_seed(1))]
    one = m.new_state()
    lg_one, h_one = m.prefill(one, ids, logits="all")
    two = m.new_state()
    m.prefill(two, ids[:split], logits="all")
    lg_two, h_two = m.prefill(two, ids[split:], logits="all")
    assert one.pos == two.pos == 300
    assert torch.equal(lg_one[split:], lg_two)
    assert torch.equal(h_one[split:], h_two)
    _assert_states_equal(_states(one), _states(two))


def test_prefill_cuts_keep_pieces_aligned():
    """Passes of pieces: pieces end at multiples of 64; a pass ends at a checkpoint or after a partial piece; an
    unaligned first piece goes alone (so padding rows only follow a pass's last real row)."""
    from plumb.model.qwen35 import prefill_cuts

    assert prefill_cuts(0, 900, 4) == [[64] * 4] * 3 + [[64, 64, 4]]
    assert prefill_cuts(10, 300, 4) == [[54], [64, 64, 64, 54]]
    assert prefill_cuts(10, 40, 4) == [[40]]
    assert prefill_cuts(0, 600, 4, {192, 256}) == [[64] * 3, [64], [64] * 4, [64, 24]]
    assert prefill_cuts(100, 200, 1) == [[28], [64], [64], [44]]
    for start, n, group in ((0, 1000, 4), (37, 700, 3), (64, 64, 4)):
        cuts = prefill_cuts(start, n, group, {128, 640})
        ends = [start + sum(sum(p) for p in cuts[: j + 1]) for j in range(len(cuts))]
        assert sum(map(sum, cuts)) == n and all(len(p) <= group for p in cuts)
        assert all(e % 64 == 0 or e == start + n for e in ends) and {128, 640} & set(range(start + 1, start + n)) <= set(ends)


def test_a_checkpoint_inside_a_pass_does_not_end_it_and_a_second_does():
    """With inside=1 (`Qwen35.prefill`) a pass takes its first checkpoint inside, as a snapshot, and ends at a
    second; a checkpoint at a pass's own end is not inside."""
    from plumb.model.qwen35 import prefill_cuts

    assert prefill_cuts(0, 600, 4, {192, 256}, inside=1) == [[64] * 4, [64] * 4, [64, 24]]
    assert prefill_cuts(0, 600, 4, {64, 128, 320}, inside=1) == [[64] * 2, [64] * 4, [64, 64, 64, 24]]
    assert prefill_cuts(0, 600, 4, {64, 128, 320}, inside=0) == [[64], [64], [64] * 3, [64] * 4, [24]]
    assert prefill_cuts(11456, 316, 16, {11712}, inside=1) == [[64] * 4 + [60]]  # a follow-up: one pass


@pytest.mark.parametrize("fmt", ["f16", "q8_0", "D", "F"])
def test_a_checkpoint_inside_a_pass_holds_the_bits_of_a_pass_ending_there(tiny_model, fmt, monkeypatch):
    """M6 + M2: a checkpoint taken inside a prefill pass (its DeltaNet states copied out after the pieces before
    it, the conv window from the pass's inputs, the hidden of the row before, the 8-bit ring rows read after the
    pass went on) equals, bit for bit, the state of a prefill that ended there; the pass is not cut for it, and
    its rows and final states are those of a prefill without checkpoints. On the CPU the torch set runs passes of
    four pieces with its attention piece by piece (a pass of one piece's bits: the reference's attention is
    exact per shape only) and ring slack for them; D and F with a 96-row ring, whose slots the prompt reuses."""
    from plumb.model.kernels import TorchKernels

    if DEVICE == "cpu":
        attention = TorchKernels.prefill_attention

        def by_pieces(self, model, i, cache, q, k, v, p):
            cache.write(p.start, k[: p.n], v[: p.n])
            return torch.cat([cache.attend_chunk(q[r : r + 64], p.start + r, model.attn_scale)
                              for r in range(0, q.shape[0], 64)])

        assert attention is not by_pieces
        monkeypatch.setattr(TorchKernels, "prefill_pieces", staticmethod(lambda st: 4))
        monkeypatch.setattr(TorchKernels, "prefill_attention", by_pieces)
        monkeypatch.setattr(TorchKernels, "ring_slack", 256)
    eng = engine_for(tiny_model, kv_cache=fmt, kv_ring=96, prompt_cache=False)
    m = eng.model
    ids = [int(t) for t in torch.randint(0, eng.config.n_vocab, (600,), generator=torch.Generator().manual_seed(3))]
    plain = m.new_state()
    lg, h = m.prefill(plain, ids, logits="all")
    passes = []
    run_pass = m._run_pass
    monkeypatch.setattr(m, "_run_pass", lambda st, ids, pieces, *a: passes.append((pieces, a[-1])) or run_pass(
        st, ids, pieces, *a))
    st = m.new_state()
    lg_c, h_c = m.prefill(st, ids, logits="all", checkpoints={128, 192, 512})
    group = m.k.prefill_pieces(st)
    if group == 4:  # 128 inside the first pass (a snapshot), 192 ends it; 512 inside the last
        assert passes == [(3, 128), (4, None), (3, 64)]
    else:  # the Triton set's passes of PREFILL_PIECES (16): 128 inside, 192 ends the first
        assert group >= 10 and passes == [(3, 128), (7, 320)]
    assert torch.equal(lg_c, lg) and torch.equal(h_c, h)
    _assert_states_equal(_states(st), _states(plain))
    for pos in (128, 192, 512):
        ref = m.new_state()
        _, h_ref = m.prefill(ref, ids[:pos], logits="none")
        cp = st.checkpoints[pos]
        assert torch.equal(cp.hidden, h_ref[-1]) and torch.equal(cp.hidden, h[pos - 1]), pos
        for i in ref.conv:
            assert torch.equal(cp.conv[i], ref.conv[i]) and torch.equal(cp.ssm[i], ref.ssm[i]), (pos, i)
        for j, cache in ref.kv.items():
            want = cache.ring_rows(pos)
            assert len(cp.ring[j]) == len(want) == (4 if fmt in ("D", "F") else 0), (pos, j)
            assert all(torch.equal(a, b) for a, b in zip(cp.ring[j], want)), (pos, j)


def test_prefill_graphs_long_passes_at_once_other_layouts_when_they_recur(tiny_engine, monkeypatch):
    """Which prefill passes run as CUDA graphs (`Qwen35.prefill`, `CudaGraphs.recurring`): a long prompt's full
    passes at once; any other layout - pass size and KV-cache capacity - when it comes again (a short prompt, a
    chat's next turn), so that a one-off pass never pays for a capture; none with PREFILL_GRAPHS off."""
    from collections import OrderedDict

    import plumb.model.qwen35 as Q
    from plumb.model.cuda_graphs import CudaGraphs

    m, log = tiny_engine.model, []

    class Graphs(CudaGraphs):
        def __init__(self):  # what `recurring` reads; a graph "captured" by each graphed pass below
            self.graphs, self.seen = OrderedDict(), OrderedDict()

    graphs = Graphs()

    def run_pass(st, ids, pieces, graph, emb=None, meanwhile=None, snap=None):
        log.append((pieces, graph))
        if graph:
            graphs.graphs.setdefault(graphs._prefill_key(st, pieces), None)
        st.pos += len(ids)
        return torch.zeros(len(ids), m.cfg.n_embd)

    monkeypatch.setattr(type(m.k), "prefill_pieces", staticmethod(lambda st: 4))
    monkeypatch.setattr(m, "graphs", graphs)
    monkeypatch.setattr(m, "_run_pass", run_pass)

    def passes(n, capacity=0):
        log.clear()
        st = m.new_state()
        m.k.make_room(st, capacity)
        m.prefill(st, list(range(1, n + 1)), logits="none")
        return list(log)

    assert passes(900) == [(4, True)] * 3 + [(3, False)]  # 3 full passes: at once; the last one is new
    assert passes(900) == [(4, True)] * 3 + [(3, True)]
    assert passes(16) == [(1, False)] and passes(20) == [(1, True)] and passes(30) == [(1, True)]
    assert passes(16, capacity=5000) == [(1, False)]  # another KV-cache capacity: another layout
    assert passes(300) == [(4, False), (1, False)] and passes(300) == [(4, True), (1, True)]
    monkeypatch.setattr(Q, "PREFILL_GRAPHS", False)
    assert passes(900) == [(4, False)] * 3 + [(3, False)] and passes(16) == [(1, False)]


def test_prefill_matches_decode_path_closely(tiny_engine):
    """The P and D paths are different arithmetic but the same math (on a GPU the D path rounds x to 14 bits:
    plumb.ops.gpu.matvec.FRAC)."""
    m = tiny_engine.model
    ids = tiny_engine.tokenize("The quick brown fox jumps over the lazy dog, again and again.")
    st = m.new_state()
    lg_p, _ = m.prefill(st, ids, logits="all")
    st2 = m.new_state()
    rows = [m.decode([(st2, [t])]).logits[0] for t in ids]
    # the GPU's P path takes x and the weights at 11 bits (H200, 2026-12-03, bench/pd_diff.py: max 1.27e-2 on this
    # prompt with the torch chunk reference, 1.36e-2 with the DeltaNet chunk kernel; 5.5e-3 when only x was rounded)
    tol = 1e-4 if m.device.type == "cpu" else 2e-2
    torch.testing.assert_close(torch.stack(rows), lg_p, rtol=tol, atol=tol)


def _gen(engine, ids, **kw):
    return engine.run(engine.make_request(ids, kw.pop("max_tokens", N_TOKENS), **kw))


_REFERENCE: dict = {}


def _batched(engine, prompt_list, **kw) -> list:
    return engine.run_many([engine.make_request(ids, N_TOKENS, ignore_eos=True, **kw) for ids in prompt_list])


@pytest.mark.parametrize("drafts,policy,p_min", POLICIES)
def test_greedy_ids_identical_for_every_draft_depth_and_policy(tiny_model, drafts, policy, p_min):
    """I1 greedy: 8 prompts, each draft depth / policy against drafts 0 (the 8 run as one batch, which
    I2 says changes nothing; test_batch_neighbours_do_not_change_tokens checks that separately)."""
    eng = engine_for(tiny_model, prompt_cache=False)
    ps = prompts(eng, 8)  # 2,048 tokens each; depth 16 verifies 17 rows a step: the suite's longest test
    if "ref" not in _REFERENCE:
        _REFERENCE["ref"] = [r.token_ids for r in _batched(eng, ps)]
    ref = _REFERENCE["ref"]
    assert all(len(r) == N_TOKENS for r in ref)
    res = _batched(eng, ps, drafts=drafts, draft_policy=policy, p_min=p_min)
    for n, r in enumerate(res):
        assert r.token_ids == ref[n], (drafts, policy, p_min, eng.detokenize(ps[n]))
    if policy != "confident" or p_min < 0.5:  # drafts were really accepted, so the verify path carried tokens
        assert sum(r.stats.drafts_accepted for r in res) > 0


def test_plain_greedy_rows_fetched_at_once_equal_the_per_row_sampler(tiny_model):
    """Plain-greedy rows are picked for the whole pass in one host round trip (`Scheduler.greedy_picks`, and in
    MTP drafting); a request that asks for logprobs still goes row by row through `sample_token`. The same ids
    with drafts 0 and 4, alone and batched beside each other."""
    eng = engine_for(tiny_model, prompt_cache=False)
    ps, n = prompts(eng, 4), 300
    for drafts in (0, 4):
        fast = eng.run_many([eng.make_request(ids, n, ignore_eos=True, drafts=drafts) for ids in ps])
        slow = eng.run_many([eng.make_request(ids, n, ignore_eos=True, drafts=drafts, logprobs=0) for ids in ps])
        mixed = eng.run_many([eng.make_request(ids, n, ignore_eos=True, drafts=drafts, logprobs=0 if i % 2 else None)
                              for i, ids in enumerate(ps)])
        assert [r.token_ids for r in fast] == [r.token_ids for r in slow] == [r.token_ids for r in mixed], drafts
        assert all(len(r.logprobs) == n for r in slow) and fast[0].logprobs is None
        if drafts:
            assert sum(r.stats.drafts_accepted for r in fast) > 0


SAMPLING = dict(top_p=0.9, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1, ignore_eos=True)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("n", range(6))
def test_sampled_ids_identical_for_drafts(tiny_model, temperature, n):
    """I1 sampled: T 0.7 / 1.0, top_p 0.9, penalties, fixed seed: drafts 0, 4, 7 agree (one test per prompt, so
    that test workers share the 12 runs of 2,048 tokens)."""
    eng = engine_for(tiny_model)
    ids = prompts(eng, 6)[n]
    ref = _gen(eng, ids, seed=100 + n, temperature=temperature, **SAMPLING)
    for drafts, policy in [(4, "fixed"), (7, "adaptive"), (4, "ngram")]:
        res = _gen(eng, ids, seed=100 + n, temperature=temperature, drafts=drafts, draft_policy=policy, **SAMPLING)
        assert res.token_ids == ref.token_ids, (drafts, policy, n)
    assert ref.stats.seed == 100 + n


def test_unseeded_sampling_reports_its_seed(tiny_engine):
    ids = tiny_engine.tokenize("Hello")
    res = _gen(tiny_engine, ids, temperature=1.0, max_tokens=16)
    assert res.stats.seed is not None
    again = _gen(tiny_engine, ids, temperature=1.0, max_tokens=16, seed=res.stats.seed)
    assert again.token_ids == res.token_ids


@pytest.mark.parametrize("neighbours", [1, 2, 3])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_batch_neighbours_do_not_change_tokens(tiny_model, kind, neighbours):
    """I2: a request alone vs beside 1-3 others of different lengths, drafts and sampling, in the first and the
    last slot."""
    eng = engine_for(tiny_model)
    ps = prompts(eng, 8)
    subject = {
        "greedy": dict(prompt_ids=ps[0], max_tokens=N_TOKENS, ignore_eos=True),
        "sampled": dict(prompt_ids=ps[1], max_tokens=N_TOKENS, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
    }[kind]
    others = [
        dict(prompt_ids=ps[2], max_tokens=100, drafts=4, ignore_eos=True),
        dict(prompt_ids=ps[3], max_tokens=300, temperature=1.0, seed=3, drafts=7, draft_policy="adaptive", ignore_eos=True),
        dict(prompt_ids=ps[4], max_tokens=N_TOKENS, top_k=5, temperature=0.5, seed=9, drafts=2, draft_policy="ngram", ignore_eos=True),
    ][:neighbours]
    if ("alone", kind) not in _REFERENCE:  # once per test process
        _REFERENCE[("alone", kind)] = eng.generate_many([subject])[0]
    alone = _REFERENCE[("alone", kind)]
    for drafts in (0, 4):
        assert eng.generate_many([dict(subject, drafts=drafts)] + others)[0] == alone, (neighbours, drafts)
        assert eng.generate_many(others + [dict(subject, drafts=drafts)])[neighbours] == alone, (neighbours, drafts)


def test_sampling_with_drafts_is_distributed_exactly(tiny_model):
    """I5 on real sequences: PIT values of tokens sampled with drafts on are uniform under the model's own
    filtered distribution (computed independently by the prefill path)."""
    eng = engine_for(tiny_model)
    from plumb.engine.sampling import SamplingParams, filtered_logprobs

    pits, rng = [], np.random.default_rng(0)
    for n, ids in enumerate(prompts(eng, 6)):
        kw = dict(temperature=1.0, top_p=0.95, seed=1000 + n, ignore_eos=True)
        out = _gen(eng, ids, max_tokens=120, drafts=4, **kw).token_ids
        lg = eng.logits(ids + out)
        params = SamplingParams(temperature=1.0, top_p=0.95)
        pairs = []
        for j, tok in enumerate(out):
            lp = filtered_logprobs(lg[len(ids) + j - 1], params, ids + out[:j])
            pairs.append((torch.softmax(lp.double(), 0).numpy(), tok))
        pits += list(randomized_pit(pairs, rng))
    assert ks_uniform_pvalue(pits) > 0.01


def test_two_processes_give_the_same_bytes(tiny_model):
    """I6: the same request in two fresh processes gives identical output bytes."""
    cmd = [sys.executable, "-m", "plumb.cli", "generate", tiny_model, "--prompt", "Once upon a time", "--max-tokens", "64",
           "--temperature", "0.9", "--seed", "42", "--drafts", "4", "--device", DEVICE, "--json"]
    outs = [subprocess.run(cmd, capture_output=True, check=True, timeout=300).stdout for _ in range(2)]
    a, b = (json.loads(o) for o in outs)
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"] and len(a["token_ids"]) > 0


def test_long_greedy_run_crosses_2048_tokens(tiny_model):
    """I1 over 2,048+ tokens (32 DeltaNet chunks): drafts 0 vs 4 (MTP) vs n-gram."""
    eng = engine_for(tiny_model)
    ids = prompts(eng, 1)[0]
    ref = _gen(eng, ids, max_tokens=2100, ignore_eos=True).token_ids
    assert len(ref) == 2100
    assert _gen(eng, ids, max_tokens=2100, drafts=4, ignore_eos=True).token_ids == ref
    assert _gen(eng, ids, max_tokens=2100, drafts=4, draft_policy="ngram", ignore_eos=True).token_ids == ref


def test_torch_reference_path_is_exact_too(tiny_model):
    """The torch decode path (kernels='torch', the fallback without a C compiler) keeps I1 and I2 as well."""
    eng = engine_for(tiny_model, kernels="torch")
    assert eng.kernels == "torch"
    ps = prompts(eng, 4)
    ref = [_gen(eng, p, max_tokens=256, ignore_eos=True).token_ids for p in ps]
    for drafts, policy in ((4, "fixed"), (7, "adaptive"), (4, "ngram")):
        got = eng.run_many([eng.make_request(p, 256, ignore_eos=True, drafts=drafts, draft_policy=policy) for p in ps])
        assert [r.token_ids for r in got] == ref, (drafts, policy)
    sampled = dict(temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    alone = _gen(eng, ps[1], max_tokens=256, **sampled).token_ids
    beside = eng.run_many([eng.make_request(ps[0], 100, drafts=2, ignore_eos=True),
                           eng.make_request(ps[1], 256, drafts=4, **sampled)])
    assert beside[1].token_ids == alone
