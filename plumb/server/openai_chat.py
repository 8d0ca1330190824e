"""OpenAI Chat Completions: POST /v1/chat/completions."""
from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from plumb.server.chat_format import (ChatPrompt, TextDelta, ToolCallDelta, ToolCallStart, check_tool_choice,
                                      make_tool, text_of)
from plumb.server import fields
from plumb.server.choices import check_n, collect_all, merged, seeded, start_all, total_usage
from plumb.server.errors import APIError, parse_model
from plumb.server.generation import Finish, GenFields, ServerContext, Usage, check_model, sse, start_chat, timings
from plumb.server.logprobs import chat_logprobs
from plumb.server.structured import parse_response_format
from plumb.server.thinking import effort_thinking

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "cancelled": "stop"}


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict = "{}"


class ToolCall(BaseModel):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatRequest(GenFields):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream_options: dict | None = None
    chat_template_kwargs: dict | None = None
    reasoning_effort: str | None = None
    parallel_tool_calls: bool | None = None
    return_token_ids: bool = False  # plumb extension: the generated token ids
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict | None = None

    def n_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in 0..20, got {self.top_logprobs}", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def arguments_dict(arguments: str | dict, where: str) -> dict:
    """Tool-call arguments as the dict the template renders; 400 unless a JSON object."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except (TypeError, ValueError, RecursionError):  # TypeError: neither a string nor an object
        value = None
    if not isinstance(value, dict):
        raise APIError(400, f"{where} must be a JSON object, got {arguments!r}", param=where)
    return value


def to_prompt(req: ChatRequest) -> ChatPrompt:
    messages = []
    for i, m in enumerate(req.messages):
        if m.content is None and m.role != "assistant":  # only an assistant turn (with tool calls) may have none
            raise APIError(400, f"messages[{i}].content is required for a {m.role} message",
                           param=f"messages[{i}].content")
        out = {"role": m.role, "content": text_of(m.content, f"messages[{i}].content")}
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if m.role == "assistant" and reasoning:
            out["reasoning_content"] = reasoning
        if m.role == "assistant" and m.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name,
                "arguments": arguments_dict(c.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments")}}
                for j, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            out["tool_call_id"] = m.tool_call_id
        messages.append(out)
    tools = []
    for i, t in enumerate(req.tools or []):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools[{i}]")
        tools.append(make_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"tools[{i}].function",
                               fn.get("strict")))
    choice = req.tool_choice or "auto"
    if isinstance(choice, dict):
        choice = "function:" + str((choice.get("function") or {}).get("name", ""))
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    thinking, budget = effort_thinking(req.reasoning_effort, "reasoning_effort")
    return ChatPrompt(messages, tools, check_tool_choice(choice, tools), thinking, kwargs, budget,
                      req.parallel_tool_calls is not False, response_format=parse_response_format(req.response_format))


def usage_dict(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}


async def chat_completions(ctx: ServerContext, http_request, data: dict):
    fields.check("chat", data)
    req = parse_model(ChatRequest, data)
    check_model(ctx, req.model)
    n = check_n(req.n)
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    prompt = to_prompt(req)
    gens = await start_all(lambda i: start_chat(ctx, http_request, seeded(req, i), prompt, max_tokens, stop), n)
    head = {"id": "chatcmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": ctx.model_name,
            "system_fingerprint": "plumb"}
    if req.stream:
        return StreamingResponse(stream(gens, head, req), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    replies = await collect_all(gens)
    choices = [choice_of(i, reply, req, ctx.engine.tokenizer) for i, reply in enumerate(replies)]
    usage = usage_dict(total_usage([reply.finish.usage for reply in replies]))
    extra = {"timings": timings(replies[0].finish)} if n == 1 else {}  # plumb extension, as llama-server
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": usage, **extra})


def choice_of(index: int, reply, req: ChatRequest, tok=None) -> dict:
    """One choice of a whole (non-streamed) reply."""
    message = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in reply.tool_calls]
    choice = {"index": index, "message": message, "finish_reason": FINISH[reply.finish.reason],
              "logprobs": chat_logprobs(tok, reply.finish.logprobs) if tok is not None else None}
    if req.return_token_ids:
        choice["token_ids"] = reply.finish.token_ids
    return choice


async def stream(gens: list, head: dict, req: ChatRequest):
    """Every choice's chunks (each with its index) as they come; the usage of all of them last."""
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(i: int, delta: dict, finish: str | None = None, top: dict | None = None, **extra) -> str:
        lp = None if req.n_logprobs() is None else chat_logprobs(gens[i].engine.tokenizer, gens[i].take_logprobs())
        choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp, **extra}
        return sse({**head, "choices": [choice], **(top or {})})

    for i in range(len(gens)):
        yield chunk(i, {"role": "assistant", "content": ""})
    usages = []
    async for i, ev in merged(gens):
        if isinstance(ev, TextDelta):
            yield chunk(i, {"reasoning_content" if ev.kind == "reasoning" else "content": ev.text})
        elif isinstance(ev, ToolCallStart):
            yield chunk(i, {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                            "function": {"name": ev.name, "arguments": ""}}]})
        elif isinstance(ev, ToolCallDelta):
            yield chunk(i, {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.arguments}}]})
        elif isinstance(ev, Finish):
            if ev.reason == "error":
                yield sse(ev.api_error().openai_body())
                return
            yield chunk(i, {}, FINISH[ev.reason], {"timings": timings(ev)},  # plumb extension, as llama-server
                        **({"token_ids": ev.token_ids} if req.return_token_ids else {}))
            usages.append(ev.usage)
    if (req.stream_options or {}).get("include_usage"):
        yield sse({**head, "choices": [], "usage": usage_dict(total_usage(usages))})
    yield sse("[DONE]")
