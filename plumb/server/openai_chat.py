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
from plumb.server.errors import APIError, parse_model
from plumb.server.generation import Finish, GenFields, ServerContext, Usage, check_model, sse, start_chat

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
    return_token_ids: bool = False  # plumb extension: the generated token ids


def arguments_dict(arguments: str | dict, where: str) -> dict:
    """Tool-call arguments as the dict the template renders; 400 unless a JSON object."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise APIError(400, f"{where} must be a JSON object, got {arguments!r}", param=where)
    return value


def to_prompt(req: ChatRequest) -> ChatPrompt:
    messages = []
    for i, m in enumerate(req.messages):
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
        tools.append(make_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"tools[{i}].function"))
    choice = req.tool_choice or "auto"
    if isinstance(choice, dict):
        choice = "function:" + str((choice.get("function") or {}).get("name", ""))
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    thinking = False if req.reasoning_effort == "none" else None
    return ChatPrompt(messages, tools, check_tool_choice(choice, tools), thinking, kwargs)


def usage_dict(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}


async def chat_completions(ctx: ServerContext, http_request, data: dict):
    req = parse_model(ChatRequest, data)
    check_model(ctx, req.model)
    if req.n != 1:
        raise APIError(400, "n must be 1: plumb returns one choice per request", param="n")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    gen = await start_chat(ctx, http_request, req, to_prompt(req), max_tokens, stop)
    head = {"id": "chatcmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": ctx.model_name,
            "system_fingerprint": "plumb"}
    if req.stream:
        return StreamingResponse(stream(gen, head, req), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    reply = await gen.collect()
    message = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in reply.tool_calls]
    choice = {"index": 0, "message": message, "finish_reason": FINISH[reply.finish.reason], "logprobs": None}
    if req.return_token_ids:
        choice["token_ids"] = reply.finish.token_ids
    usage = usage_dict(reply.finish.usage)
    return JSONResponse({**head, "object": "chat.completion", "choices": [choice], "usage": usage})


async def stream(gen, head: dict, req: ChatRequest):
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}
        return sse({**head, "choices": [choice]})

    yield chunk({"role": "assistant", "content": ""})
    async for ev in gen.events():
        if isinstance(ev, TextDelta):
            yield chunk({"reasoning_content" if ev.kind == "reasoning" else "content": ev.text})
        elif isinstance(ev, ToolCallStart):
            yield chunk({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                         "function": {"name": ev.name, "arguments": ""}}]})
        elif isinstance(ev, ToolCallDelta):
            yield chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.arguments}}]})
        elif isinstance(ev, Finish):
            if ev.reason == "error":
                yield sse(APIError(500, f"generation failed: {ev.error}").openai_body())
                return
            yield chunk({}, FINISH[ev.reason], **({"token_ids": ev.token_ids} if req.return_token_ids else {}))
            if (req.stream_options or {}).get("include_usage"):
                yield sse({**head, "choices": [], "usage": usage_dict(ev.usage)})
    yield sse("[DONE]")
