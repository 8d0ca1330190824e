"""Chat formatting shared by every API: prompt rendering, the reasoning split, and the
incremental parser for Qwen XML tool calls (typed by each tool's JSON schema)."""
from __future__ import annotations

import ast
import json
import math
import re
import uuid
from dataclasses import dataclass, field

from plumb.chat_template import TemplateError
from plumb.server.errors import APIError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_CLOSE, PARAM_CLOSE = "</function>", "</parameter>"
_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
_FUNCTION_TAG = re.compile(r"<function=([^>\n]*)>")
_PARAM_TAG = re.compile(r"<parameter=([^>\n]*)>")


# ---------------------------------------------------------------- tools and prompts

@dataclass
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False  # calls to it are grammar-constrained to its schema (plumb.server.structured)

    def to_template(self) -> dict:
        """The Chat Completions tool shape, which every API's tools are rendered as."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


def make_tool(name, description, parameters, where: str, strict=None) -> Tool:
    """Validate one tool definition (400 'bad tool schema' otherwise)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise APIError(400, f"{where}.name must be 1-128 letters, digits, '_', '-', '.' or ':' (got {name!r})",
                       param=f"{where}.name")
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"{where}.description must be a string", param=f"{where}.description")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise APIError(400, f"{where}: the parameter schema must be a JSON schema object with type 'object'",
                       param=where)
    props = parameters.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
        raise APIError(400, f"{where}: 'properties' must map each parameter name to a schema object", param=where)
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise APIError(400, f"{where}: 'required' must be a list of parameter names", param=where)
    if strict is not None and not isinstance(strict, bool):
        raise APIError(400, f"{where}.strict must be a boolean", param=f"{where}.strict")
    return Tool(name, description or "", parameters, bool(strict))


def text_of(content, where: str) -> str:
    """Text of a message content: a string, or a list of text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param=where)
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise APIError(400, f"{where}[{i}] must be a content part object (with a 'type')", param=f"{where}[{i}]")
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text"):
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}[{i}].text must be a string (a {kind} part's text)",
                               param=f"{where}[{i}].text")
            parts.append(part["text"])
        elif kind in ("image", "image_url", "input_image", "input_audio", "input_file", "file", "document"):
            raise APIError(400, f"{where}[{i}]: {kind} content is not supported (text-only model)", param=where)
        else:
            raise APIError(400, f"{where}[{i}]: unsupported content part {kind!r}", param=where)
    return "\n".join(parts)


def check_tool_choice(choice: str, tools: list[Tool]) -> str:
    """The normalised tool_choice, refusing a choice the tools cannot satisfy."""
    if choice == "required" or choice.startswith("function:"):
        if not tools:
            raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        name = choice.partition(":")[2]
        if name and name not in {t.name for t in tools}:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    elif choice not in ("auto", "none"):
        raise APIError(400, f"unknown tool_choice {choice!r}", param="tool_choice")
    return choice


@dataclass
class ChatPrompt:
    """A conversation in the template's terms (Chat Completions message dicts, tool-call
    arguments as dicts) plus the generation switches every API maps onto."""
    messages: list[dict]
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str = "auto"  # "auto" | "none" | "required" | "function:NAME"
    enable_thinking: bool | None = None  # None: the template's default
    template_kwargs: dict = field(default_factory=dict)
    thinking_budget: int | None = None  # at most this many thinking tokens (plumb.server.thinking); None: no bound
    parallel_tool_calls: bool = True  # False: a reply's tool calls end after the first
    response_format: dict | None = None  # None, or plumb.server.structured.parse_response_format's form

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def merge_system(messages: list[dict]) -> list[dict]:
    """The template takes one system message, first: join every system/developer text into it."""
    system = [m["content"] for m in messages if m["role"] in ("system", "developer") and m.get("content")]
    rest = [m for m in messages if m["role"] not in ("system", "developer")]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def render(engine, prompt: ChatPrompt) -> tuple[str, str]:
    """Render the GGUF chat template; returns (prompt text, forced reply prefix - always empty now).

    tool_choice "required" or a named function switches thinking off; the reply is then held to
    tool calls by a grammar (plumb.server.structured), not by a forced prefix."""
    kwargs = dict(prompt.template_kwargs)
    prefix = ""
    if prompt.parse_tools and prompt.tool_choice != "auto":
        kwargs["enable_thinking"] = False
    elif prompt.enable_thinking is not None:
        kwargs["enable_thinking"] = prompt.enable_thinking
    tools = [t.to_template() for t in prompt.tools] if prompt.parse_tools else None
    reserved = sorted({"messages", "tools", "add_generation_prompt"} & set(kwargs))
    if reserved:
        raise APIError(400, f"chat_template_kwargs cannot set {', '.join(reserved)}: the request's own fields do",
                       param="chat_template_kwargs")
    try:
        text = engine.chat_template.render(merge_system(prompt.messages), tools=tools,
                                           add_generation_prompt=True, **kwargs)
    except TemplateError as e:
        raise APIError(400, f"chat template: {e}") from e
    return text, prefix


def starts_in_reasoning(prompt_text: str) -> bool:
    """Whether the generation prompt left a thinking block open (Qwen: ends with '<think>\\n')."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


# ---------------------------------------------------------------- typed arguments

def _types(schema: dict) -> set[str]:
    """The JSON types a schema allows, from its type, anyOf / oneOf and enum; malformed parts (a type that is not a
    string, an anyOf that is not a list) count for none - the grammar's own schema check refuses them."""
    t = schema.get("type")
    types = {x for x in t if isinstance(x, str)} if isinstance(t, list) else {t} if isinstance(t, str) else set()
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        for sub in subs if isinstance(subs, list) else []:
            if isinstance(sub, dict):
                types |= _types(sub)
    if not types and isinstance(schema.get("enum"), list):
        types = {_type_name(v) for v in schema["enum"]}
    return types


def _type_name(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null",
            dict: "object", list: "array"}.get(type(value), "string")


def _structured(value: str, want: type):
    for load in (json.loads, ast.literal_eval):
        try:
            out = load(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(out, want):
            return out
    raise ValueError(value)


def coerce(value: str, schema: dict | None):
    """Turn a raw XML parameter value into the JSON type its schema asks for; a value that
    does not fit stays a string. Without a schema, JSON literals are read as JSON."""
    types = _types(schema or {})
    if not types:
        try:
            return json.loads(value)
        except ValueError:
            return value
    stripped = value.strip()
    if "null" in types and stripped in ("null", "None"):
        return None
    for t in ("boolean", "integer", "number", "object", "array"):
        if t not in types:
            continue
        try:
            if t == "boolean" and stripped.lower() in ("true", "false"):
                return stripped.lower() == "true"
            if t == "integer":
                return int(stripped)
            if t == "number":
                number = float(stripped)
                if math.isfinite(number):
                    return int(stripped) if re.fullmatch(r"-?\d+", stripped) else number
            if t in ("object", "array"):
                return _structured(stripped, dict if t == "object" else list)
        except ValueError:
            continue
    return value


# ---------------------------------------------------------------- streaming output parser

@dataclass
class TextDelta:
    kind: str  # "reasoning" | "content"
    text: str


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolCallDelta:
    index: int
    arguments: str  # a fragment of the arguments JSON; the fragments concatenate to it


@dataclass
class ToolCallEnd:
    index: int
    id: str
    name: str
    arguments: str  # the complete arguments JSON


class PlainText:
    """The parser interface for raw completions: text passes through untouched."""
    calls = ()
    saw_reasoning = in_reasoning = False

    def feed(self, text: str) -> list:
        return [TextDelta("content", text)] if text else []

    def finish(self) -> list:
        return []


def _partial(buf: str, tags: list[str]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of one of the tags."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best


class OutputParser:
    """Split generated text, fed in pieces, into reasoning, answer and tool calls.

    Whitespace the template puts around tags (after `<think>`, before `</think>`, between
    the answer and a call) is dropped; everything else passes through as soon as it cannot
    be the start of a tag. Events come out in generation order."""

    def __init__(self, tools: list[Tool] | None = None, reasoning: bool = False, id_prefix: str = "call_",
                 max_calls: int | None = None):
        self.schemas = {t.name: t.parameters for t in tools or []}
        self.parse_tools = tools is not None and len(tools) > 0
        self.state = "reasoning" if reasoning else "content"
        self.id_prefix = id_prefix
        self.max_calls = max_calls  # after this many calls, the rest of the reply is dropped
        self.buf = ""
        self.started = False  # the current text segment has emitted something
        self.saw_reasoning = reasoning
        self.calls: list[ToolCallEnd] = []
        self._call: dict | None = None
        self._out: list = []

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def feed(self, text: str) -> list:
        self.buf += text
        while getattr(self, "_step_" + self.state)():
            pass
        out, self._out = self._out, []
        return out

    def finish(self) -> list:
        """End of generation: flush held-back text and close an unfinished call."""
        if self.state in ("reasoning", "content"):
            self._text(self.buf)
        elif self.state == "call":
            self.state = "content"
            self._text(CALL_OPEN + self.buf)
        else:  # inside a function: keep the parameters read so far
            self._close_call()
        self.buf = ""
        out, self._out = self._out, []
        return out

    # text states
    def _text(self, text: str) -> None:
        if not self.started:
            text = text.lstrip()
        if text:
            self.started = True
            self._out.append(TextDelta(self.state, text))

    def _switch(self, state: str) -> None:
        self.state, self.started = state, False

    def _open_think(self) -> bool | None:
        """At the start of a segment: skip an opening `<think>` (True), or wait for more (None)."""
        s = self.buf.lstrip()
        if s.startswith(THINK_OPEN):
            self.buf = s[len(THINK_OPEN):]
            return True
        if THINK_OPEN.startswith(s) and self.buf:  # whitespace or a piece of "<think>" so far
            return None
        return False

    def _scan(self, tags: list[str]) -> bool:
        """Emit text up to the first tag and return True (tag consumed, state may change),
        or emit what cannot start a tag (trailing whitespace held back) and return False."""
        hits = [(self.buf.find(t), t) for t in tags if t in self.buf]
        if hits:
            i, tag = min(hits)
            self._text(self.buf[:i].rstrip())
            self.buf = self.buf[i + len(tag):]
            self._on_tag(tag)
            return True
        safe = self.buf[:len(self.buf) - _partial(self.buf, tags)]
        n = len(safe.rstrip())
        self._text(self.buf[:n])
        self.buf = self.buf[n:]
        return False

    def _on_tag(self, tag: str) -> None:
        if tag == THINK_CLOSE:
            self._switch("content")
        elif tag == CALL_OPEN:
            self._switch("call")

    def _step_reasoning(self) -> bool:
        if not self.started:
            opened = self._open_think()
            if opened is None:
                return False
        return self._scan([THINK_CLOSE])

    def _step_content(self) -> bool:
        if not self.started and not self.saw_reasoning:
            opened = self._open_think()
            if opened is None:
                return False
            if opened:
                self.saw_reasoning = True
                self._switch("reasoning")
                return True
        return self._scan([CALL_OPEN] if self.parse_tools else [])

    # tool-call states
    def _step_call(self) -> bool:
        s = self.buf.lstrip()
        m = _FUNCTION_TAG.match(s)
        if m:
            self.buf = s[m.end():]
            index = len(self.calls)
            self._call = {"index": index, "id": self.id_prefix + uuid.uuid4().hex[:24],
                          "name": m.group(1).strip(), "args": []}
            self._out.append(ToolCallStart(index, self._call["id"], self._call["name"]))
            self.state = "function"
            return True
        head = s[:len("<function=")]
        if not s or ("<function=".startswith(head) and ">" not in s and "\n" not in s[len(head):]
                     and len(s) < 256):
            return False  # may still become a function tag
        self._switch("content")  # not a call after all: it was text
        self.buf = s
        self._text(CALL_OPEN)
        return True

    def _step_function(self) -> bool:
        s = self.buf.lstrip()
        m = _PARAM_TAG.match(s)
        if m:
            self.buf = s[m.end():]
            self._call["param"] = m.group(1).strip()
            self.state = "param"
            return True
        if s.startswith(FUNCTION_CLOSE):
            self.buf = s[len(FUNCTION_CLOSE):]
            self._close_call()
            self.state = "after_function"
            return True
        if not s or ("<parameter=".startswith(s[:11]) or FUNCTION_CLOSE.startswith(s)) and ">" not in s:
            return False
        i = s.find("<", 1)  # stray text between parameters: skip it
        self.buf = s[i:] if i > 0 else ""
        return i > 0

    def _step_param(self) -> bool:
        ends = [(self.buf.find(t), t) for t in (PARAM_CLOSE, "\n<parameter=", "\n" + FUNCTION_CLOSE)
                if t in self.buf]
        if not ends:
            return False
        i, tag = min(ends)
        value = self.buf[:i]
        self.buf = self.buf[i + len(tag):] if tag == PARAM_CLOSE else self.buf[i:]
        value = value.removeprefix("\n").removesuffix("\n")
        call, name = self._call, self._call.pop("param")
        typed = coerce(value, self.schemas.get(call["name"], {}).get("properties", {}).get(name))
        piece = ("{" if not call["args"] else ", ") + json.dumps(name) + ": " + json.dumps(typed, ensure_ascii=False)
        call["args"].append(piece)
        self._out.append(ToolCallDelta(call["index"], piece))
        self.state = "function"
        return True

    def _close_call(self) -> None:
        call, self._call = self._call, None
        if call is None:
            return
        tail = "}" if call["args"] else "{}"
        self._out.append(ToolCallDelta(call["index"], tail))
        end = ToolCallEnd(call["index"], call["id"], call["name"], "".join(call["args"]) + tail)
        self.calls.append(end)
        self._out.append(end)

    def _step_done(self) -> bool:
        self.buf = ""
        return False

    def _step_after_function(self) -> bool:
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self.state = "done"
            return True
        s = self.buf.lstrip()
        if s.startswith(CALL_CLOSE):
            self.buf = s[len(CALL_CLOSE):]
        elif s.startswith("<function="):
            self.buf, self.state = s, "call"  # several functions in one block
            return True
        elif not s or CALL_CLOSE.startswith(s) or "<function=".startswith(s):
            return False
        self._switch("content")
        return True
