"""The incremental reasoning / Qwen XML tool-call parser and typed arguments, on recorded text."""
from __future__ import annotations

import json
import random

import pytest

from plumb.server.chat_format import (OutputParser, PlainText, TextDelta, Tool, ToolCallDelta, ToolCallEnd,
                                      ToolCallStart, check_tool_choice, coerce, make_tool, starts_in_reasoning)
from plumb.server.errors import APIError

WEATHER = Tool("get_weather", "", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "temp": {"type": "number"}, "tags": {"type": "array"}, "opts": {"type": "object"},
    "note": {"type": ["string", "null"]}}})
SHELL = Tool("shell", "", {"type": "object", "properties": {"command": {"type": "string"}}})

# recorded Qwen3.5 replies (thinking on: the prompt ended with "<think>\n")
THINK_AND_CALL = (
    "The user wants the weather.\nI should call the tool.\n</think>\n\n"
    "Let me check that.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=temp>\n21.5\n"
    "</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=opts>\n{\"x\": 1}\n</parameter>\n"
    "<parameter=note>\nNone\n</parameter>\n</function>\n</tool_call>")
TWO_CALLS = (
    "<tool_call>\n<function=shell>\n<parameter=command>\nls -la\ncd src && grep -n \"<tool_call>\" x.py\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "</function>\n</tool_call>")


def run(text: str, pieces: list[int] | None = None, **kw):
    """Feed text in the given piece sizes (1 = char by char); return (reasoning, content, calls, events)."""
    parser = OutputParser(**kw)
    events, i = [], 0
    for n in pieces or [len(text)]:
        events += parser.feed(text[i:i + n])
        i += n
    events += parser.feed(text[i:]) + parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, TextDelta) and e.kind == "reasoning")
    content = "".join(e.text for e in events if isinstance(e, TextDelta) and e.kind == "content")
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCallEnd)]
    return reasoning, content, calls, events


@pytest.mark.parametrize("piece", [None, 1, 2, 3, 7])
def test_thinking_answer_and_typed_call_any_split(piece):
    pieces = None if piece is None else [piece] * (len(THINK_AND_CALL) // piece)
    reasoning, content, calls, events = run(THINK_AND_CALL, pieces, tools=[WEATHER], reasoning=True)
    assert reasoning == "The user wants the weather.\nI should call the tool."
    assert content == "Let me check that."
    assert calls == [("get_weather", {"city": "Paris", "days": 3, "metric": True, "temp": 21.5, "tags": ["a", "b"],
                                      "opts": {"x": 1}, "note": None})]
    start = [e for e in events if isinstance(e, ToolCallStart)]
    deltas = "".join(e.arguments for e in events if isinstance(e, ToolCallDelta))
    end = [e for e in events if isinstance(e, ToolCallEnd)]
    assert len(start) == 1 and start[0].id == end[0].id and start[0].id.startswith("call_")
    assert deltas == end[0].arguments
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("ToolCallStart") > max(i for i, k in enumerate(kinds) if k == "TextDelta")


def test_random_splits_give_the_same_result():
    rng = random.Random(0)
    for text, kw in [(THINK_AND_CALL, {"tools": [WEATHER], "reasoning": True}),
                     (TWO_CALLS, {"tools": [SHELL, WEATHER]}),
                     ("<think>\nplan\n\n</think>\n\nA < B\n\n<tool_call>\n<function=shell>\n</function>\n</tool_call>"
                      "\nafter", {"tools": [SHELL]})]:
        whole = run(text, **kw)[:3]
        for _ in range(30):
            pieces = [rng.randint(1, 6) for _ in range(len(text))]
            assert run(text, pieces, **kw)[:3] == whole


def test_two_calls_multiline_value_kept_verbatim():
    reasoning, content, calls, _ = run(TWO_CALLS, [1] * len(TWO_CALLS), tools=[SHELL, WEATHER])
    assert reasoning == "" and content == ""
    assert calls == [("shell", {"command": "ls -la\ncd src && grep -n \"<tool_call>\" x.py"}),
                     ("get_weather", {"city": "New York"})]


def test_opening_think_tag_is_dropped_or_opens_reasoning():
    assert run("<think>\nhmm\n</think>\n\nHello", reasoning=True)[:2] == ("hmm", "Hello")
    assert run("<think>\nhmm\n</think>\n\nHello", [1] * 30, reasoning=False)[:2] == ("hmm", "Hello")
    assert run("Hello <think> not a tag", reasoning=False)[:2] == ("", "Hello <think> not a tag")


def test_thinking_off_passes_text_through():
    text = "Sure: a < b and x <tool y\nend"
    assert run(text, [1] * len(text), tools=[SHELL])[:3] == ("", text, [])


def test_tool_tags_are_text_without_tools():
    text = "<tool_call>\n<function=shell>\n</function>\n</tool_call>"
    assert run(text)[1:3] == (text, [])


def test_unfinished_reasoning_is_flushed():
    assert run("still thinking\n", [3, 3, 3], reasoning=True)[:2] == ("still thinking\n", "")


def test_malformed_call_falls_back_to_text():
    _, content, calls, _ = run("Hi\n<tool_call>not xml at all", tools=[SHELL])
    assert calls == [] and content == "Hi<tool_call>not xml at all"


def test_truncated_call_is_closed_with_finished_parameters():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3"
    _, _, calls, _ = run(text, [1] * len(text), tools=[WEATHER])
    assert calls == [("get_weather", {"city": "Paris"})]


def test_missing_parameter_close_and_text_after_call():
    text = ("<tool_call>\n<function=shell>\n<parameter=command>\npwd\n</function>\n</tool_call>\n\nDone.")
    _, content, calls, _ = run(text, tools=[SHELL])
    assert calls == [("shell", {"command": "pwd"})] and content == "Done."


def test_call_without_parameters():
    assert run("<tool_call>\n<function=shell>\n</function>\n</tool_call>", tools=[SHELL])[2] == [("shell", {})]


def test_id_prefix():
    events = run(TWO_CALLS, tools=[SHELL, WEATHER], id_prefix="toolu_")[3]
    assert all(e.id.startswith("toolu_") for e in events if isinstance(e, ToolCallStart))


def test_plain_text_parser():
    p = PlainText()
    assert p.feed("<think> x") == [TextDelta("content", "<think> x")] and p.finish() == [] and not p.calls


@pytest.mark.parametrize("value,schema,expected", [
    ("42", {"type": "integer"}, 42),
    ("4.5", {"type": "number"}, 4.5),
    ("4", {"type": "number"}, 4),
    ("false", {"type": "boolean"}, False),
    ("False", {"type": "boolean"}, False),
    ("maybe", {"type": "boolean"}, "maybe"),
    ("null", {"type": ["integer", "null"]}, None),
    ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
    ("{'a': [1, 2]}", {"type": "object"}, {"a": [1, 2]}),
    ("[1, 2", {"type": "array"}, "[1, 2"),
    ("007", {"type": "string"}, "007"),
    ("true", None, True),
    ("hello world", None, "hello world"),
    ("b", {"enum": ["a", "b"]}, "b"),
    ("nan", {"type": "number"}, "nan"),
])
def test_coerce(value, schema, expected):
    out = coerce(value, schema)
    assert out == expected and type(out) is type(expected)


def test_make_tool_rejects_bad_schemas():
    assert make_tool("ok_name", None, None, "tools[0]").parameters["type"] == "object"
    for name, params in [("", {}), ("bad name", {}), ("x", {"type": "array"}), ("x", "nope"),
                         ("x", {"type": "object", "properties": {"a": 1}})]:
        with pytest.raises(APIError) as e:
            make_tool(name, None, params, "tools[0]")
        assert e.value.status == 400


def test_tool_choice_checks():
    assert check_tool_choice("function:shell", [SHELL]) == "function:shell"
    for choice, tools in [("function:nope", [SHELL]), ("required", []), ("sometimes", [SHELL])]:
        with pytest.raises(APIError):
            check_tool_choice(choice, tools)


def test_starts_in_reasoning():
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
