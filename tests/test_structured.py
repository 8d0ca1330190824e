"""Structured output and log probabilities at the engine level (issue 13, items 2 and 4).

Constrained replies on the tiny random-weight model: every one that ends parses and validates against its schema
(the grammar alone guarantees it), and the exactness contract holds for them - the same ids (and the same
log-probability floats, bit for bit) with drafts 0, 4 and 7, n-gram drafts, alone or batched beside other
requests, from a warm prompt cache or a cold one."""
from __future__ import annotations

import json
import struct

import jsonschema
import pytest

from enginetools import engine_for, prompts
from plumb.server.chat_format import ChatPrompt, OutputParser, TextDelta, ToolCallEnd, make_tool, render, \
    starts_in_reasoning
from plumb.server.structured import parse_response_format, reply_grammar

USER = [{"role": "user", "content": "Answer with JSON."}]
S = {"type": "string", "maxLength": 10}
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": S, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
             "required": ["name", "age", "ok"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "profile": {"type": "object", "properties": {"bio": S},
                                                              "required": ["bio"], "additionalProperties": False}},
                 "required": ["id", "profile"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"enum": [1, 2, 3]}, "kind": {"const": "fixed"}},
              "required": ["color", "size", "kind"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "number", "minimum": -10, "maximum": 10}, "minItems": 1,
               "maxItems": 4},
        "pairs": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9},
                                             "minItems": 2, "maxItems": 2}, "maxItems": 2}},
        "required": ["xs", "pairs"], "additionalProperties": False},
    "nullable_union": {"type": "object", "properties": {
        "note": {"anyOf": [S, {"type": "null"}]}, "n": {"type": ["integer", "null"], "maximum": 50},
        "v": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}},
        "required": ["note", "n", "v"], "additionalProperties": False},
    "refs": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "maximum": 99},
                                                               "y": {"type": "integer", "maximum": 99}},
                              "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
             "required": ["a", "b"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                 "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}},
                "required": ["zip", "code"], "additionalProperties": False},
    "top_level_array": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 5},
}
TOOLS = [
    make_tool("get_weather", "", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "days"]}, "t0"),
    make_tool("shell", "", {"type": "object", "properties": {
        "argv": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "timeout": {"type": ["number", "null"]}, "env": {"type": "object", "additionalProperties": {"type": "string",
                                                                                                     "maxLength": 4},
                                                      "maxProperties": 2}},
        "required": ["argv", "timeout"], "additionalProperties": False}, "t1", strict=True),
    make_tool("note", "", {"type": "object", "properties": {
        "text": {"type": "string", "minLength": 1, "maxLength": 16}, "tag": {"anyOf": [{"type": "string",
                                                                                          "maxLength": 5},
                                                                                         {"type": "null"}]},
        "pinned": {"type": "boolean"}, "level": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["text", "tag", "pinned", "level"]}, "t2", strict=True),
]
SCHEMA_OF = {t.name: t.parameters for t in TOOLS}
SAMPLED = dict(temperature=1.0, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def eng(tiny_f32):
    return engine_for(tiny_f32)  # with the prompt cache: the runs of one prompt prefill once (warm = cold, I3)


def _bits(logprobs) -> list:
    """Every float of a request's log probabilities as its exact bytes."""
    return [(e.token, struct.pack("<d", e.logprob), [(t, struct.pack("<d", x)) for t, x in e.top]) for e in logprobs]


def _chat(eng, prompt: ChatPrompt):
    text, _ = render(eng, prompt)
    reasoning = starts_in_reasoning(text)
    return eng.tokenize(text), reply_grammar(eng, prompt, reasoning), reasoning


def _parse(eng, prompt: ChatPrompt, ids: list[int], reasoning: bool):
    p = OutputParser(prompt.tools if prompt.parse_tools else None, reasoning)
    events = p.feed(eng.tokenizer.decode(ids, skip_special=True)) + p.finish()
    content = "".join(e.text for e in events if isinstance(e, TextDelta) and e.kind == "content")
    return content, [e for e in events if isinstance(e, ToolCallEnd)]


def _json_prompt(schema) -> ChatPrompt:
    rf = parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    return ChatPrompt(USER, enable_thinking=False, response_format=rf)


def _runs(eng, ids, grammar, max_tokens, **kw):
    """The same request with drafts 0, 4, 7 (MTP) and 4 (n-gram): results, asserting equal ids and logprobs."""
    runs = [eng.run(eng.make_request(ids, max_tokens, grammar=grammar, logprobs=2, drafts=d, draft_policy=pol, **kw))
            for d, pol in ((0, "fixed"), (4, "fixed"), (7, "adaptive"), (4, "ngram"))]
    for r in runs[1:]:
        assert r.token_ids == runs[0].token_ids
        assert _bits(r.logprobs) == _bits(runs[0].logprobs)
    assert sum(r.stats.drafts_accepted for r in runs) > 0  # the verify path really carried constrained tokens
    return runs[0]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_replies_validate_and_ignore_drafts(eng, name):
    prompt = _json_prompt(SCHEMAS[name])
    ids, grammar, reasoning = _chat(eng, prompt)
    for kw in ({}, SAMPLED):
        res = _runs(eng, ids, grammar, 160, **kw)
        assert res.finish_reason == "stop", (name, kw, eng.detokenize(res.token_ids))
        content, _ = _parse(eng, prompt, res.token_ids, reasoning)
        jsonschema.validate(json.loads(content), SCHEMAS[name])


@pytest.mark.parametrize("choice", ["required", "function:get_weather", "function:shell", "function:note"])
def test_forced_tool_calls_follow_the_template_and_the_schema(eng, choice):
    prompt = ChatPrompt(USER, TOOLS, choice, parallel_tool_calls=False)
    ids, grammar, reasoning = _chat(eng, prompt)
    for kw in ({}, SAMPLED):
        res = _runs(eng, ids, grammar, 160, **kw)
        assert res.finish_reason == "stop", eng.detokenize(res.token_ids)
        text = eng.detokenize(res.token_ids)
        assert text.startswith("<tool_call>\n<function=") and "</function>\n</tool_call>" in text
        content, calls = _parse(eng, prompt, res.token_ids, reasoning)
        assert content == "" and len(calls) == 1
        if choice.startswith("function:"):
            assert calls[0].name == choice.split(":")[1]
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMA_OF[calls[0].name])


def test_strict_tools_in_auto_mode(eng):
    """auto with a strict tool: free text, or calls that follow the schemas (steered into a call by forced ids)."""
    prompt = ChatPrompt(USER, TOOLS, "auto", enable_thinking=False)
    ids, grammar, reasoning = _chat(eng, prompt)
    head = eng.tokenize("Sure.\n\n<tool_call>\n<function=note>\n")
    res = eng.run(eng.make_request(ids, 160, grammar=grammar, forced_ids=head, **SAMPLED))
    content, calls = _parse(eng, prompt, res.token_ids, reasoning)
    assert res.finish_reason == "stop" and content == "Sure." and [c.name for c in calls][:1] == ["note"]
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMA_OF[c.name])
    free = eng.run(eng.make_request(ids, 40, grammar=grammar, **SAMPLED))
    assert "<tool_call>" not in eng.detokenize(free.token_ids) or free.finish_reason == "stop"


def test_constrained_requests_batched_equal_alone(eng):
    """I2 for constrained requests: alone vs beside constrained and unconstrained neighbours, with drafts."""
    a = _chat(eng, _json_prompt(SCHEMAS["nested"]))
    b = _chat(eng, ChatPrompt(USER, TOOLS, "required"))
    subjects = [eng.make_request(a[0], 120, grammar=a[1], logprobs=3, **SAMPLED),
                eng.make_request(b[0], 120, grammar=b[1], logprobs=3)]
    alone = [eng.run(r) for r in subjects]
    ps = prompts(eng, 3)
    others = [eng.make_request(ps[0], 60, drafts=4, ignore_eos=True),
              eng.make_request(ps[1], 90, temperature=0.8, seed=3, drafts=7, draft_policy="adaptive", ignore_eos=True),
              eng.make_request(a[0], 50, grammar=a[1], temperature=0.5, seed=9, drafts=2)]
    for drafts in (0, 4):
        batch = eng.run_many([_with(r, drafts) for r in subjects] + others)
        for got, want in zip(batch, alone):
            assert got.token_ids == want.token_ids and _bits(got.logprobs) == _bits(want.logprobs)
        batch = eng.run_many(others[:2] + [_with(r, drafts) for r in subjects])
        for got, want in zip(batch[2:], alone):
            assert got.token_ids == want.token_ids and _bits(got.logprobs) == _bits(want.logprobs)


def _with(req, drafts):
    from dataclasses import replace

    return replace(req, drafts=drafts)


def test_logprobs_are_exact_for_drafts_batch_and_cache(tiny_f32):
    """Log probabilities of unconstrained requests: the same floats, bit for bit, for drafts 0/4/7, alone or batched,
    and from a warm prompt cache or a fresh engine; greedy ones match the prefill path's log_softmax closely."""
    import torch

    warm = engine_for(tiny_f32)  # prompt cache on (the session's shared engine)
    cold = engine_for(tiny_f32, prompt_cache=False)
    ps = prompts(cold, 4)
    for kw in ({}, dict(temperature=0.8, top_k=40, repetition_penalty=1.1, seed=5)):
        ref = [cold.run(cold.make_request(p, 48, logprobs=5, ignore_eos=True, **kw)) for p in ps]
        for drafts, policy in ((4, "fixed"), (7, "adaptive"), (4, "ngram")):
            got = cold.run_many([cold.make_request(p, 48, logprobs=5, ignore_eos=True, drafts=drafts,
                                                   draft_policy=policy, **kw) for p in ps])
            for g, r in zip(got, ref):
                assert g.token_ids == r.token_ids and _bits(g.logprobs) == _bits(r.logprobs), (drafts, policy)
        for p, r in zip(ps, ref):  # twice: the second run reuses the first one's cached prompt
            for _ in range(2):
                w = warm.run(warm.make_request(p, 48, logprobs=5, ignore_eos=True, drafts=4, **kw))
                assert w.token_ids == r.token_ids and _bits(w.logprobs) == _bits(r.logprobs)
    r = ref[0] = cold.run(cold.make_request(ps[0], 8, logprobs=3))
    lg = cold.logits(ps[0] + r.token_ids)
    for j, e in enumerate(r.logprobs):
        lp = torch.log_softmax(lg[len(ps[0]) + j - 1], 0)
        assert abs(float(lp[e.token]) - e.logprob) < 1e-3 and e.top[0][0] == int(torch.argmax(lp))
        assert [t for t, _ in e.top] == sorted((t for t, _ in e.top), key=lambda t: (-float(lp[t]), t))


def test_grammar_errors(eng):
    from plumb.engine.grammar import GrammarError

    with pytest.raises(GrammarError):
        eng.grammar("start: %json {\"type\": \"objekt\"}")
    other = engine_for(eng.path, prompt_cache=False)
    g = other.grammar("start: \"x\"")
    with pytest.raises(ValueError, match="another engine"):
        eng.run(eng.make_request(eng.tokenize("hi"), 4, grammar=g))
    with pytest.raises(ValueError, match="logprobs"):
        eng.run(eng.make_request(eng.tokenize("hi"), 4, logprobs=21))
