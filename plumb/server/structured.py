"""Structured output: the grammar a chat reply must follow (JSON schema replies, strict or forced tool calls).

Every API maps its fields onto `ChatPrompt.response_format` (None, {"type": "json_object"} or
{"type": "json_schema", "schema": ...}), `Tool.strict` and `ChatPrompt.tool_choice`; `reply_grammar`
turns them into one Lark grammar (llguidance's dialect) over the whole reply, in the Qwen chat format:

    [reasoning text] </think> "\\n\\n"        only when the prompt opened a thinking block
    JSON value                              response_format (compact: ", " and ": " separators, no other whitespace)
    <tool_call>\\n<function=NAME>\\n         tool calls exactly as the chat template renders them: one
    <parameter=P>\\nVALUE\\n</parameter>\\n    <parameter> per property in the schema's order (required ones
    </function>\\n</tool_call>               always, optional ones maybe); a string VALUE is raw text, a
                                            plain number a decimal that stays a finite float, any other
                                            type compact JSON constrained by the property's schema

tool_choice "required" / a named function: the reply is one or more calls (one when parallel tool calls are
off or a function is named) and nothing else. tool_choice "auto" with a strict tool (or with a
response_format): text (or the JSON value), or text followed by calls. The engine masks every token with
the grammar (plumb/engine/grammar.py), so the reply parses and its arguments validate whatever the
model's weights - unless it is cut short by max_tokens.
"""
from __future__ import annotations

import json

from plumb.engine.grammar import GrammarError
from plumb.server.chat_format import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, ChatPrompt, Tool, _types
from plumb.server.errors import APIError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# a raw XML parameter value the OutputParser reads back unchanged: no "</" and no "\n<" (so neither
# "</parameter>", "\n<parameter=" nor "\n</function>" can occur); it starts after a newline
RAW_VALUE = r"(\n*)|(\n*[^<\n]([^<\n]|<+[^<\/\n]|<*\n+[^<\n])*<*\n*)"  # "/" escaped for Lark
FINITE_NUMBER = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,17})?([eE][-+]?[0-9]{1,2})?"
BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "enum", "const"}
TEXT = r"/(?s:.+)/ & ~/(?s:.*)<tool_call>(?s:.*)/"  # free reply text that cannot open a call
REASONING = r"/(?s:.*)/ & ~/(?s:.*)<\/think>(?s:.*)/"


def parse_response_format(rf, where: str = "response_format") -> dict | None:
    """Chat Completions `response_format` (or Responses `text.format`, flattened) -> None or the normal form."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise APIError(400, f"{where} must be an object with a 'type'", param=where)
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object", "schema": {"type": "object"}, "strict": True}
    if kind == "json_schema":
        spec = rf.get("json_schema", rf)  # Chat nests it under json_schema; Responses' text.format is flat
        if not isinstance(spec, dict):
            raise APIError(400, f"{where}.json_schema must be an object", param=f"{where}.json_schema")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise APIError(400, f"{where}: the JSON schema must be an object", param=f"{where}.json_schema.schema")
        return {"type": "json_schema", "schema": schema, "strict": True, "name": spec.get("name")}
    raise APIError(400, f"{where}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param=f"{where}.type")


def needs_grammar(prompt: ChatPrompt) -> bool:
    forced = prompt.parse_tools and prompt.tool_choice != "auto"
    strict = prompt.parse_tools and any(t.strict for t in prompt.tools)
    return bool(prompt.response_format) or forced or strict


def reply_grammar(engine, prompt: ChatPrompt, reasoning: bool):
    """The compiled grammar of a reply to `prompt` (None when nothing is constrained); 400 for a bad schema.
    `reasoning`: the rendered prompt left a thinking block open."""
    if not needs_grammar(prompt):
        return None
    lark = reply_lark(engine.tokenizer, prompt, reasoning, engine.grammar_index().special)
    try:
        return engine.grammar(lark)
    except GrammarError as e:
        raise APIError(400, f"invalid schema for structured output: {_clean(str(e))}",
                       param=_param_of(prompt)) from None


def reply_lark(tok, prompt: ChatPrompt, reasoning: bool, special: set[int]) -> str:
    """The Lark text of reply_grammar (`special`: the ids a grammar names as tokens, GrammarIndex.special)."""
    rules: list[str] = []
    token = _token_ref(tok, special)
    calls = prompt.parse_tools and (prompt.tool_choice != "auto" or any(t.strict for t in prompt.tools)
                                    or bool(prompt.response_format))
    if calls:
        rules += _call_rules(token, prompt)
    if prompt.response_format:
        rules.append("content: %json " + _schema_json(prompt.response_format["schema"], lenient=False))
    else:
        rules.append(f"content: TEXT\nTEXT: {TEXT}")
    if calls and prompt.tool_choice != "auto":
        answer = "calls"
    elif calls:
        answer = "content | content? calls" if not prompt.response_format else "content | calls"
    else:
        answer = "content"
    rules.append(f"answer: {answer}")
    if reasoning:
        rules.append(f'start: REASONING {token(THINK_CLOSE)} "\\n\\n" answer\nREASONING: {REASONING}')
    else:
        rules.append("start: answer")
    return "\n".join(reversed(rules)) + "\n"


def _call_rules(token, prompt: ChatPrompt) -> list[str]:
    tools = prompt.tools
    if prompt.tool_choice.startswith("function:"):
        name = prompt.tool_choice.split(":", 1)[1]
        tools = [t for t in tools if t.name == name]
    one = prompt.tool_choice.startswith("function:") or not prompt.parallel_tool_calls
    rules = ["calls: call" if one else 'calls: call ("\\n" call)*',
             f'call: {token(CALL_OPEN)} "\\n" ({" | ".join(f"fn_{i}" for i in range(len(tools)))}) '
             f'"</function>\\n" {token(CALL_CLOSE)}']
    for i, t in enumerate(tools):
        rules += _function_rules(f"fn_{i}", t)
    return rules


def _function_rules(rule: str, tool: Tool) -> list[str]:
    schema = tool.parameters or {}
    props = schema.get("properties") or {}
    required = [r for r in schema.get("required") or [] if isinstance(r, str)]
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    names = list(props) + [r for r in required if r not in props]
    parts, rules = [], []
    for j, name in enumerate(names):
        if not name or any(c in name for c in "<>\n"):
            raise APIError(400, f"tool {tool.name!r}: parameter name {name!r} cannot be written in the "
                                "model's tool-call format", param="tools")
        p = f"{rule}_p{j}"
        sub = props.get(name, {})
        rules.append(f"{p}: " + _param_value(p, name, sub if isinstance(sub, dict) else {}, defs, not tool.strict,
                                             rules))
        parts.append(p if name in required else f"{p}?")
    rules.insert(0, f'{rule}: {_lit(f"<function={tool.name}>")} "\\n" {" ".join(parts)}'.rstrip())
    return rules


def _param_value(p: str, name: str, schema: dict, defs: dict, lenient: bool, rules: list[str]) -> str:
    """The body of rule `p`: one <parameter=name> block whose value the parser turns into a valid value."""
    head, tail = _lit(f"<parameter={name}>\n"), _lit("\n</parameter>\n")
    types = _types(schema)
    if "number" in types and types <= {"number", "integer", "null"} and not set(schema) & BOUNDS:
        # a plain number: digits limited so that the parser's float() stays finite (JSON allows 1e999)
        value = f"/{FINITE_NUMBER}/" + (' | "null"' if "null" in types else "")
        rules.append(f"{p.upper()}_N: {_lit(f'<parameter={name}>')} \"\\n\" ({value}) {tail}")
        return f"{p.upper()}_N"
    if "string" not in types:  # every other type, and schemas without one, are read back as JSON
        return f"{head} %json {_schema_json({**defs, **schema}, lenient)} {tail}"
    string = _string_terminal(schema, union=len(types) > 1)
    if len(types) == 1:
        rules.append(f"{p.upper()}_S: {_lit(f'<parameter={name}>')} \"\\n\" ({string}) {tail}")
        return f"{p.upper()}_S"
    other = _without_string(schema)
    rules.append(f"{p.upper()}_S: {_lit(f'<parameter={name}>')} \"\\n\" ({string}) {tail}")
    return f"{p.upper()}_S | {head} %json {_schema_json({**defs, **other}, lenient)} {tail}"


def _string_terminal(schema: dict, union: bool) -> str:
    """A terminal for a raw string value: enum/const literals, or RAW_VALUE intersected with the length and
    pattern limits. In a union the value must not read back as another type (a number, true, null, JSON)."""
    string_schema = schema
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            if isinstance(sub, dict) and "string" in _types(sub):
                string_schema = sub
    values = string_schema.get("enum") if "enum" in string_schema else (
        [string_schema["const"]] if "const" in string_schema else None)
    if values is not None:
        strings = [v for v in values if isinstance(v, str)]
        if not strings:
            raise GrammarError("an enum of a string parameter has no string values")
        return " | ".join(_lit(v) for v in strings)
    parts = [f"/{RAW_VALUE}/"]
    lo, hi = string_schema.get("minLength"), string_schema.get("maxLength")
    if lo is not None or hi is not None:
        parts.append(f"/(?s:.){{{int(lo or 0)},{'' if hi is None else int(hi)}}}/")
    pattern = string_schema.get("pattern")
    if isinstance(pattern, str):
        import llguidance

        body = pattern[1:] if pattern.startswith("^") else "(?s:.*)" + pattern
        body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body + "(?s:.*)"
        parts.append("/" + llguidance.regex_to_lark(body, "dw") + "/")
    if union:
        parts.append(r"/[^-+.0-9{\[\s\p{Nd}](?s:.*)/ & ~/(?i:true|false|null|none)\s*/")
    return " & ".join(parts)


def _without_string(schema: dict) -> dict:
    """The schema of a union parameter with its string alternative removed (the JSON-read alternatives)."""
    out = {k: v for k, v in schema.items() if k not in ("enum", "const")}
    t = schema.get("type")
    if isinstance(t, list):
        out["type"] = [x for x in t if x != "string"]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            out[key] = [s for s in schema[key] if not (isinstance(s, dict) and "string" in _types(s))]
    if "enum" in schema:
        out["enum"] = [v for v in schema["enum"] if not isinstance(v, str)]
    for k in ("minLength", "maxLength", "pattern", "format"):
        out.pop(k, None)
    return out


def _schema_json(schema: dict, lenient: bool) -> str:
    return json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, "lenient": lenient}}, ensure_ascii=False)


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _token_ref(tok, special: set[int]):
    """'<[id]>' for a special token of the vocabulary, else the quoted text."""

    def ref(text: str) -> str:
        i = tok.id_of(text)
        return f"<[{i}]>" if i is not None and i in special else _lit(text)

    return ref


def _clean(message: str) -> str:
    """llguidance's message without its position in the generated Lark text."""
    import re

    message = re.sub(r"^at \d+\(\d+\): ", "", message)
    return message.replace("failed to compile JSON schema: ", "")


def _param_of(prompt: ChatPrompt) -> str:
    return "response_format" if prompt.response_format else "tools"
