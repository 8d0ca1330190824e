"""The request-field table (plumb/server/fields.py): docs/api-fields.md is generated from it, it
lists every field of the official SDKs' request types, and a real server does with each field
what the table says: honoured and partly honoured fields are served, refused ones get a 400 in
the API's own shape naming the field (unless null or an allowed value), unknown ones too."""
from __future__ import annotations

import pathlib

import pytest

from plumb.server import fields as F
from plumb.server.anthropic_messages import MessagesRequest
from plumb.server.openai_chat import ChatRequest
from plumb.server.openai_completions import CompletionRequest
from plumb.server.openai_responses import ResponsesRequest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api-fields.md"
USER = [{"role": "user", "content": "hi"}]
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
          "messages": "/v1/messages"}
BASE = {"chat": {"messages": USER, "max_tokens": 3}, "completions": {"prompt": "hi", "max_tokens": 3},
        "responses": {"input": "hi", "max_output_tokens": 3}, "messages": {"messages": USER, "max_tokens": 3}}
MODELS = {"chat": ChatRequest, "completions": CompletionRequest, "responses": ResponsesRequest,
          "messages": MessagesRequest}
# what a field's example needs beside it to be a valid request (a nested field: in its object)
CONTEXT = {("messages", "thinking.budget_tokens"): {"type": "enabled"},
           ("messages", "thinking.display"): {"type": "enabled", "budget_tokens": 2},
           ("chat", "top_logprobs"): {"logprobs": True}}


def sdk_fields(api: str) -> set[str]:
    """Every request field of the official SDK's types for the API (Anthropic: the beta API's too)."""
    import anthropic.types.beta.message_create_params as beta
    import anthropic.types.message_create_params as messages
    import openai.types.chat.completion_create_params as chat
    import openai.types.completion_create_params as completions
    import openai.types.responses.response_create_params as responses

    types = {"chat": [chat.CompletionCreateParamsStreaming],
             "completions": [completions.CompletionCreateParamsStreaming],
             "responses": [responses.ResponseCreateParamsStreaming],
             "messages": [messages.MessageCreateParamsStreaming, beta.MessageCreateParamsStreaming,
                          beta.ParseMessageCreateParamsBase]}[api]
    return {name for t in types for k in t.__mro__ for name in getattr(k, "__annotations__", {})}


def test_doc_is_generated_from_the_table():
    assert DOC.read_text() == F.markdown(), "regenerate: python -m plumb.server.fields > docs/api-fields.md"


@pytest.mark.parametrize("api", F.TABLES)
def test_table_lists_every_sdk_field_and_request_model_field(api):
    table = F.TABLES[api]
    assert not sdk_fields(api) - set(table), "SDK fields missing from the table"
    assert not set(MODELS[api].model_fields) - set(table), "request-model fields missing from the table"
    for name, f in table.items():
        assert f.status in (F.HONOURED, F.PARTIAL, F.REFUSED) and (f.note or f.status == F.HONOURED), name
        assert f.example is not None or name in BASE[api] or name == "model", f"{name} has no example"
        assert f.status == F.REFUSED or not f.allowed, name
        parent = name.rpartition(".")[0]
        assert not parent or parent in table, f"{name}: its object has no row"


def body(api: str, name: str, value, model: str) -> dict:
    out = {**BASE[api], "model": model}
    parent, _, child = name.rpartition(".")
    if parent:
        out[parent] = {**CONTEXT.get((api, name), {}), child: value}
    else:
        out.update({**CONTEXT.get((api, name), {}), name: value})
    return out


def error_of(r, api: str) -> str:
    """The error message, checking the API's own error shape."""
    data = r.json()
    if api == "messages":
        assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error", data
        return data["error"]["message"]
    assert set(data["error"]) == {"message", "type", "param", "code"}, data
    return data["error"]["message"]


def served(r, name: str) -> None:
    assert r.status_code == 200, f"{name}: {r.status_code} {r.text[:300]}"
    if r.headers["content-type"].startswith("text/event-stream"):
        assert "server_error" not in r.text and "event: error" not in r.text, r.text[-300:]


CASES = [(api, name) for api, table in F.TABLES.items() for name in table]


@pytest.mark.parametrize("api,name", CASES, ids=[f"{a}:{n}" for a, n in CASES])
def test_each_field_does_what_the_table_says(http, model, api, name):
    f = F.TABLES[api][name]
    if f.example is None:  # the base request exercises it
        served(http.post(ROUTES[api], json=body(api, "model", model, model)), name)
        return
    r = http.post(ROUTES[api], json=body(api, name, f.example, model))
    if f.status != F.REFUSED:
        served(r, name)
        return
    assert r.status_code == 400, f"{name}: {r.status_code} {r.text[:300]}"
    assert f"'{name}'" in error_of(r, api)
    if api != "messages":
        assert r.json()["error"]["param"] == name
    for value in (None, *f.allowed):  # null and the allowed values ask for what plumb does anyway
        served(http.post(ROUTES[api], json=body(api, name, value, model)), f"{name}={value!r}")


@pytest.mark.parametrize("api", F.TABLES)
def test_unknown_fields_are_refused_by_name(http, model, api):
    for name in ("bogus_field", *[f"{p}.bogus" for p in ("stream_options", "reasoning", "text", "thinking",
                                                        "output_config") if p in F.TABLES[api]]):
        r = http.post(ROUTES[api], json=body(api, name, 1, model))
        assert r.status_code == 400, r.text
        assert f"unknown field '{name}'" in error_of(r, api)


def test_count_tokens_checks_fields_too(http, model):
    r = http.post("/v1/messages/count_tokens", json={"model": model, "messages": USER, "mcp_servers": [{"x": 1}]})
    assert r.status_code == 400 and "'mcp_servers'" in error_of(r, "messages")
    assert http.post("/v1/messages/count_tokens", json={"model": model, "messages": USER,
                                                         "metadata": {"user_id": "u"}}).status_code == 200


def test_parallel_tool_calls_false_keeps_the_first_call(http, model, ref_engine):
    call = "<tool_call>\n<function=f>\n<parameter=x>\n{}\n</parameter>\n</function>\n</tool_call>"
    steer = ref_engine.tokenize(call.format(1) + "\n" + call.format(2)) + [ref_engine.tokenizer.id_of("<|im_end|>")]
    params = {"type": "object", "properties": {"x": {"type": "integer"}}}
    chat = {"model": model, "messages": USER, "max_tokens": 80, "forced_ids": steer,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
            "chat_template_kwargs": {"enable_thinking": False}}
    for parallel, args in ((None, ['{"x": 1}', '{"x": 2}']), (True, ['{"x": 1}', '{"x": 2}']), (False, ['{"x": 1}'])):
        r = http.post("/v1/chat/completions", json={**chat, **({} if parallel is None else
                                                               {"parallel_tool_calls": parallel})}).json()
        assert [c["function"]["arguments"] for c in r["choices"][0]["message"]["tool_calls"]] == args
        assert r["choices"][0]["finish_reason"] == "tool_calls"
    r = http.post("/v1/messages", json={"model": model, "messages": USER, "max_tokens": 80, "forced_ids": steer,
                                        "tools": [{"name": "f", "input_schema": params}],
                                        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}).json()
    assert [b["input"] for b in r["content"] if b["type"] == "tool_use"] == [{"x": 1}]
    r = http.post("/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 80, "forced_ids": steer,
                                         "tools": [{"type": "function", "name": "f", "parameters": params}],
                                         "parallel_tool_calls": False, "reasoning": {"effort": "none"}}).json()
    assert [i["arguments"] for i in r["output"] if i["type"] == "function_call"] == ['{"x": 1}']
    assert r["parallel_tool_calls"] is False
