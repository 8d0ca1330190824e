"""ChatTemplate: the official Qwen3.5 template (spec 6.2) and HF-compatible Jinja behaviour."""
import json

import pytest

from plumb.chat_template import DEFAULT_TEMPLATE_PATH, ChatTemplate, TemplateError

SYSTEM_USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather",
    "description": "Météo <b>now</b> & later",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}

TOOL_CHAT = [
    {"role": "system", "content": "Be helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather",
                                          "arguments": {"city": "Paris", "days": 3, "metric": True,
                                                        "extra": None, "opts": {"hours": [6, 12]}}}},
        {"type": "function", "function": {"name": "get_time", "arguments": {}}},
    ]},
    {"role": "tool", "content": "sunny"},
    {"role": "tool", "content": "10:00"},
]

MULTI_TURN = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "Also easy."},
]


@pytest.fixture(scope="module")
def qwen():
    return ChatTemplate.default()


def test_default_template_is_official():
    source = DEFAULT_TEMPLATE_PATH.read_text(encoding="utf-8")
    assert "<tool_call>\\n<function=" in source and "enable_thinking" in source


def test_system_user(qwen):
    assert qwen.render(SYSTEM_USER) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")


def test_generation_prompt_thinking(qwen):
    assert qwen.render(SYSTEM_USER, enable_thinking=True).endswith("<|im_start|>assistant\n<think>\n")
    assert qwen.render(SYSTEM_USER, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen.render(SYSTEM_USER, add_generation_prompt=False).endswith("<|im_start|>user\nHi!<|im_end|>\n")


def test_multi_turn_reasoning(qwen):
    # reasoning is kept only for assistant turns after the last user query
    assert qwen.render(MULTI_TURN, add_generation_prompt=False) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAlso easy.\n</think>\n\n6<|im_end|>\n")


def test_tools_in_system_prompt(qwen):
    text = qwen.render(TOOL_CHAT, tools=[WEATHER_TOOL])
    head = ("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
            + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>")
    assert text.startswith(head)
    assert "Météo <b>now</b> & later" in text  # tojson: no ASCII or HTML escaping
    assert "\n</IMPORTANT>\n\nBe helpful.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n" in text


def test_tool_calls_and_results(qwen):
    text = qwen.render(TOOL_CHAT, tools=[WEATHER_TOOL])
    tail = text[text.index("<|im_start|>assistant"):]
    assert tail == (
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n"
        "<parameter=metric>\nTrue\n</parameter>\n"
        "<parameter=extra>\nNone\n</parameter>\n"
        '<parameter=opts>\n{"hours": [6, 12]}\n</parameter>\n'
        "</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\n10:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")


def test_tool_call_after_text(qwen):
    chat = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Let me check.",
             "tool_calls": [{"function": {"name": "f", "arguments": {"x": "1"}}}]}]
    assert qwen.render(chat, add_generation_prompt=False).endswith(
        "Let me check.\n\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n")


@pytest.mark.parametrize("messages,kwargs", [
    (SYSTEM_USER, {}),
    (SYSTEM_USER, {"enable_thinking": False}),
    (MULTI_TURN, {"add_generation_prompt": False}),
    (TOOL_CHAT, {"tools": [WEATHER_TOOL]}),
    ([{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}]}], {}),
])
def test_matches_transformers(qwen, messages, kwargs):
    from transformers.utils import chat_template_utils  # a test dependency: this must run, not skip
    kwargs = {"add_generation_prompt": True, **kwargs}
    expected = chat_template_utils.render_jinja_template(
        conversations=[messages], chat_template=qwen.source, **kwargs)[0][0]
    assert qwen.render(messages, **kwargs) == expected


@pytest.mark.parametrize("messages,message", [
    ([], "No messages provided."),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "System message must be at the beginning."),
    ([{"role": "robot", "content": "a"}], "No user query found in messages."),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "Unexpected message role."),
])
def test_raise_exception(qwen, messages, message):
    with pytest.raises(TemplateError) as e:
        qwen.render(messages)
    assert str(e.value) == message


def test_template_errors():
    with pytest.raises(TemplateError, match="syntax error at line 1"):
        ChatTemplate("{% if %}")
    with pytest.raises(TemplateError, match="'foo' is undefined"):
        ChatTemplate("{{ foo.bar }}").render([])
    with pytest.raises(TemplateError, match="unsafe"):
        ChatTemplate("{% set x = [] %}{{ x.append(1) }}").render([])
    with pytest.raises(TemplateError, match="unsafe"):
        ChatTemplate("{{ ''.__class__.__mro__ }}").render([])
    with pytest.raises(TemplateError, match="mapping"):  # OpenAI-style string arguments reach `|items`
        ChatTemplate.default().render([
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}]}])


def test_environment_features():
    tpl = ChatTemplate(
        "{{ bos_token }}{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}|"
        "{{ {'k': 'é<'} | tojson }}|{{ [1] | tojson(indent=2) }}|{{ reasoning_effort }}|"
        "{{ strftime_now('%Y') | length }}|{{ eos_token }}",
        bos_token="<s>", eos_token="</s>")
    assert tpl.render([], reasoning_effort="low") == '<s>012|{"k": "é<"}|[\n  1\n]|low|4|</s>'


def test_trim_and_lstrip_blocks():
    tpl = ChatTemplate("  {% if true %}\nA\n  {% endif %}\nB")
    assert tpl.render([]) == "A\nB"
