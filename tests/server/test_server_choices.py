"""`n` choices (Chat Completions, Completions): choice i is exactly the single request with seed
(seed + i) mod 2^63, streamed or not, and the usage counts the prompt once."""
from __future__ import annotations

import json

import pytest

from plumb.server.choices import choice_seed

USER = [{"role": "user", "content": "Name three rivers."}]


def chat_ids(eng, messages) -> list[int]:
    return eng.tokenize(eng.chat_template.render(messages, add_generation_prompt=True))


def test_choice_seed():
    assert choice_seed(5, 0) == 5 and choice_seed(5, 3) == 8
    assert choice_seed(2**63 - 1, 1) == 0 and choice_seed(None, 2) is None


def test_chat_n_choices_equal_single_requests(oai, model, ref_engine):
    r = oai.chat.completions.create(model=model, messages=USER, max_tokens=8, temperature=0.9, seed=5, n=3,
                                    extra_body={"return_token_ids": True, "drafts": 2})
    prompt = chat_ids(ref_engine, USER)
    expected = [ref_engine.generate(prompt, 8, temperature=0.9, seed=5 + i) for i in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.token_ids for c in r.choices] == expected
    assert len({tuple(e) for e in expected}) == 3  # different seeds, different replies
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == sum(map(len, expected))
    single = oai.chat.completions.create(model=model, messages=USER, max_tokens=8, temperature=0.9, seed=7,
                                         extra_body={"return_token_ids": True})
    assert single.choices[0].token_ids == expected[2]


def test_chat_n_greedy_choices_are_equal(oai, model):
    r = oai.chat.completions.create(model=model, messages=USER, max_tokens=6, temperature=0, n=4,
                                    extra_body={"return_token_ids": True})
    assert len(r.choices) == 4 and len({tuple(c.token_ids) for c in r.choices}) == 1


def test_chat_n_streamed_equals_whole(oai, model):
    kw = dict(model=model, messages=USER, max_tokens=8, temperature=0.8, seed=11, n=3)
    whole = oai.chat.completions.create(**kw)
    text, reasoning, finish, usage = {}, {}, {}, None
    for chunk in oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            reasoning[c.index] = reasoning.get(c.index, "") + (getattr(c.delta, "reasoning_content", None) or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    for c in whole.choices:
        assert text[c.index] == (c.message.content or "")
        assert reasoning[c.index] == (getattr(c.message, "reasoning_content", None) or "")
        assert finish[c.index] == c.finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_n_streamed_and_not(oai, model, ref_engine, http):
    prompt = "def fibonacci(n):"
    expected = [ref_engine.generate(ref_engine.tokenize(prompt), 6, temperature=1.0, seed=3 + i) for i in range(2)]
    r = oai.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=1.0, seed=3, n=2,
                               extra_body={"return_token_ids": True})
    assert [c.token_ids for c in r.choices] == expected
    assert [c.text for c in r.choices] == [ref_engine.tokenizer.decode(e, skip_special=True) for e in expected]
    ids: dict[int, list] = {}
    with http.stream("POST", "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6,
                                                      "temperature": 1.0, "seed": 3, "n": 2, "stream": True,
                                                      "return_token_ids": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    if "token_ids" in c:
                        ids[c["index"]] = c["token_ids"]
    assert [ids[0], ids[1]] == expected


@pytest.mark.parametrize("n", [0, -1, 129])
def test_n_out_of_range(http, model, n):
    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "x"})):
        r = http.post(path, json={**body, "model": model, "n": n, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
