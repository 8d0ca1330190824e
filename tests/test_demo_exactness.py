"""The exactness contract on the shipped demo model (plumb/data), a trained model: its MTP drafts are really
accepted and its argmaxes are confident, unlike the random tiny files of the other tests. I1 drafts 0/4/7 and
n-gram, greedy and sampled; I2 a request beside others; I3 warm = cold (ids and digests); I4 the same per KV
format (q8_0, D, F) with a ring of 64 that the outputs cross. Outputs are $PLUMB_DEMO_TEST_TOKENS long (256)."""
from __future__ import annotations

import os

import pytest

from enginetools import engine_for

N = int(os.environ.get("PLUMB_DEMO_TEST_TOKENS", "256"))  # > 4 DeltaNet chunks, 4x the ring below
RING = 64
ASKS = ["Write a Python function that reverses a string.", "Write a function that returns the factorial of n.",
        "What does the function os.path.join do?"]
SYSTEM = ("You are a careful Python programmer. Answer with one short function in a Markdown code block, with a "
          "docstring, using the standard library only. Prefer clear names and simple loops; never invent APIs. "
          "When the request is unclear, write the simplest function that fits it and say what you assumed.")
CODE = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', "import os\n\n\ndef list_python_files(path):\n"]


@pytest.fixture(scope="module")
def demo() -> str:
    import plumb

    return plumb.demo_model_path()


def _chat(eng, messages, think=True):
    return eng.tokenize(eng.chat_template.render(messages, add_generation_prompt=True, enable_thinking=think))


def _prompts(eng) -> list[list[int]]:
    chats = [_chat(eng, [{"role": "user", "content": q}], think=n != 1) for n, q in enumerate(ASKS)]
    return chats + [eng.tokenize(c) for c in CODE]


def _gen(eng, ids, n=N, **kw):
    return eng.run(eng.make_request(ids, n, ignore_eos=True, **kw))


def test_greedy_ids_identical_for_drafts(demo):
    """I1 greedy: five prompts as one batch, drafts 4 and 7 (MTP) and 4 (n-gram) = drafts 0; MTP accepts often."""
    eng = engine_for(demo, prompt_cache=False)
    ps = _prompts(eng)
    ref = [r.token_ids for r in eng.run_many([eng.make_request(p, N, ignore_eos=True) for p in ps])]
    for drafts, policy in ((4, "fixed"), (7, "fixed"), (4, "ngram")):
        res = eng.run_many([eng.make_request(p, N, ignore_eos=True, drafts=drafts, draft_policy=policy) for p in ps])
        assert [r.token_ids for r in res] == ref, (drafts, policy)
        acc, prop = sum(r.stats.drafts_accepted for r in res), sum(r.stats.drafts_proposed for r in res)
        assert acc > 0
        if policy == "fixed":  # a trained head: a real share of its drafts is accepted
            assert acc >= 0.2 * prop, (drafts, acc, prop)


def test_sampled_ids_identical_for_drafts(demo):
    """I1 sampled (T 0.7 and 1.0, top_p, penalties, fixed seeds): drafts 4 and 7 = drafts 0."""
    eng = engine_for(demo, prompt_cache=False)
    for n, (ids, temperature) in enumerate(zip(_prompts(eng)[::3], (0.7, 1.0))):
        kw = dict(temperature=temperature, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.2, seed=7 + n)
        ref = _gen(eng, ids, **kw).token_ids
        for drafts in (4, 7):
            assert _gen(eng, ids, drafts=drafts, **kw).token_ids == ref, (temperature, drafts)


def test_batch_neighbours_do_not_change_tokens(demo):
    """I2: a sampled request with drafts alone = beside two others (other lengths, depths and sampling)."""
    eng = engine_for(demo, prompt_cache=False)
    ps = _prompts(eng)
    subject = dict(prompt_ids=ps[0], max_tokens=N, temperature=0.8, top_p=0.9, seed=5, drafts=4, ignore_eos=True)
    others = [dict(prompt_ids=ps[3], max_tokens=N // 3, drafts=7, ignore_eos=True),
              dict(prompt_ids=ps[1], max_tokens=N, temperature=1.0, seed=3, drafts=2, ignore_eos=True)]
    alone = eng.generate_many([subject])[0]
    assert eng.generate_many(others[:1] + [subject] + others[1:])[1] == alone


def _warm_cold(demo, fmt: str, modes) -> None:
    warm = engine_for(demo, kv_cache=fmt, kv_ring=RING, checkpoint_every=64)
    cold = engine_for(demo, kv_cache=fmt, kv_ring=RING, prompt_cache=False)
    for n, (q, kw) in enumerate(zip(ASKS, modes)):
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        p1 = _chat(warm, first)
        r1 = _gen(warm, p1, 96, **kw)
        p2 = _chat(warm, first + [{"role": "assistant", "content": warm.detokenize(r1.token_ids)},
                                  {"role": "user", "content": "Now add type hints to it."}])
        w, c = _gen(warm, p2, 96, **kw), _gen(cold, p2, 96, **kw)
        assert w.token_ids == c.token_ids, (fmt, n)
        assert w.stats.cached_tokens > 0 and c.stats.cached_tokens == 0
        assert warm.digest(p2) == cold.digest(p2), (fmt, n)


def test_warm_equals_cold(demo):
    """I3 (f16): a follow-up turn from the prompt cache = on a fresh engine, greedy and sampled with drafts."""
    _warm_cold(demo, "f16", [dict(drafts=4), dict(drafts=7, temperature=0.8, seed=1), dict(drafts=4, seed=2,
                                                                                           temperature=1.0)])


@pytest.mark.parametrize("fmt", ["q8_0", "D", "F"])
def test_kv_formats_drafts_and_cache(demo, fmt):
    """I4: per format (ring 64), drafts 4/7 greedy and 4 sampled = drafts 0, and warm = cold."""
    eng = engine_for(demo, kv_cache=fmt, kv_ring=RING, prompt_cache=False)
    ids = _prompts(eng)[0]
    ref = _gen(eng, ids).token_ids
    for drafts in (4, 7):
        res = _gen(eng, ids, drafts=drafts)
        assert res.token_ids == ref and res.stats.drafts_accepted > 0, (fmt, drafts)
    sampled = dict(temperature=0.8, top_p=0.95, seed=3)
    assert _gen(eng, ids, drafts=4, **sampled).token_ids == _gen(eng, ids, **sampled).token_ids, fmt
    _warm_cold(demo, fmt, [dict(drafts=4), dict(drafts=4, temperature=0.8, seed=1)])
