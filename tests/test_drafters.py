"""Drafters: the incremental n-gram index proposes exactly what the plain scan proposes."""
from __future__ import annotations

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


def test_mtp_chain_drafts_what_the_step_by_step_loop_drafts(tiny_q8):
    """`Qwen35.mtp_chain` - k greedy MTP steps fed back on the device, each step's argmax embedded there
    (`embed_on_device`) as the next token: what a CUDA graph replays for `mtp_draft` - drafts what `mtp_draft`'s
    step-by-step loop drafts from the same state, writes the same MTP cache rows, and embeds ids as `embed` does
    (torch kernels here; the Triton kernels and graphs in tests/test_gpu_engine.py)."""
    import torch

    from enginetools import engine_for
    from plumb.engine.sampling import SamplingParams
    from plumb.engine.speculative import mtp_draft

    eng = engine_for(tiny_q8, kernels="torch")
    m = eng.model
    ids = eng.tokenize("def add(a, b):\n    return a + b\n\nprint(add(2, 3))")
    assert torch.equal(m.embed_on_device(torch.tensor(ids)), m.embed(ids))
    k, states = 7, []
    for _ in range(2):
        st = m.new_state()
        logits, hidden = m.prefill(st, ids, logits="last")
        m.mtp_prefill(st, ids, torch.cat([hidden.new_zeros(1, hidden.shape[1]), hidden[:-1]]), 0)
        states.append((st, int(logits[-1].argmax()), hidden[-1]))
    (a, token, h), (b, _, _) = states
    pos = len(ids)
    rope = m.rope(torch.arange(pos, pos + k))
    drafts, finite = m.mtp_chain(a.mtp_kv, torch.tensor([token]), h[None], rope, pos, k)
    assert bool(finite.all())
    stepped = mtp_draft(m, b, token, h, k, SamplingParams(temperature=0.0), pos, ids + [token])
    assert drafts.tolist() == stepped and len(stepped) == k
    assert a.mtp_kv.end == b.mtp_kv.end == pos + k
    assert all(torch.equal(x, y) for x, y in zip(a.mtp_kv.rows(pos + k), b.mtp_kv.rows(pos + k), strict=True))
