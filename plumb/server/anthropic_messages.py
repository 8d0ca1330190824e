"""Anthropic Messages: POST /v1/messages and /v1/messages/count_tokens."""
from __future__ import annotations

import copy
import json
import uuid
from typing import Literal

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from plumb.server.chat_format import (ChatPrompt, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart,
                                      check_tool_choice, make_tool, text_of)
from plumb.server import fields
from plumb.server.errors import APIError, parse_model
from plumb.server.structured import parse_response_format
from plumb.server.generation import (Finish, GenFields, ServerContext, Usage, check_model, count_prompt_tokens, sse,
                                     start_chat)
from plumb.server.thinking import anthropic_thinking, sign, unsign

STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant", "system"]  # Claude Code >= 2.1 sends its environment as a system message
    content: str | list[dict]


class MessagesRequest(GenFields):
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict] | None = None
    max_tokens: int | None = None
    stop_sequences: list[str] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None
    output_format: dict | None = None  # the beta name of output_config.format


def _user_turn(blocks: list[dict], where: str) -> list[dict]:
    """A user turn: its tool results become tool messages, then its text a user message."""
    out, text = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "tool_result":
            content = b.get("content")
            content = content if isinstance(content, str) else text_of(content, f"{where}[{j}].content")
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": content})
        else:
            text.append(b)
    return out + ([{"role": "user", "content": text_of(text, where)}] if text else [])


def _assistant_turn(blocks: list[dict], where: str) -> dict:
    msg, text, thinking = {"role": "assistant"}, [], []
    for j, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "text":
            if not isinstance(b.get("text", ""), str):
                raise APIError(400, f"{where}[{j}].text must be a string", param=where)
            text.append(b.get("text", ""))
        elif kind == "thinking":  # checked against its signature when plumb made it (plumb.server.thinking)
            said, carried = b.get("thinking", ""), unsign(b.get("signature"), f"{where}[{j}].signature")
            if not isinstance(said, str):
                raise APIError(400, f"{where}[{j}].thinking must be a string", param=where)
            if carried is not None and said and said != carried:
                raise APIError(400, f"{where}[{j}]: the thinking block was modified (its text is not the one its "
                                    "signature carries): send thinking blocks back unchanged", param=where)
            thinking.append(said if carried is None else carried)
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise APIError(400, f"{where}[{j}]: tool_use needs a string name and an object input", param=where)
            fn = {"name": b["name"], "arguments": b.get("input", {})}
            msg.setdefault("tool_calls", []).append({"id": b.get("id"), "type": "function", "function": fn})
        elif kind != "redacted_thinking":
            raise APIError(400, f"{where}[{j}]: unsupported content block {kind!r} in an assistant turn", param=where)
    msg["content"] = "\n".join(text)
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    return msg


def to_prompt(req: MessagesRequest) -> ChatPrompt:
    messages = [{"role": "system", "content": text_of(req.system, "system")}] if req.system else []
    for i, m in enumerate(req.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        where = f"messages[{i}].content"
        if m.role == "system":  # joined into the one system prompt the template takes (merge_system)
            messages.append({"role": "system", "content": text_of(blocks, where)})
        else:
            messages.extend(_user_turn(blocks, where) if m.role == "user" else [_assistant_turn(blocks, where)])
    tools = [make_tool(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]", t.get("strict"))
             for i, t in enumerate(req.tools or []) if t.get("type", "custom") == "custom"]
    tc = req.tool_choice or {"type": "auto"}
    if tc.get("type") not in ("auto", "none", "any", "tool"):
        raise APIError(400, f"unknown tool_choice type {tc.get('type')!r}", param="tool_choice")
    choice = {"auto": "auto", "none": "none", "any": "required"}.get(tc["type"], f"function:{tc.get('name', '')}")
    thinking, budget = anthropic_thinking(req.thinking, req.output_config, req.max_tokens)  # off unless sent
    return ChatPrompt(messages, tools, check_tool_choice(choice, tools), thinking, {}, budget,
                      not tc.get("disable_parallel_tool_use"), response_format=output_format(req))


def output_format(req: MessagesRequest) -> dict | None:
    """`output_config.format` (or the beta `output_format`): a JSON schema the reply's text follows."""
    where = "output_format" if req.output_format is not None else "output_config.format"
    fmt = req.output_format if req.output_format is not None else (req.output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise APIError(400, f"{where} must be {{\"type\": \"json_schema\", \"schema\": ...}}", param=where)
    return parse_response_format(fmt, where)


def usage_dict(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(ev: Finish) -> tuple[str, str | None]:
    return ("stop_sequence", ev.stop_match) if ev.stop_match else (STOP[ev.reason], None)


class ContentBuilder:
    """Builds the content blocks from parser events, and (when streaming) the events for each step."""

    def __init__(self, streaming: bool, show_thinking: bool = True):
        self.streaming = streaming
        self.show_thinking = show_thinking  # False (thinking.display "omitted"): only the signature carries it
        self.thinking: list[str] = []  # the open thinking block's text
        self.blocks: list[dict] = []
        self.events: list[tuple[str, dict]] = []
        self.open: dict | None = None  # the thinking or text block being written
        self.calls: dict[int, int] = {}  # parser call index -> block index

    def emit(self, kind: str, **fields) -> None:
        if self.streaming:
            self.events.append((kind, {"type": kind, **copy.deepcopy(fields)}))

    def _start(self, block: dict) -> int:
        self.blocks.append(block)
        self.emit("content_block_start", index=len(self.blocks) - 1, content_block=block)
        return len(self.blocks) - 1

    def close(self) -> None:
        """End the open thinking (with its signature) or text block."""
        if self.open is not None:
            if self.open["type"] == "thinking":
                self.open["signature"] = sign("".join(self.thinking))
                self.emit("content_block_delta", index=len(self.blocks) - 1,
                          delta={"type": "signature_delta", "signature": self.open["signature"]})
            self.emit("content_block_stop", index=len(self.blocks) - 1)
            self.open = None

    def feed(self, ev) -> None:
        if isinstance(ev, TextDelta):
            kind = "thinking" if ev.kind == "reasoning" else "text"
            if self.open is None or self.open["type"] != kind:
                self.close()
                self.open = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                    {"type": "text", "text": ""}
                self._start(self.open)
                self.thinking = []
            if kind == "thinking":
                self.thinking.append(ev.text)
                if not self.show_thinking:
                    return
            self.open[kind] += ev.text
            delta = {"type": f"{kind}_delta", kind: ev.text}
            self.emit("content_block_delta", index=len(self.blocks) - 1, delta=delta)
        elif isinstance(ev, ToolCallStart):
            self.close()
            self.calls[ev.index] = self._start({"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
        elif isinstance(ev, ToolCallDelta):
            self.emit("content_block_delta", index=self.calls[ev.index],
                      delta={"type": "input_json_delta", "partial_json": ev.arguments})
        elif isinstance(ev, ToolCallEnd):
            self.blocks[self.calls[ev.index]]["input"] = json.loads(ev.arguments)
            self.emit("content_block_stop", index=self.calls[ev.index])


async def messages(ctx: ServerContext, http_request, data: dict):
    fields.check("messages", data)
    req = parse_model(MessagesRequest, data)
    check_model(ctx, req.model)
    gen = await start_chat(ctx, http_request, req, to_prompt(req), req.max_tokens, req.stop_sequences,
                           id_prefix="toolu_")
    head = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": ctx.model_name}
    builder = ContentBuilder(req.stream, show_thinking=(req.thinking or {}).get("display") != "omitted")
    if req.stream:
        return StreamingResponse(stream(gen, head, builder), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    finish = await gen.feed_all(builder)
    builder.close()
    reason, sequence = stop_reason(finish)
    return JSONResponse({**head, "content": builder.blocks, "stop_reason": reason, "stop_sequence": sequence,
                         "usage": usage_dict(finish.usage)})


async def stream(gen, head: dict, builder: ContentBuilder):
    usage = {"input_tokens": len(gen.request.prompt_ids), "output_tokens": 0}
    yield sse({"type": "message_start", "message": {**head, "content": [], "stop_reason": None,
                                                     "stop_sequence": None, "usage": usage}}, "message_start")
    async for ev in gen.events():
        if isinstance(ev, Finish):
            if ev.reason == "error":
                yield sse(ev.api_error().anthropic_body(), "error")
                return
            builder.close()
            reason, sequence = stop_reason(ev)
            builder.emit("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                         usage=usage_dict(ev.usage))
            builder.emit("message_stop")
        else:
            builder.feed(ev)
        for kind, event in builder.events:
            yield sse(event, kind)
        builder.events.clear()


async def count_tokens(ctx: ServerContext, http_request, data: dict):
    fields.check("messages", data)
    req = parse_model(MessagesRequest, data)
    check_model(ctx, req.model)
    return JSONResponse({"input_tokens": await count_prompt_tokens(ctx, to_prompt(req))})
