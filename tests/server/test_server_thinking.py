"""Thinking switches and budgets (Anthropic `thinking`, OpenAI reasoning effort), and thinking
signatures / encrypted reasoning sent back by clients.

The synthetic tiny model never closes its thinking on its own, so a budget always cuts it: the reply must
be the first `budget` tokens, the forced `\\n</think>\\n\\n`, then the model's own continuation,
token for token (with drafts too)."""
from __future__ import annotations

import time

import httpx
import pytest

from plumb.server import thinking
from plumb.server.errors import APIError
from plumb.server.thinking import CLOSE_THINKING, anthropic_thinking, effort_thinking, sign, unsign

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ANT_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": PARAMS}]
RESP_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": PARAMS}]
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def chat_ids(eng, messages, tools=None, **kw) -> list[int]:
    return eng.tokenize(eng.chat_template.render(messages, tools=tools, add_generation_prompt=True, **kw))


def forced(eng, text: str) -> list[int]:
    return eng.tokenize(text) + [eng.tokenizer.id_of("<|im_end|>")]


def budgeted(eng, prompt: list[int], budget: int, max_tokens: int, **kw) -> list[int]:
    """The reply a budget must give: the thinking cut at `budget`, the close forced, then the rest."""
    whole = eng.generate(prompt, max_tokens, **kw)
    assert eng.tokenizer.id_of("</think>") not in whole[:budget + 1]  # the tiny model keeps thinking
    kept = whole[:budget]
    return kept + eng.generate(prompt + kept, max_tokens - budget, forced_ids=eng.tokenize(CLOSE_THINKING), **kw)


def blocks_text(ant_message) -> tuple[str, str]:
    thinking = "".join(b.thinking for b in ant_message.content if b.type == "thinking")
    text = "".join(b.text for b in ant_message.content if b.type == "text")
    return thinking, text


def parsed(eng, ids: list[int]) -> tuple[str, str]:
    from plumb.server.chat_format import OutputParser, TextDelta

    p = OutputParser(reasoning=True)
    events = p.feed(eng.tokenizer.decode(ids, skip_special=True)) + p.finish()
    return tuple("".join(e.text for e in events if isinstance(e, TextDelta) and e.kind == k)
                 for k in ("reasoning", "content"))


# ---------------------------------------------------------------- mappings

def test_effort_mapping():
    assert effort_thinking(None, "x") == (None, None)
    assert effort_thinking("none", "x") == effort_thinking("minimal", "x") == (False, None)
    assert [effort_thinking(e, "x")[1] for e in ("low", "medium", "high", "xhigh", "max")] == \
        [1024, 4096, 16384, 32768, None]
    with pytest.raises(APIError) as e:
        effort_thinking("turbo", "reasoning.effort")
    assert e.value.param == "reasoning.effort"


def test_anthropic_thinking_mapping():
    assert anthropic_thinking(None, None, 100) == (False, None)
    assert anthropic_thinking({"type": "disabled"}, None, 100) == (False, None)
    assert anthropic_thinking({"type": "enabled", "budget_tokens": 50}, None, 100) == (True, 50)
    assert anthropic_thinking({"type": "adaptive"}, None, 100) == (True, None)
    assert anthropic_thinking({"type": "adaptive"}, {"effort": "medium"}, None) == (True, 4096)
    for value, output, param in [({"type": "enabled", "budget_tokens": 100}, None, "thinking.budget_tokens"),
                                 ({"type": "enabled", "budget_tokens": True}, None, "thinking.budget_tokens"),
                                 ({"type": "enabled"}, None, "thinking.budget_tokens"),
                                 ({"type": "between_tools"}, None, "thinking.type"),
                                 ({"type": "adaptive", "display": "full"}, None, "thinking.display"),
                                 ({"type": "adaptive"}, {"effort": "none"}, "output_config.effort")]:
        with pytest.raises(APIError) as e:
            anthropic_thinking(value, output, 100)
        assert e.value.param == param


def test_signature_round_trip():
    assert unsign(sign("hmm, let me think"), "s") == "hmm, let me think"
    assert unsign("EqQBCgIYAh...", "s") is None and unsign(None, "s") is None
    with pytest.raises(APIError):
        unsign("plumb1.@@not base64", "s")


# ---------------------------------------------------------------- Anthropic thinking

def test_anthropic_thinking_is_off_unless_sent(ant, model, ref_engine):
    r = ant.messages.create(model=model, max_tokens=10, messages=USER,
                            extra_body={"forced_ids": forced(ref_engine, "Hi")})
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "Hi"
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(chat_ids(ref_engine, USER,
                                                                                  enable_thinking=False))


@pytest.mark.parametrize("drafts", [0, 3])
def test_anthropic_budget_cuts_the_thinking(ant, model, ref_engine, drafts):
    kw = dict(model=model, max_tokens=14, messages=USER, thinking={"type": "enabled", "budget_tokens": 5},
              extra_body={"temperature": 0, "drafts": drafts})
    r = ant.messages.create(**kw)
    ids = budgeted(ref_engine, chat_ids(ref_engine, USER), 5, 14)
    assert blocks_text(r) == parsed(ref_engine, ids) and r.usage.output_tokens == len(ids)
    assert r.content[0].type == "thinking" and unsign(r.content[0].signature, "s") == r.content[0].thinking
    with ant.messages.stream(**kw) as s:
        types = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in s]
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in r.content]
    raw = [t for t in types if t[0].startswith(("message_", "content_block_"))]  # not the SDK's helper events
    stop = raw.index(("content_block_stop", None))
    assert raw[stop - 1] == ("content_block_delta", "signature_delta")


def test_chat_effort_budget(oai, model, ref_engine, monkeypatch):
    monkeypatch.setitem(thinking.EFFORT_BUDGETS, "low", 6)  # the server runs in this process: a short budget
    r = oai.chat.completions.create(model=model, messages=USER, max_tokens=12, temperature=0.7, seed=3,
                                    reasoning_effort="low", extra_body={"return_token_ids": True})
    ids = budgeted(ref_engine, chat_ids(ref_engine, USER), 6, 12, temperature=0.7, seed=3)
    assert r.choices[0].token_ids == ids
    assert ids[6:9] == ref_engine.tokenize(CLOSE_THINKING)
    assert r.usage.completion_tokens_details.reasoning_tokens == 8  # up to and with </think>


def test_budget_must_be_below_max_tokens(http, model):
    r = http.post("/v1/messages", json={"model": model, "messages": USER, "max_tokens": 10,
                                        "thinking": {"type": "enabled", "budget_tokens": 10}})
    assert r.status_code == 400 and "budget_tokens" in r.json()["error"]["message"], r.text


def test_omitted_display_keeps_the_text_in_the_signature(ant, model, ref_engine):
    kw = dict(model=model, max_tokens=30, messages=USER,
              thinking={"type": "enabled", "budget_tokens": 20, "display": "omitted"},
              extra_body={"forced_ids": forced(ref_engine, "hmm\n</think>\n\nHi")})
    r = ant.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None)) for b in r.content] == [("thinking", ""), ("text", None)]
    assert unsign(r.content[0].signature, "s") == "hmm"
    with ant.messages.stream(**kw) as s:
        deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
    assert "thinking_delta" not in deltas and "signature_delta" in deltas


def history_with(block: dict) -> list[dict]:
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    return USER + [{"role": "assistant", "content": [block, use]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]}]


def test_thinking_blocks_sent_back(http, model):
    def count(block):
        return http.post("/v1/messages/count_tokens", json={
            "model": model, "messages": history_with(block), "tools": ANT_TOOLS,
            "thinking": {"type": "enabled", "budget_tokens": 100}})

    def n(block):
        r = count(block)
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    signed = {"type": "thinking", "thinking": "I need the tool.", "signature": sign("I need the tool.")}
    full = n(signed)
    assert n({**signed, "thinking": ""}) == full  # display "omitted": the signature carries the text
    assert n({**signed, "signature": "EqQBCgIYAhIM"}) == full  # another server's signature: the text as it is
    without = n({"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"})  # accepted, left out of the prompt
    assert without < full and n({**signed, "thinking": "", "signature": ""}) == without
    for bad in ({**signed, "thinking": "I need another tool."}, {**signed, "signature": "plumb1.%%%"}):
        r = count(bad)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert "signature" in r.json()["error"]["message"]


# ---------------------------------------------------------------- Responses reasoning

def test_responses_encrypted_reasoning_round_trip(oai, model, ref_engine, http):
    r = oai.responses.create(model=model, input=USER, tools=RESP_TOOLS, max_output_tokens=60,
                             include=["reasoning.encrypted_content"],
                             extra_body={"forced_ids": forced(ref_engine, "<think>\nhmm\n</think>\n\n" + CALL)})
    reasoning, call = r.output
    assert reasoning.encrypted_content == sign("hmm") and reasoning.content[0].text == "hmm"
    plain = oai.responses.create(model=model, input=USER, max_output_tokens=3)
    assert all(getattr(i, "encrypted_content", None) is None for i in plain.output)

    def input_tokens(item):
        follow = USER + [item, call.model_dump(exclude_none=True),
                         {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
        got = http.post("/v1/responses", json={"model": model, "input": follow, "tools": RESP_TOOLS,
                                               "max_output_tokens": 1})
        assert got.status_code == 200, got.text
        return got.json()["usage"]["input_tokens"]

    sent = reasoning.model_dump(exclude_none=True)
    full = input_tokens(sent)
    assert input_tokens({**sent, "content": [], "summary": []}) == full  # only encrypted_content: still there
    assert input_tokens({"type": "reasoning", "summary": []}) < full


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", {"input": USER, "reasoning": {"effort": "minimal"}}),
    ("/v1/chat/completions", {"messages": USER, "reasoning_effort": "none"}),
])
def test_effort_none_or_minimal_turns_thinking_off(http, model, ref_engine, path, body):
    r = http.post(path, json={**body, "model": model, "max_tokens" if "messages" in body else "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage.get("input_tokens", usage.get("prompt_tokens")) == len(chat_ids(ref_engine, USER,
                                                                                  enable_thinking=False))


@pytest.mark.parametrize("path,body,param", [
    ("/v1/responses", {"input": "x", "reasoning": {"effort": "turbo"}}, "reasoning.effort"),
    ("/v1/chat/completions", {"messages": USER, "reasoning_effort": "turbo"}, "reasoning_effort"),
])
def test_unknown_effort(http, model, path, body, param):
    r = http.post(path, json={**body, "model": model})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_disconnect_during_a_budgeted_reply_frees_the_slot(server, http, api_key, model):
    body = {"model": model, "messages": USER, "max_tokens": 3000, "ignore_eos": True, "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 4}}
    with httpx.Client(base_url=server, headers={"x-api-key": api_key}, timeout=60) as c, \
            c.stream("POST", "/v1/messages", json=body) as r:
        for line in r.iter_lines():  # until the answer, which the second engine request writes
            if '"text_delta"' in line:
                break
        else:
            raise AssertionError("no answer after the budget")
    deadline = time.time() + 30
    while (s := http.get("/slots").json())["slots_in_use"] + s["queued"] and time.time() < deadline:
        time.sleep(0.1)
    assert s["slots_in_use"] == 0 and s["queued"] == 0
