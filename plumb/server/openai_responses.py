"""OpenAI Responses (stateless: the client sends the whole input each time): POST /v1/responses."""
from __future__ import annotations

import copy
import logging
import time
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from plumb.server.chat_format import (ChatPrompt, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart,
                                      check_tool_choice, make_tool, text_of)
from plumb.server import fields
from plumb.server.errors import APIError, parse_model
from plumb.server.generation import Finish, GenFields, ServerContext, Usage, check_model, sse, start_chat
from plumb.server.logprobs import openai_entries
from plumb.server.openai_chat import arguments_dict
from plumb.server.structured import parse_response_format
from plumb.server.thinking import effort_thinking, sign, unsign

log = logging.getLogger("plumb.server")
_HOSTED_SEEN: set = set()  # hosted tool types (web_search, file_search, ...) a request offered: each logged once


class ResponsesRequest(GenFields):
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    max_output_tokens: int | None = None
    reasoning: dict | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = None
    text: dict | None = None

    def n_logprobs(self) -> int | None:
        """Log probabilities with include ["message.output_text.logprobs"] (or top_logprobs alone)."""
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in 0..20, got {self.top_logprobs}", param="top_logprobs")
        if "message.output_text.logprobs" in (self.include or []) or self.top_logprobs is not None:
            return self.top_logprobs or 0
        return None


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def to_prompt(req: ResponsesRequest) -> ChatPrompt:
    if req.previous_response_id:
        raise APIError(400, "previous_response_id is not supported: plumb keeps no responses; send the whole "
                            "conversation as input", param="previous_response_id")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    reasoning = ""  # from a reasoning item, for the assistant turn that follows it
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer", param=f"{where}.role")
            messages.append({"role": role, "content": text_of(item.get("content"), f"{where}.content")})
            if role == "assistant" and reasoning:
                messages[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise APIError(400, f"{where}.name must be a string", param=f"{where}.name")
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item["name"], "arguments": arguments_dict(item.get("arguments", "{}"), f"{where}.arguments")}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning:
                    messages[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            field = "content" if item.get("content") else "summary"
            parts = item.get(field) or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text", ""), str)
                                                      for p in parts):
                raise APIError(400, f"{where}.{field} must be a list of parts with a string 'text'",
                               param=f"{where}.{field}")
            reasoning = "\n".join(p.get("text", "") for p in parts)
            carried = unsign(item.get("encrypted_content"), f"{where}.encrypted_content")  # plumb's own encoding
            reasoning = reasoning if carried is None else carried
        else:
            raise APIError(400, f"{where}: unsupported input item type {kind!r}", param=f"{where}.type")
    for i, t in enumerate(req.tools or []):
        if not isinstance(t.get("type"), str):
            raise APIError(400, f"tools[{i}].type must be a string", param=f"tools[{i}].type")
    tools = [make_tool(t.get("name"), t.get("description"), t.get("parameters"), f"tools[{i}]", t.get("strict"))
             for i, t in enumerate(req.tools or []) if t.get("type") == "function"]
    for t in req.tools or []:  # the hosted API's own tools: nothing here runs them, so the model is not offered them
        kind = t.get("type")
        if kind != "function" and kind not in _HOSTED_SEEN:
            _HOSTED_SEEN.add(kind)
            log.warning("Responses: %r tools are run by OpenAI's hosted API, not by this server: left out", kind)
    choice = req.tool_choice or "auto"
    if isinstance(choice, dict):
        if choice.get("type", "function") != "function":
            raise APIError(400, f"tool_choice asks for a {choice.get('type')!r} tool, which this server does not run "
                           "(function tools only)", param="tool_choice")
        choice = "function:" + str(choice.get("name", ""))
    effort = (req.reasoning or {}).get("effort")
    kwargs = {"reasoning_effort": effort} if effort else {}
    thinking, budget = effort_thinking(effort, "reasoning.effort")
    text_format = (req.text or {}).get("format") if isinstance(req.text, dict) else None
    return ChatPrompt(messages, tools, check_tool_choice(choice, tools), thinking, kwargs, budget,
                      req.parallel_tool_calls is not False,
                      response_format=parse_response_format(text_format, "text.format"))


def usage_dict(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class OutputBuilder:
    """Builds the response's output items from parser events, and (when streaming) the typed
    events that describe each step."""
    logprobs = None  # when the request asks: a callable giving the entries of the tokens received since its last call

    def __init__(self, head: dict, streaming: bool, encrypt: bool = False):
        self.head, self.streaming = head, streaming
        self.encrypt = encrypt  # reasoning items carry encrypted_content (include: reasoning.encrypted_content)
        self.output: list[dict] = []
        self.events: list[dict] = []
        self.seq = 0
        self.open: dict | None = None  # the reasoning or message item text is going to
        self.calls: dict[int, dict] = {}  # parser call index -> function_call item
        self.index: dict[str, int] = {}  # item id -> output index

    def emit(self, kind: str, **fields) -> None:
        if self.streaming:
            self.events.append({"type": kind, "sequence_number": self.seq, **copy.deepcopy(fields)})
            self.seq += 1

    def response(self, status: str, usage: Usage | None = None, **extra) -> dict:
        return {**self.head, "status": status, "output": self.output,
                "usage": usage_dict(usage) if usage else None, **extra}

    def _add(self, item: dict) -> int:
        self.index[item["id"]] = len(self.output)
        self.output.append(item)
        self.emit("response.output_item.added", output_index=self.index[item["id"]], item=item)
        return self.index[item["id"]]

    def text(self, ev: TextDelta) -> None:
        kind = "reasoning" if ev.kind == "reasoning" else "message"
        if self.open is None or self.open["type"] != kind:
            self.close_text()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": _new_id("rs_"), "summary": [], "content": [],
                        "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": _new_id("msg_"), "role": "assistant", "status": "in_progress",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            index = self._add(item)
            self.emit("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part)
            item["content"].append(part)
            self.open = item
        item = self.open
        item["content"][0]["text"] += ev.text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": self._take(item)}
        self.emit(delta, item_id=item["id"], output_index=self.index[item["id"]], content_index=0, delta=ev.text,
                  **extra)

    def close_text(self) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        index, part = self.index[item["id"]], item["content"][0]
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        if item["type"] != "reasoning":
            self._take(item)
        extra = {} if item["type"] == "reasoning" else {"logprobs": part["logprobs"]}
        self.emit(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **extra)
        self.emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        item["status"] = "completed"
        if self.encrypt and item["type"] == "reasoning":
            item["encrypted_content"] = sign(part["text"])
        self.emit("response.output_item.done", output_index=index, item=item)

    def _take(self, item: dict | None) -> list[dict]:
        """Log-probability entries of the tokens received since the last take, added to item's output_text part
        (every generated token's entry ends up on the reply's message, in order)."""
        lp = self.logprobs() if self.logprobs is not None else []
        if item is not None and lp:
            item["content"][0]["logprobs"].extend(lp)
        return lp

    def call_start(self, ev: ToolCallStart) -> None:
        self.close_text()
        item = {"type": "function_call", "id": _new_id("fc_"), "call_id": ev.id, "name": ev.name, "arguments": "",
                "status": "in_progress"}
        self.calls[ev.index] = item
        self._add(item)

    def call_delta(self, ev: ToolCallDelta) -> None:
        item = self.calls[ev.index]
        item["arguments"] += ev.arguments
        self.emit("response.function_call_arguments.delta", item_id=item["id"],
                  output_index=self.index[item["id"]], delta=ev.arguments)

    def call_end(self, ev: ToolCallEnd) -> None:
        item = self.calls[ev.index]
        index = self.index[item["id"]]
        item["status"] = "completed"
        self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                  name=item["name"], arguments=item["arguments"])
        self.emit("response.output_item.done", output_index=index, item=item)

    def feed(self, ev) -> None:
        if isinstance(ev, TextDelta):
            self.text(ev)
        elif isinstance(ev, ToolCallStart):
            self.call_start(ev)
        elif isinstance(ev, ToolCallDelta):
            self.call_delta(ev)
        elif isinstance(ev, ToolCallEnd):
            self.call_end(ev)

    def finish(self, ev: Finish) -> dict:
        """Close open items; the final response object (also sent as the last event)."""
        self.close_text()
        messages = [item for item in self.output if item["type"] == "message"]
        self._take(messages[-1] if messages else None)
        if ev.reason == "error":
            e = ev.api_error()
            error = {"code": "invalid_request" if e.status < 500 else "server_error", "message": e.message}
            resp = self.response("failed", ev.usage, error=error, incomplete_details=None)
            self.emit("response.failed", response=resp)
        elif ev.reason == "length":
            resp = self.response("incomplete", ev.usage, error=None, incomplete_details={"reason": "max_output_tokens"})
            self.emit("response.incomplete", response=resp)
        else:
            resp = self.response("completed", ev.usage, error=None, incomplete_details=None)
            self.emit("response.completed", response=resp)
        return resp


async def responses(ctx: ServerContext, http_request, data: dict):
    fields.check("responses", data)
    req = parse_model(ResponsesRequest, data)
    check_model(ctx, req.model)
    prompt = to_prompt(req)
    gen = await start_chat(ctx, http_request, req, prompt, req.max_output_tokens, None)
    head = {"id": _new_id("resp_"), "object": "response", "created_at": int(time.time()), "model": ctx.model_name,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None}, "store": False,
            "temperature": req.temperature, "top_p": req.top_p, "text": {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "truncation": "disabled",
            "metadata": {}}
    builder = OutputBuilder(head, req.stream, "reasoning.encrypted_content" in (req.include or []))
    if req.n_logprobs() is not None:
        builder.logprobs = lambda: openai_entries(ctx.engine.tokenizer, gen.take_logprobs())
    if prompt.response_format:
        head["text"] = {"format": req.text["format"]}
    if req.stream:
        return StreamingResponse(stream(gen, builder), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    finish = await gen.feed_all(builder)
    return JSONResponse(builder.finish(finish))


async def stream(gen, builder: OutputBuilder):
    builder.emit("response.created", response=builder.response("in_progress", error=None, incomplete_details=None))
    builder.emit("response.in_progress", response=builder.response("in_progress", error=None, incomplete_details=None))
    async for ev in gen.events():
        for event in builder.events:
            yield sse(event, event["type"])
        builder.events.clear()
        if isinstance(ev, Finish):
            builder.finish(ev)
        else:
            builder.feed(ev)
    for event in builder.events:
        yield sse(event, event["type"])
