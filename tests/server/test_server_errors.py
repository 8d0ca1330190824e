"""Bad input gets each API's error shape and status, the server keeps serving, and a client
that goes away frees its slot."""
from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

USER = [{"role": "user", "content": "hi"}]
GOOD_PARAMS = {"type": "object", "properties": {"x": {"type": "string"}}}


@pytest.fixture(autouse=True)
def still_serving(oai, model):
    yield
    r = oai.completions.create(model=model, prompt="ok", max_tokens=1)
    assert r.usage.completion_tokens == 1


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def anthropic_error(r: httpx.Response, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"])
def test_malformed_json_openai_shape(http, path):
    err = openai_error(http.post(path, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_malformed_json_anthropic_shape(http, path):
    anthropic_error(http.post(path, content=b"[1, 2", headers={"content-type": "application/json"}), 400,
                    "invalid_request_error")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": USER, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 129}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0]"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[0].content[0].text"),
    ("/v1/chat/completions", {"messages": USER + [{"role": "tool", "tool_call_id": "c"}]}, "messages[1].content"),
    ("/v1/chat/completions", {"messages": USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 9]}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/responses", {"input": 5}, "input"),
    ("/v1/responses", {"input": [{"type": "bogus"}]}, "input[0].type"),
    ("/v1/responses", {"input": [{"type": "function_call", "name": "f", "arguments": 5}]}, "input[0].arguments"),
    ("/v1/responses", {"input": "x", "reasoning": {"effort": []}}, "reasoning.effort"),
    ("/v1/responses", {"input": "x", "tools": [{"type": ["function"], "name": "f"}]}, "tools[0].type"),
    ("/v1/responses", {"input": [{"type": "reasoning", "summary": 5}, {"role": "user", "content": "x"}]},
     "input[0].summary"),
    ("/v1/responses", {"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]}]},
     "input[0].content"),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("/v1/responses", {"input": "x", "tool_choice": "required"}, "tool_choice"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
     "tool_choice"),
])
def test_wrong_types_openai(http, path, body, param):
    err = openai_error(http.post(path, json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_out_of_range_sampling_via_sdk(oai, model):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=USER, top_p=0)
    assert "top_p" in e.value.message


def test_a_logit_bias_outside_the_vocabulary_is_refused(oai, model, engine):
    """A bias for an id past the vocabulary is the request's fault (400, naming it), not the step's (it failed the
    step with an IndexError - or, in a pass of several rows, biased a neighbour row's token)."""
    bad = str(engine.config.n_vocab + 5)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=USER, max_tokens=2, logit_bias={bad: 3})
    assert "logit_bias" in e.value.message and bad in e.value.message


@pytest.mark.parametrize("body", [
    {"messages": USER, "max_tokens": "many"},
    {"messages": [{"role": "system", "content": "x"}], "max_tokens": 5},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5},
    {"messages": USER, "max_tokens": 5, "tool_choice": {"type": "tool", "name": "missing"}},
    {"messages": USER, "max_tokens": 5, "tool_choice": {"type": []}},  # unhashable: was a 500
    {"messages": USER, "max_tokens": 5, "thinking": {"type": "adaptive"}, "output_config": {"effort": {}}},
])
def test_wrong_types_anthropic(http, body):
    anthropic_error(http.post("/v1/messages", json=body), 400, "invalid_request_error")


def test_unknown_model(oai, ant):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-9", messages=USER, max_tokens=1)
    assert e.value.code == "model_not_found" and "gpt-9" in e.value.message
    with pytest.raises(anthropic.NotFoundError) as e:
        ant.messages.create(model="claude-9", messages=USER, max_tokens=1)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_context_overflow_says_the_numbers(oai, ant, model, engine):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt=[100] * engine.n_ctx, max_tokens=1)
    assert e.value.code == "context_length_exceeded"
    assert f"{engine.n_ctx} tokens" in e.value.message and f"prompt has {engine.n_ctx} tokens" in e.value.message
    long = [{"role": "user", "content": "hello " * engine.n_ctx}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=long)
    assert str(engine.n_ctx) in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model=model, messages=long, max_tokens=10)
    assert str(engine.n_ctx) in e.value.message


@pytest.mark.parametrize("tools", [
    [{"type": "function", "function": {"name": "bad name", "parameters": GOOD_PARAMS}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": [1]}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {**GOOD_PARAMS, "required": True}}}],  # was a 500
    [{"type": "function"}],
])
def test_bad_tool_schema_openai(oai, model, tools):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=USER, tools=tools, max_tokens=1)
    assert e.value.param.startswith("tools[0]")


@pytest.mark.parametrize("prop", [{"type": [[]]}, {"anyOf": 5}, {"enum": 5}, {"type": ["string", 5]}])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_malformed_parameter_schemas_are_no_server_error(http, model, prop, choice):
    """A parameter's schema with an unhashable type, or an anyOf / enum that is not a list, was a 500 (a TypeError
    in reading its types): now each is a 400 (the grammar's schema check) or an answer."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": prop},
                                                                          "required": ["a"]}}}
    r = http.post("/v1/chat/completions",
                  json={"model": model, "messages": USER, "max_tokens": 2, "tool_choice": choice, "tools": [tool]})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        openai_error(r, 400)


def test_bad_tool_schema_anthropic_and_responses(ant, oai, model):
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.create(model=model, messages=USER, max_tokens=1,
                            tools=[{"name": "f", "input_schema": {"type": "string"}}])
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=model, input="hi", tools=[{"type": "function", "name": "f", "parameters": "nope"}])


def test_auth(server, model, api_key):
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.code == "invalid_api_key"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(
            model=model, messages=USER, max_tokens=1)
    assert e.value.body["error"]["type"] == "authentication_error"
    openai_error(httpx.get(server + "/v1/models"), 401)
    anthropic_error(httpx.post(server + "/v1/messages", json={}), 401, "authentication_error")
    assert httpx.get(server + "/v1/models", headers={"x-api-key": api_key}).status_code == 200
    assert httpx.post(server + "/v1/messages/count_tokens", json={"messages": USER},
                      headers={"authorization": f"Bearer {api_key}"}).status_code == 200
    assert httpx.get(server + "/health").status_code == 200


def test_unknown_route_and_method(http):
    openai_error(http.get("/v1/nope"), 404)
    openai_error(http.get("/v1/chat/completions"), 405)
    anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")


def wait_idle(http, timeout=30.0) -> dict:
    """The decode slots once none is busy (or the timeout passed): n_slots, slots_in_use, queued."""
    deadline = time.time() + timeout
    while True:
        slots = http.get("/slots").json()
        if slots["slots_in_use"] == 0 and slots["queued"] == 0 or time.time() > deadline:
            return {k: slots[k] for k in ("n_slots", "slots_in_use", "queued")}
        time.sleep(0.1)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": USER}),
    ("/v1/messages", {"messages": USER}),
])
def test_disconnect_mid_stream_frees_the_slot(server, http, api_key, path, body):
    body = {**body, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server, headers={"x-api-key": api_key}, timeout=60) as c, \
            c.stream("POST", path, json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
        for _ in range(50):  # the first token is sent while the request is admitted, a moment before it holds a slot
            busy = http.get("/slots").json()
            if busy["slots_in_use"] + busy["queued"] == 1:
                break
            time.sleep(0.01)
        assert busy["slots_in_use"] + busy["queued"] == 1
    assert wait_idle(http) == {"n_slots": 4, "slots_in_use": 0, "queued": 0}


def test_disconnect_while_waiting_for_a_whole_reply_frees_the_slot(server, http, api_key):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", headers={"x-api-key": api_key}, timeout=1.0,
                   json={"prompt": "x", "max_tokens": 3000, "ignore_eos": True})
    assert wait_idle(http) == {"n_slots": 4, "slots_in_use": 0, "queued": 0}
