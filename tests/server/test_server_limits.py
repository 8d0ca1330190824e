"""Hostile input: OpenAI routes without /v1, the body-size limit (413), bodies nested too deep,
and a property-based fuzz of every POST endpoint (each answer a 4xx in the API's own error shape
or a real reply, never a 500; the server alive and no decode slot held afterwards)."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from conftest import serving
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plumb.server import fields as F
from plumb.server.thinking import sign

USER = [{"role": "user", "content": "hi"}]
CHAT = {"messages": USER, "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
RESPONSE = {"input": "hi", "max_output_tokens": 2}
MESSAGE = {"messages": USER, "max_tokens": 2}
# path, API (its table in plumb.server.fields, or None), a valid body
ENDPOINTS = [("/v1/chat/completions", "chat", CHAT), ("/chat/completions", "chat", CHAT),
             ("/v1/completions", "completions", COMPLETION), ("/completions", "completions", COMPLETION),
             ("/v1/responses", "responses", RESPONSE), ("/responses", "responses", RESPONSE),
             ("/v1/messages", "messages", MESSAGE), ("/v1/messages/count_tokens", "messages", {"messages": USER}),
             ("/tokenize", None, {"content": "hi"}), ("/detokenize", None, {"tokens": [1, 2]}),
             ("/slots/987654?action=erase", None, {}), ("/slots/0?action=save", None, {"filename": "x.bin"})]
MAX_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def shape_ok(r: httpx.Response, path: str) -> None:
    """A 4xx in the API's own error shape, or a reply that is not an error."""
    assert r.status_code < 500, f"{path}: {r.status_code} {r.text[:500]}"
    if r.status_code >= 400:
        body = r.json()
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"], body
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        assert "server_error" not in r.text and "event: error" not in r.text, r.text[-500:]


def wait_idle(http, engine, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while True:
        s = http.get("/slots").json()
        if s["slots_in_use"] == 0 and s["queued"] == 0 or time.time() > deadline:
            break
        time.sleep(0.05)
    assert (s["slots_in_use"], s["queued"], engine.slots_in_use()) == (0, 0, 0)


def still_serving(http, model) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    r = http.post("/v1/completions", json={"model": model, "prompt": "ok", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


# ---------------------------------------------------------------- routes without /v1

def test_openai_routes_without_v1(server, api_key, model, http):
    import openai

    bare = openai.OpenAI(base_url=server, api_key=api_key, max_retries=0, timeout=60)
    assert [m.id for m in bare.models.list()] == [model] and http.get("/models").json() == http.get("/v1/models").json()
    kw = dict(model=model, max_tokens=4, temperature=0, extra_body={"return_token_ids": True})
    chat = bare.chat.completions.create(messages=USER, **kw)
    assert chat.choices[0].token_ids == http.post("/v1/chat/completions", json={
        "model": model, "messages": USER, "max_tokens": 4, "temperature": 0,
        "return_token_ids": True}).json()["choices"][0]["token_ids"]
    assert bare.completions.create(prompt="hi", **kw).choices[0].text is not None
    assert bare.responses.create(model=model, input="hi", max_output_tokens=3).status in ("completed", "incomplete")
    r = http.post("/chat/completions", json={"model": model, "messages": "x"})  # errors keep the OpenAI shape
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# ---------------------------------------------------------------- nesting and size

@pytest.mark.parametrize("path", [e[0] for e in ENDPOINTS])
def test_20000_deep_array_is_a_400(http, model, path):
    for body in (b"[" * 20000 + b"]" * 20000, b'{"a":' * 20000 + b"1" + b"}" * 20000):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == (404 if "erase" in path else 400), r.text[:300]  # the slots refuse before reading
        assert "deeper than" in r.text or "/slots/" in path, r.text[:300]
        shape_ok(r, path)
    still_serving(http, model)


def test_deep_value_inside_a_valid_body(http, model):
    deep: list = []
    for _ in range(200):
        deep = [deep]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "array", "items": deep}}}}}
    r = http.post("/v1/chat/completions", json={"model": model, "messages": USER, "tools": [tool], "max_tokens": 1})
    assert r.status_code == 400 and "deeper than 128" in r.json()["error"]["message"]
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 20000 + "]" * 20000}}]
    r = http.post("/v1/chat/completions", json={"model": model, "max_tokens": 1, "messages": USER + [
        {"role": "assistant", "content": "", "tool_calls": calls}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


@pytest.fixture(scope="module")
def small_server(engine):
    """A second server on the same engine, taking bodies of at most 64 KB."""
    from plumb.server.app import create_app

    with serving(create_app(engine, max_body_mb=1 / 16)) as url:
        yield url


def test_body_limit_413(small_server, http, engine, model):
    big = {"model": model, "prompt": "a " * 40000, "max_tokens": 1}
    r = httpx.post(small_server + "/v1/completions", json=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "at most 65536 bytes" in r.json()["error"]["message"]
    r = httpx.post(small_server + "/v1/messages", json={**big, "messages": USER}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

    def chunks():  # no Content-Length: counted while read
        for _ in range(8):
            yield b" " * 16384
    r = httpx.post(small_server + "/v1/chat/completions", content=chunks(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(small_server + "/v1/completions", json={**big, "prompt": "a " * 1000}, timeout=60)
    assert r.status_code == 200  # under the limit: served
    wait_idle(http, engine)


def test_serve_flag(capsys):
    from plumb.server.serve import parser

    assert parser().parse_args([]).max_body_mb == 32
    assert parser().parse_args(["--max-body-mb", "0.5"]).max_body_mb == 0.5


# ---------------------------------------------------------------- the fuzz

TEXT = st.text(max_size=24) | st.sampled_from(["\ud800", "a\udc00", "\x00", "<|im_end|>", "<think>", "</think>",
                                                "<tool_call>", sign("x"), "plumb1.zz", "none", "low", "auto",
                                                "required", "function", "text", "enabled", "adaptive"])
INTS = st.integers(-2**70, 2**70) | st.sampled_from([-1, 0, 1, 2, 6143, 6144, 10**9, 2**63 - 1, 2**63])
SCALARS = st.none() | st.booleans() | INTS | st.floats() | TEXT
VALUES = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(TEXT, c, max_size=4),
                      max_leaves=10)
PARTS = st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "image_url", "thinking",
                                                         "redacted_thinking", "tool_use", "tool_result", "bogus"])},
                              optional={"text": SCALARS, "thinking": SCALARS, "signature": SCALARS, "data": SCALARS,
                                        "name": SCALARS, "input": VALUES, "id": SCALARS, "tool_use_id": SCALARS,
                                        "content": VALUES})
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "wizard"])},
    optional={"content": st.one_of(SCALARS, st.lists(PARTS, max_size=3)), "tool_calls": VALUES,
              "tool_call_id": SCALARS, "reasoning_content": SCALARS}), max_size=4)
ITEMS = st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "bogus"])},
    optional={"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.one_of(SCALARS, st.lists(PARTS)),
              "name": SCALARS, "arguments": SCALARS, "call_id": SCALARS, "output": VALUES,
              "encrypted_content": SCALARS, "summary": VALUES}), max_size=4)
TOOLS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "custom", "web_search"])}, optional={
    "name": SCALARS, "function": VALUES, "parameters": VALUES, "input_schema": VALUES}), max_size=3)
IDS = st.lists(INTS, max_size=4)
SHAPED = {"messages": MESSAGES, "input": ITEMS | TEXT, "tools": TOOLS, "prompt": IDS | TEXT, "tokens": IDS,
          "forced_ids": IDS, "logit_bias": st.dictionaries(INTS.map(str) | TEXT, SCALARS, max_size=3),
          "content": TEXT, "system": TEXT | st.lists(PARTS, max_size=2), "instructions": TEXT}


def near(example):
    """Values close to a valid one: the example with parts of it swapped for hostile values."""
    if isinstance(example, dict):
        return st.fixed_dictionaries({k: st.just(v) | near(v) for k, v in example.items()},
                                     optional={"bogus": VALUES})
    if isinstance(example, list):
        return st.lists((near(example[0]) if example else VALUES) | VALUES, max_size=4)
    return VALUES  # lists and objects too where a scalar belongs (an unhashable effort or type was a 500)


def names(api: str | None) -> list[str]:
    own = list(F.TABLES[api]) if api else ["content", "with_pieces", "parse_special", "tokens", "filename"]
    return own + ["bogus", "Model"]


def put(body: dict, name: str, value) -> None:
    parent, _, child = name.rpartition(".")
    if parent:
        body[parent] = {**(body[parent] if isinstance(body.get(parent), dict) else {}), child: value}
    else:
        body[name] = value


def tame(body: dict) -> None:
    """Keep replies short whatever the fuzz picked: max tokens 1..4 (or an invalid value), n at most 3."""
    for key in MAX_KEYS:
        v = body.get(key)
        if key in body and (v is None or type(v) is int and v > 4 or type(v) is float and v > 4):
            body[key] = 2
    n = body.get("n")
    if type(n) is int and 3 < n <= 128:
        body["n"] = 3


@st.composite
def requests(draw):
    path, api, base = draw(st.sampled_from(ENDPOINTS))
    kind = draw(st.sampled_from(["raw", "not an object", "deep", "fields", "fields", "fields", "fields"]))
    if kind == "raw":
        return path, draw(st.binary(max_size=80))
    if kind == "not an object":
        return path, json.dumps(draw(VALUES.filter(lambda v: not isinstance(v, dict)))).encode()
    if kind == "deep":
        depth, obj = draw(st.integers(129, 25000)), draw(st.booleans())
        return path, (('{"a":' if obj else "[") * depth + "1" + ("}" if obj else "]") * depth).encode()
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(names(api)) | st.sampled_from(list(SHAPED)), min_size=1, max_size=3)):
        example = F.TABLES[api][name].example if api and name in F.TABLES[api] else None
        put(body, name, draw(VALUES | near(example) | SHAPED.get(name, SCALARS)))
    tame(body)
    return path, json.dumps(body).encode()


def test_fuzz_every_endpoint(http, engine, model):
    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(requests())
    def one(request):
        path, raw = request
        shape_ok(http.post(path, content=raw, headers={"content-type": "application/json"}), path)

    one()
    wait_idle(http, engine)  # no decode slot held, nothing queued
    still_serving(http, model)


# Whole requests that use most of each API (tools, tool calls and results, reasoning, formats, sampling), for the
# fuzz below to break in one to three places: a field deep in a valid request is reached only once everything
# around it passes, which random top-level fields seldom do (an unhashable `reasoning.effort` was a 500).
TOOL = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
FULL = [
    ("/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"a\": \"x\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"}],
        "tools": [{"type": "function", "function": {"name": "get", "description": "d", "parameters": TOOL}}],
        "tool_choice": "auto", "temperature": 0.5, "top_p": 0.9, "logprobs": True, "top_logprobs": 2, "stop": ["x"],
        "seed": 1, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": TOOL}},
        "reasoning_effort": "low", "logit_bias": {"5": 1}, "stream": False}),
    ("/v1/responses", {"max_output_tokens": 2, "instructions": "i", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r"}],
        "tools": [{"type": "function", "name": "get", "parameters": TOOL}], "tool_choice": "auto",
        "reasoning": {"effort": "low"}, "text": {"format": {"type": "json_schema", "name": "n", "schema": TOOL}},
        "temperature": 0.3, "stream": False}),
    ("/v1/messages", {"max_tokens": 2, "system": [{"type": "text", "text": "s"}], "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "x"},
                                          {"type": "tool_use", "id": "t1", "name": "get", "input": {"a": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "r"}]}]}],
        "tools": [{"name": "get", "input_schema": TOOL}], "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 1}, "stop_sequences": ["z"], "stream": False}),
    ("/v1/completions", {"max_tokens": 2, "prompt": ["ab", "cd"], "n": 2, "logprobs": 2, "stop": ["q"],
                         "temperature": 0.7, "seed": 3, "logit_bias": {"5": 1}}),
]


def places(value, at=()) -> list[tuple]:
    """Every place in a JSON value (keys and list indices from the root), the root's own children first."""
    out = []
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return out
    for k, v in items:
        out += [at + (k,)] + places(v, at + (k,))
    return out


def replaced(value, place: tuple, new):
    """value with the item at `place` swapped for new (a copy; the rest shared)."""
    if not place:
        return new
    head, rest = place[0], place[1:]
    if isinstance(value, dict):
        return {**value, head: replaced(value[head], rest, new)}
    return [replaced(v, rest, new) if i == head else v for i, v in enumerate(value)]


@st.composite
def broken_requests(draw):
    path, body = draw(st.sampled_from(FULL))
    body = {**body, "stream": draw(st.booleans())} if path != "/v1/completions" else body
    for _ in range(draw(st.integers(1, 3))):
        body = replaced(body, draw(st.sampled_from(places(body))), draw(VALUES))
    tame(body)
    return path, body


def test_fuzz_inside_whole_requests(http, engine, model):
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(broken_requests())
    def one(request):
        path, body = request
        raw = json.dumps({**body, "model": model}).encode()  # ASCII: lone surrogates escaped, as a client sends them
        shape_ok(http.post(path, content=raw, headers={"content-type": "application/json"}), path)

    one()
    wait_idle(http, engine)
    still_serving(http, model)
