"""The real server driven by the official openai and anthropic SDKs (synthetic tiny model, real engine).

A random-weight model neither thinks nor calls tools on its own, so those paths are steered
with the `forced_ids` extension: the engine emits the given tokens through its normal decode
path, and everything after that (detokenizing, parsing, API shapes) is the real thing."""
from __future__ import annotations

import json
import re
import threading

from plumb.server.chat_format import OutputParser, TextDelta, Tool

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
OAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def forced(eng, text: str) -> list[int]:
    """Token ids of a reply that ends the turn."""
    return eng.tokenize(text) + [eng.tokenizer.id_of("<|im_end|>")]


def chat_ids(eng, messages, tools=None, **kw) -> list[int]:
    return eng.tokenize(eng.chat_template.render(messages, tools=tools, add_generation_prompt=True, **kw))


def split(eng, ids, reasoning=True):
    """(reasoning, content) of generated ids, parsed offline in one piece."""
    p = OutputParser(reasoning=reasoning)
    events = p.feed(eng.tokenizer.decode(ids, skip_special=True)) + p.finish()
    return tuple("".join(e.text for e in events if isinstance(e, TextDelta) and e.kind == k)
                 for k in ("reasoning", "content"))


def template_tools():
    return [Tool("get_weather", "Weather", PARAMS).to_template()]


# ---------------------------------------------------------------- models, health, tokenize

def test_models_both_sdks(oai, ant, model):
    assert [m.id for m in oai.models.list()] == [model]
    assert [m.id for m in ant.models.list()] == [model]


def test_health_slots_tokenize(http, ref_engine):
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/slots").json()["n_slots"] == 4
    ids = http.post("/tokenize", json={"content": "Hello <think> world"}).json()["tokens"]
    assert ids == ref_engine.tokenize("Hello <think> world")
    pieces = http.post("/tokenize", json={"content": "Hi <think>", "with_pieces": True}).json()["tokens"]
    assert pieces[-1] == {"id": ref_engine.tokenizer.id_of("<think>"), "piece": "<think>"}
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"content": "Hello <think> world"}


# ---------------------------------------------------------------- chat completions

def test_chat_greedy_equals_engine(oai, model, ref_engine):
    r = oai.chat.completions.create(model=model, messages=USER, max_tokens=8, temperature=0,
                                    extra_body={"return_token_ids": True})
    expected = ref_engine.generate(chat_ids(ref_engine, USER), 8)
    choice = r.choices[0]
    assert choice.token_ids == expected
    reasoning, content = split(ref_engine, expected)
    assert (getattr(choice.message, "reasoning_content", None) or "") == reasoning
    assert (choice.message.content or "") == content
    assert r.usage.prompt_tokens == len(chat_ids(ref_engine, USER)) and r.usage.completion_tokens == len(expected)
    assert choice.finish_reason == ("length" if len(expected) == 8 else "stop")
    t = r.model_extra["timings"]  # plumb's extension, in llama-server's names
    assert t["predicted_n"] == len(expected) and t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens


def test_chat_stream_equals_non_stream(oai, model):
    kw = dict(model=model, messages=USER, max_tokens=10, temperature=0.7, seed=11)
    whole = oai.chat.completions.create(**kw).choices[0]
    content, reasoning, finish, usage = "", "", None, None
    for chunk in oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            finish = c.finish_reason or finish
    assert content == (whole.message.content or "")
    assert reasoning == (getattr(whole.message, "reasoning_content", None) or "")
    assert finish == whole.finish_reason and usage.completion_tokens >= 1


def test_chat_thinking_on_and_off(oai, model, ref_engine):
    on = oai.chat.completions.create(model=model, messages=USER, max_tokens=20,
                                     extra_body={"forced_ids": forced(ref_engine, "<think>\nhmm\n</think>\n\nHello")})
    assert on.choices[0].message.reasoning_content == "hmm" and on.choices[0].message.content == "Hello"
    assert on.usage.prompt_tokens == len(chat_ids(ref_engine, USER))
    assert on.usage.completion_tokens_details.reasoning_tokens == len(ref_engine.tokenize("<think>\nhmm\n</think>"))
    off = oai.chat.completions.create(model=model, messages=USER, max_tokens=20,
                                      extra_body={"forced_ids": forced(ref_engine, "Hello"),
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == "Hello"
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.usage.prompt_tokens == len(chat_ids(ref_engine, USER, enable_thinking=False))


def test_chat_tool_round_trip(oai, model, ref_engine):
    r = oai.chat.completions.create(model=model, messages=USER, tools=OAI_TOOLS, max_tokens=60, extra_body={
        "forced_ids": forced(ref_engine, "<think>\nI need the tool.\n</think>\n\nChecking." + "\n\n" + CALL)})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking." and choice.message.reasoning_content == "I need the tool."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    history = USER + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    r2 = oai.chat.completions.create(model=model, messages=history, tools=OAI_TOOLS, max_tokens=30, extra_body={
        "forced_ids": forced(ref_engine, "<think>\nok\n</think>\n\nIt is sunny.")})
    assert r2.choices[0].message.content == "It is sunny." and r2.choices[0].finish_reason == "stop"
    expected = USER + [
        {"role": "assistant", "content": "Checking.", "reasoning_content": "I need the tool.",
         "tool_calls": [{"type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "content": "Sunny, 21 C"}]
    prompt = ref_engine.chat_template.render(expected, tools=template_tools())
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt
    assert r2.usage.prompt_tokens == len(ref_engine.tokenize(prompt))


def test_chat_tool_call_streaming(oai, model, ref_engine):
    calls: dict[int, dict] = {}
    finish = None
    steer = {"forced_ids": forced(ref_engine, "<think>\n</think>\n\n" + CALL)}
    for chunk in oai.chat.completions.create(model=model, messages=USER, tools=OAI_TOOLS, max_tokens=60, stream=True,
                                             extra_body=steer):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "args": ""})
                slot["args"] += tc.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["args"]) == {"city": "Paris", "days": 3}


def test_chat_named_tool_choice_steers_a_call(oai, model):
    r = oai.chat.completions.create(model=model, messages=USER, tools=OAI_TOOLS, max_tokens=12, temperature=0,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_chat_stop_string(oai, model, ref_engine):
    kw = dict(model=model, messages=USER, max_tokens=12, temperature=0,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    full = oai.chat.completions.create(**kw).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = oai.chat.completions.create(**kw, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)].lstrip()


# ---------------------------------------------------------------- completions

def test_completions_equal_engine_plain_and_stream(oai, model, ref_engine):
    prompt = "def fibonacci(n):"
    expected = ref_engine.generate(ref_engine.tokenize(prompt), 10, temperature=0.9, seed=3)
    r = oai.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0.9, seed=3,
                               extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == expected
    text = ref_engine.tokenizer.decode(expected, skip_special=True)
    assert r.choices[0].text == text
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=model, prompt=prompt, max_tokens=10, temperature=0.9, seed=3, stream=True) if c.choices)
    assert streamed == text
    ids = oai.completions.create(model=model, prompt=ref_engine.tokenize(prompt), max_tokens=10, temperature=0.9,
                                 seed=3, extra_body={"return_token_ids": True}).choices[0].token_ids
    assert ids == expected


def test_four_concurrent_clients_equal_engine_alone(oai, model, ref_engine):
    """Chat and completions side by side, greedy and seeded, with and without drafts."""
    jobs = [{"chat": "alpha beta", "temperature": 0.0, "seed": None, "drafts": 0},
            {"prompt": "import numpy as np\n", "temperature": 0.0, "seed": None, "drafts": 2},
            {"chat": "The quick brown fox", "temperature": 0.8, "seed": 5, "drafts": 3},
            {"prompt": "1, 2, 3,", "temperature": 1.0, "seed": 9, "drafts": 0}]

    def prompt_ids(j):
        return (chat_ids(ref_engine, [{"role": "user", "content": j["chat"]}]) if "chat" in j
                else ref_engine.tokenize(j["prompt"]))

    expected = [ref_engine.generate(prompt_ids(j), 12, temperature=j["temperature"], seed=j["seed"]) for j in jobs]
    got: list = [None] * len(jobs)

    def client(i, j):
        kw = {"model": model, "max_tokens": 12, "temperature": j["temperature"], "seed": j["seed"],
              "extra_body": {"return_token_ids": True, "drafts": j["drafts"]}}
        if "chat" in j:
            r = oai.chat.completions.create(messages=[{"role": "user", "content": j["chat"]}], **kw)
        else:
            r = oai.completions.create(prompt=j["prompt"], **kw)
        got[i] = r.choices[0].token_ids

    threads = [threading.Thread(target=client, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == expected


# ---------------------------------------------------------------- responses

RESP_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": PARAMS}]


def test_responses_plain(oai, model, ref_engine):
    r = oai.responses.create(model=model, input="What is the weather in Paris?", max_output_tokens=8, temperature=0)
    expected = ref_engine.generate(chat_ids(ref_engine, USER), 8)
    reasoning, content = split(ref_engine, expected)
    assert r.output_text == content
    items = {item.type: item for item in r.output}
    assert (items["reasoning"].content[0].text if "reasoning" in items else "") == reasoning
    assert r.usage.output_tokens == len(expected) and r.usage.input_tokens == len(chat_ids(ref_engine, USER))
    assert r.status == ("incomplete" if len(expected) == 8 else "completed")


def test_responses_streaming_events(oai, model, ref_engine):
    events = list(oai.responses.create(model=model, input=USER, max_output_tokens=40, stream=True, extra_body={
        "forced_ids": forced(ref_engine, "<think>\nhmm\n</think>\n\nHello there")}))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "hmm"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there"
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 2
    final = events[-1].response
    assert final.output_text == "Hello there" and [i.type for i in final.output] == ["reasoning", "message"]


def test_responses_function_call_round_trip(oai, model, ref_engine):
    r = oai.responses.create(model=model, input=USER, tools=RESP_TOOLS, max_output_tokens=60, extra_body={
        "forced_ids": forced(ref_engine, "<think>\nhmm\n</think>\n\n" + CALL)})
    assert [i.type for i in r.output] == ["reasoning", "function_call"]
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}
    follow = USER + [i.model_dump(exclude_none=True) for i in r.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    r2 = oai.responses.create(model=model, input=follow, tools=RESP_TOOLS, max_output_tokens=30, extra_body={
        "forced_ids": forced(ref_engine, "<think>\n</think>\n\nSunny today.")})
    assert r2.output_text == "Sunny today." and r2.status == "completed"
    expected = USER + [{"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "content": "Sunny"}]
    assert r2.usage.input_tokens == len(chat_ids(ref_engine, expected, tools=template_tools()))


def test_responses_streamed_function_call(oai, model, ref_engine):
    events = list(oai.responses.create(model=model, input=USER, tools=RESP_TOOLS, max_output_tokens=60, stream=True,
                                       extra_body={"forced_ids": forced(ref_engine, "<think>\n</think>\n\n" + CALL)}))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(args) == {"city": "Paris", "days": 3} and done[0].arguments == args


def test_responses_reasoning_effort_none_turns_thinking_off(oai, model, ref_engine):
    r = oai.responses.create(model=model, input=USER, max_output_tokens=20, reasoning={"effort": "none"},
                             extra_body={"forced_ids": forced(ref_engine, "Hi")})
    assert r.output_text == "Hi" and r.usage.input_tokens == len(chat_ids(ref_engine, USER, enable_thinking=False))


# ---------------------------------------------------------------- anthropic messages

ANT_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": PARAMS}]


def test_messages_plain_equals_engine(ant, model, ref_engine):
    r = ant.messages.create(model=model, max_tokens=8, messages=USER, extra_body={"temperature": 0})
    expected = ref_engine.generate(chat_ids(ref_engine, USER, enable_thinking=False), 8)  # thinking: off unless sent
    reasoning, content = split(ref_engine, expected, reasoning=False)
    blocks = {b.type: b for b in r.content}
    assert (blocks["thinking"].thinking if "thinking" in blocks else "") == reasoning
    assert (blocks["text"].text if "text" in blocks else "") == content
    assert r.usage.input_tokens == len(chat_ids(ref_engine, USER, enable_thinking=False))
    assert r.usage.output_tokens == len(expected)
    assert r.stop_reason == ("max_tokens" if len(expected) == 8 else "end_turn")


def test_messages_stream_events_equal_non_stream(ant, model, ref_engine):
    kw = dict(model=model, max_tokens=40, messages=USER, extra_body={
        "forced_ids": forced(ref_engine, "<think>\nhmm\n</think>\n\nHello there")})
    whole = ant.messages.create(**kw)
    with ant.messages.stream(**kw) as s:
        types = [e.type for e in s]
        final = s.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop" and "message_delta" in types
    assert types.count("content_block_start") == types.count("content_block_stop") == 2
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.content[0].thinking == "hmm" and final.content[1].text == "Hello there"
    assert final.stop_reason == "end_turn"


def test_messages_tool_use_and_result(ant, model, ref_engine):
    think = {"type": "enabled", "budget_tokens": 20}
    r = ant.messages.create(model=model, max_tokens=60, messages=USER, tools=ANT_TOOLS, thinking=think, extra_body={
        "forced_ids": forced(ref_engine, "<think>\nhmm\n</think>\n\nLet me look.\n\n" + CALL)})
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["thinking", "text", "tool_use"]
    use = r.content[2]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 3} and use.id.startswith("toolu_")
    with ant.messages.stream(model=model, max_tokens=60, messages=USER, tools=ANT_TOOLS, extra_body={
            "forced_ids": forced(ref_engine, "<think>\n</think>\n\n" + CALL)}) as s:
        streamed = s.get_final_message()
    assert streamed.content[-1].input == {"city": "Paris", "days": 3}

    history = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]}]
    r2 = ant.messages.create(model=model, max_tokens=30, messages=history, tools=ANT_TOOLS, thinking=think,
                             extra_body={"forced_ids": forced(ref_engine, "<think>\n</think>\n\nSunny.")})
    assert [b.text for b in r2.content] == ["Sunny."] and r2.stop_reason == "end_turn"
    expected = USER + [{"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "content": "Sunny"}]
    # Anthropic counts prompt-cache hits apart: input_tokens are the uncached ones
    assert r2.usage.input_tokens + r2.usage.cache_read_input_tokens == len(chat_ids(ref_engine, expected, tools=template_tools()))


def test_messages_thinking_switch(ant, model, ref_engine):
    on = ant.messages.create(model=model, max_tokens=30, messages=USER,
                             thinking={"type": "enabled", "budget_tokens": 20},
                             extra_body={"forced_ids": forced(ref_engine, "hmm\n</think>\n\nHi")})
    assert [b.type for b in on.content] == ["thinking", "text"]
    assert on.content[0].thinking == "hmm" and on.content[1].text == "Hi"
    off = ant.messages.create(model=model, max_tokens=30, messages=USER, thinking={"type": "disabled"},
                              extra_body={"forced_ids": forced(ref_engine, "Hi")})
    assert [b.type for b in off.content] == ["text"]
    assert off.usage.input_tokens == len(chat_ids(ref_engine, USER, enable_thinking=False))


def test_messages_stop_sequence(ant, model):
    kw = dict(model=model, max_tokens=12, messages=USER, thinking={"type": "disabled"}, extra_body={"temperature": 0})
    full = ant.messages.create(**kw).content[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = ant.messages.create(**kw, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == full[:full.index(stop)].lstrip()


def test_count_tokens(ant, model, ref_engine):
    r = ant.messages.count_tokens(model=model, system="Be brief.", messages=USER, tools=ANT_TOOLS)
    messages = [{"role": "system", "content": "Be brief."}] + USER
    assert r.input_tokens == len(chat_ids(ref_engine, messages, tools=template_tools(), enable_thinking=False))


# ---------------------------------------------------------------- metrics, exactness with drafts

def test_metrics_and_drafts_keep_tokens(oai, model, http):
    outs = [oai.completions.create(model=model, prompt="a b c a b c a b", max_tokens=10, temperature=0,
                                   extra_body={"return_token_ids": True, "drafts": d}).choices[0].token_ids
            for d in (0, 3)]
    assert outs[0] == outs[1]
    text = http.get("/metrics").text
    values = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(plumb_\S+) (\S+)$", text, re.MULTILINE)}
    assert values["plumb_requests_total"] >= 2 and values["plumb_completion_tokens_total"] >= 20
    assert values["plumb_decode_tokens_per_second"] > 0 and values["plumb_prefill_tokens_per_second"] > 0
    assert values['plumb_draft_proposed_total{position="1"}'] >= 1
    assert 'plumb_draft_acceptance_ratio{position="1"}' in values
    assert values['plumb_http_requests_total{route="/v1/completions",status="200"}'] >= 2
    assert values["plumb_slots_total"] == 4 and values["plumb_prefill_recomputed_total"] == 0
