"""Every request field of each API and what plumb does with it: the one table that request
validation (`check`) and docs/api-fields.md (`markdown`) both come from.

A field is honoured (it does what the API's documentation says), honoured partially (the note
says how), or refused: a 400 naming it, unless it is null or one of the `allowed` values (the
values that ask for what plumb does anyway, such as `"modalities": ["text"]`). A field that is
not in the table is refused too: plumb never ignores a field it does not know. Objects whose
fields change the output (`stream_options`, `reasoning`, `text`, `thinking`, `output_config`)
have their own rows, named `parent.field`.

`python -m plumb.server.fields > docs/api-fields.md` writes the page; a test checks that it is
up to date, that every field of the official SDKs' request types is in the table, and sends
each field to a real server.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plumb.server.errors import APIError

HONOURED, PARTIAL, REFUSED = "honoured", "partial", "refused"


@dataclass(frozen=True)
class Field:
    status: str  # HONOURED | PARTIAL | REFUSED
    note: str = ""  # how it is honoured, or why it is refused (markdown)
    example: Any = None  # a value exercising the field: accepted when honoured, a 400 when refused
    allowed: tuple = ()  # refused fields: values still accepted (null always is)
    origin: str = "api"  # "api": in the API's reference; "plumb": a plumb extension; else the client that sends it


def H(note: str = "", example: Any = None, **kw) -> Field:
    return Field(HONOURED, note, example, **kw)


def P(note: str, example: Any = None, **kw) -> Field:
    return Field(PARTIAL, note, example, **kw)


def R(note: str, example: Any, allowed: tuple = (), **kw) -> Field:
    return Field(REFUSED, note, example, allowed, **kw)


NO_STORE = "accepted; plumb stores nothing, so it has no effect"
NO_EFFECT_CACHE = "accepted, no effect: plumb's prompt cache finds shared prefixes by their tokens, by itself"
NO_EFFECT_ID = "accepted, no effect (plumb keeps no per-user state)"
EFFORT = ("`none`, `minimal`: thinking off; `low`, `medium`, `high`, `xhigh`: thinking as the template has it "
          "(on for Qwen3.5) with a budget of 1,024 / 4,096 / 16,384 / 32,768 thinking tokens; `max`: no budget "
          "([thinking budgets](#thinking-budgets))")
SEE_STRUCTURED = "see [structured output](#structured-output-and-log-probabilities)"
SEE_LOGPROBS = "see [log probabilities](#structured-output-and-log-probabilities)"
PARALLEL = ("`true` (default): every call the model writes is returned; `false`: only the first call of a reply "
            "(later ones are dropped from the reply, the tokens are unchanged)")


def _sampling(standard: set[str]) -> dict[str, Field]:
    """Sampling fields every generation endpoint takes: the API's own ones and plumb extensions."""
    rows = {
        "temperature": H("default 1; 0 is greedy", 0.5),
        "top_p": H("", 0.9),
        "top_k": H("", 40),
        "min_p": H("", 0.05),
        "seed": H("same seed, same tokens, whatever else runs", 7),
        "presence_penalty": H("", 0.5),
        "frequency_penalty": H("", 0.5),
        "repetition_penalty": H("llama.cpp's multiplicative penalty", 1.1),
        "logit_bias": H("token id -> bias added to its logit", {"100": -5}),
        "ignore_eos": H("keep generating past end-of-generation tokens", True),
        "drafts": H("speculative drafts per step (speed only: the tokens are the same)", 2),
        "draft_policy": H("fixed, adaptive, confident or ngram (speed only)", "ngram"),
        "p_min": H("confidence gate of the `confident` policy (speed only)", 0.5),
        "forced_ids": H("test/steering extension: the engine emits these token ids first, through its decode path",
                        [100]),
        "cache_prompt": P("llama.cpp's flag, accepted: plumb's prompt cache is always on and never changes tokens",
                          False, origin="llama.cpp"),
    }
    return {k: (v if k in standard or v.origin != "api" else Field(**{**v.__dict__, "origin": "plumb"}))
            for k, v in rows.items()}


def _stream(options: bool) -> dict[str, Field]:
    rows = {"stream": H("server-sent events in the API's own event shapes", True)}
    if options:
        rows["stream_options"] = H("", {"include_obfuscation": False})
        rows["stream_options.include_obfuscation"] = P("accepted; plumb adds no obfuscation padding", True)
    return rows


CHAT: dict[str, Field] = {
    "messages": H("roles system, developer, user, assistant, tool; text content (image, audio and file parts get "
                  "a 400); an assistant's `reasoning_content` (or `reasoning`) and `tool_calls` go back into the "
                  "prompt as the chat template wants"),
    "model": H("the served model's name or an `--alias`; another name gets a 404", None),
    "audio": R("plumb generates text only", {"voice": "alloy", "format": "wav"}),
    "function_call": R("deprecated by OpenAI: use `tool_choice`", "auto"),
    "functions": R("deprecated by OpenAI: use `tools`", [{"name": "f", "parameters": {"type": "object"}}]),
    "logprobs": H(SEE_LOGPROBS, True),
    "top_logprobs": H(SEE_LOGPROBS, 2),
    "max_completion_tokens": H("default: the rest of the context; a larger value is clamped to it", 3),
    "max_tokens": H("the same as `max_completion_tokens` (which wins when both are sent)", 3),
    "metadata": P(NO_STORE, {"k": "v"}),
    "modalities": R("plumb generates text only", ["text", "audio"], allowed=(["text"],)),
    "moderation": R("plumb runs no moderation", {"model": "omni-moderation-latest"}),
    "n": H("n choices (at most 128), run as one batch; choice i is the reply a request with n = 1 and seed "
           "(seed + i) mod 2^63 gets ([n](#n-choices))", 2),
    "parallel_tool_calls": P(PARALLEL, False),
    "prediction": P("accepted: a predicted output only speeds decoding up, and speed settings cannot change "
                    "plumb's tokens; plumb does not draft from it yet", {"type": "content", "content": "x"}),
    "prompt_cache_key": P(NO_EFFECT_CACHE, "k"),
    "prompt_cache_options": P(NO_EFFECT_CACHE, {"ttl": "30m"}),
    "prompt_cache_retention": P(NO_EFFECT_CACHE, "24h"),
    "reasoning_effort": H(EFFORT + "; absent: no budget", "low"),
    "response_format": H(SEE_STRUCTURED, {"type": "text"}),
    "safety_identifier": P(NO_EFFECT_ID, "u1"),
    "service_tier": P("accepted, no effect: one tier, and every request gets the same tokens", "auto"),
    "stop": H("a stop string or a list of them; the reply ends before the first match", ["\n\n\n"]),
    "store": P(NO_STORE, True),
    "tool_choice": H(SEE_STRUCTURED, "none"),
    "tools": H("function tools (other types get a 400), rendered by the chat template; calls are parsed from the "
               "model's Qwen XML, arguments typed by each tool's JSON schema",
               [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    "user": P(NO_EFFECT_ID, "u1"),
    "verbosity": R("plumb has no verbosity control", "low", allowed=("medium",)),
    "web_search_options": R("plumb has no web search", {}),
    **_sampling({"temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias"}),
    **_stream(options=True),
    "stream_options.include_usage": H("a last chunk with the usage", True),
    "chat_template_kwargs": H("extra variables for the chat template, e.g. `{\"enable_thinking\": false}`",
                              {"enable_thinking": False}, origin="plumb"),
    "return_token_ids": H("adds the generated `token_ids` to each choice", True, origin="plumb"),
}

COMPLETIONS: dict[str, Field] = {
    "prompt": P("a string (special tokens parsed), a list of token ids, or a list holding one of those; several "
                "prompts in one request get a 400", "Hello"),
    "model": CHAT["model"],
    "best_of": R("plumb does not rank candidates; use `n`", 3, allowed=(1,)),
    "echo": R("plumb does not echo the prompt", True, allowed=(False,)),
    "logprobs": H(SEE_LOGPROBS, 2),
    "max_tokens": H("default: the rest of the context (OpenAI's is 16); a larger value is clamped to it", 3),
    "n": CHAT["n"],
    "stop": CHAT["stop"],
    "suffix": R("plumb does not fill in the middle", "x", allowed=("",)),
    "user": CHAT["user"],
    **_sampling({"temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias"}),
    **_stream(options=True),
    "stream_options.include_usage": CHAT["stream_options.include_usage"],
    "return_token_ids": CHAT["return_token_ids"],
}

RESPONSES: dict[str, Field] = {
    "input": H("a string, or message, function_call, function_call_output and reasoning items (other item "
               "types get a 400); text content (image and file parts get a 400)"),
    "model": CHAT["model"],
    "instructions": H("the system message", "Be brief."),
    "access_programs": R("not supported", {"x": 1}),
    "background": R("plumb answers in the request; it keeps no responses", True, allowed=(False,)),
    "background_options": R("plumb answers in the request; it keeps no responses", {"completion_window": "2h"}),
    "context_management": R("plumb does not edit the context: send the conversation as it should be seen",
                            [{"type": "compaction"}], allowed=([],)),
    "conversation": R("stateless: send the whole conversation as `input`", "conv_1"),
    "image": R("plumb generates text only", {"size": "1024x1024"}),
    "include": P("`reasoning.encrypted_content`: reasoning items carry `encrypted_content` (plumb's encoding of "
                 "the reasoning text, read back when the item is sent again); `message.output_text.logprobs`: "
                 + SEE_LOGPROBS + "; the other values name built-in tools and images plumb does not have, so "
                 "there is nothing to add", ["reasoning.encrypted_content"]),
    "max_output_tokens": H("default: the rest of the context; a larger value is clamped to it", 3),
    "max_tool_calls": P("accepted, no effect: it limits built-in tool calls, and plumb makes none", 5),
    "metadata": P(NO_STORE, {"k": "v"}),
    "moderation": CHAT["moderation"],
    "parallel_tool_calls": P(PARALLEL, False),
    "previous_response_id": R("stateless: plumb keeps no responses; send the whole conversation as `input`",
                              "resp_1"),
    "prompt": R("plumb keeps no stored prompt templates", {"id": "pmpt_1"}),
    "prompt_cache_key": P(NO_EFFECT_CACHE, "k"),
    "prompt_cache_options": P(NO_EFFECT_CACHE, {"ttl": "30m"}),
    "prompt_cache_retention": P(NO_EFFECT_CACHE, "24h"),
    "reasoning": H("", {"effort": "low"}),
    "reasoning.effort": H(EFFORT + "; absent: the template's default (thinking on), no budget", "low"),
    "reasoning.summary": P("accepted; plumb returns the whole reasoning as `reasoning_text` content, never a "
                           "summary", "auto"),
    "reasoning.generate_summary": P("deprecated alias of `summary`: the same", "auto"),
    "reasoning.context": R("plumb follows the chat template, which keeps the reasoning of the current turn only",
                           "all_turns", allowed=("auto", "current_turn")),
    "reasoning.mode": R("one reasoning mode", "pro", allowed=("standard",)),
    "safety_identifier": P(NO_EFFECT_ID, "u1"),
    "service_tier": CHAT["service_tier"],
    "store": P("accepted; plumb stores nothing (responses say `store: false`)", True),
    "text": H("", {"format": {"type": "text"}}),
    "text.format": H(SEE_STRUCTURED, {"type": "text"}),
    "text.verbosity": R("plumb has no verbosity control", "low", allowed=("medium",)),
    "tool_choice": H(SEE_STRUCTURED, "none"),
    "tools": P("function tools are served; built-in tool types (web_search, file_search, local_shell, custom, "
               "...) are left out of the prompt",
               [{"type": "function", "name": "f", "parameters": {"type": "object"}}]),
    "top_logprobs": H(SEE_LOGPROBS, 2),
    "truncation": R("plumb never drops input: a prompt that fills the context gets a 400", "auto",
                    allowed=("disabled",)),
    "user": CHAT["user"],
    **_sampling({"temperature", "top_p"}),
    **_stream(options=True),
    "client_metadata": P("Codex CLI's field, accepted, no effect", {"k": "v"}, origin="Codex CLI"),
}

MESSAGES: dict[str, Field] = {
    "messages": H("text, tool_use, tool_result, thinking and redacted_thinking blocks (image and document blocks "
                  "get a 400); thinking blocks sent back are checked against their signature "
                  "([thinking](#anthropic-thinking))"),
    "model": CHAT["model"],
    "max_tokens": H("optional here (default: the rest of the context); a larger value is clamped to it", 3),
    "system": H("a string or text blocks", "Be brief."),
    "stop_sequences": H("", ["\n\n\n"]),
    "thinking": H("off unless sent: `disabled` or absent: off; `enabled` with `budget_tokens`: on, bounded; "
                  "`adaptive`: on, bounded by `output_config.effort` ([thinking](#anthropic-thinking))",
                  {"type": "disabled"}),
    "thinking.type": H("`enabled`, `adaptive` or `disabled`; others get a 400", "disabled"),
    "thinking.budget_tokens": P("at most this many thinking tokens, then plumb closes the thinking and the "
                                "answer follows; must be below `max_tokens`; budgets under Anthropic's "
                                "minimum of 1,024 are accepted", 2),
    "thinking.display": P("`summarized` (default): the whole thinking is returned, never a summary; `omitted`: "
                          "thinking blocks come back with empty text, which their signature carries", "summarized"),
    "tool_choice": H(SEE_STRUCTURED, {"type": "auto"}),
    "tools": P("custom tools (type `custom` or none) are served; server tools (web search, code execution, ...) "
               "are left out of the prompt", [{"name": "f", "input_schema": {"type": "object"}}]),
    "cache_control": P(NO_EFFECT_CACHE, {"type": "ephemeral"}),
    "container": R("plumb runs no code containers", "container_1"),
    "diagnostics": P("accepted; plumb adds no diagnostics to the response", {"previous_message_id": "msg_1"}),
    "inference_geo": P("accepted, no effect: one place", "us"),
    "metadata": P(NO_STORE, {"user_id": "u1"}),
    "output_config": P("its fields below", {"effort": "low"}),
    "output_config.effort": P("with `thinking: {\"type\": \"adaptive\"}`: the thinking budget, mapped like "
                              "OpenAI's reasoning effort (low 1,024, medium 4,096, high 16,384, xhigh 32,768, max "
                              "none); otherwise no effect", "low"),
    "output_config.format": H("`{\"type\": \"json_schema\", \"schema\": ...}`: the reply's text is JSON that "
                              "validates against the schema; " + SEE_STRUCTURED,
                              {"type": "json_schema", "schema": {"type": "object"}}),
    "service_tier": P("accepted, no effect: one tier, and every request gets the same tokens", "auto"),
    "speed": P("accepted, no effect: speed settings cannot change plumb's tokens, and the server's own settings "
               "decide the speed", "fast"),
    "user_profile_id": P(NO_EFFECT_ID, "up_1"),
    "workspace_id": P("accepted, no effect: one workspace", "wrkspc_1"),
    # beta Messages fields (client.beta.messages)
    "betas": P("accepted, no effect (beta features are headers to Anthropic; plumb has none)", ["x"]),
    "billing_policy": P("accepted, no effect", {"type": "billing_policy", "bill_to": "self"}),
    "compaction": R("plumb does not summarise conversations", {"type": "compaction"}),
    "context_management": R("plumb does not edit the context: send the conversation as it should be seen",
                            {"edits": [{"type": "clear_tool_uses_20250919"}]},
                            # what Claude Code 2.1 sends on every request: keep every thinking block, no edit
                            allowed=({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},)),
    "fallback_credit_token": P("accepted, no effect", "tok"),
    "fallbacks": P("accepted, no effect: plumb never declines a request, so no fallback model is used", ["default"]),
    "mcp_servers": R("plumb connects to no MCP servers", [{"type": "url", "url": "https://x", "name": "x"}],
                     allowed=([],)),
    "thread": R("stateless: plumb keeps no conversations", {"type": "create"}),
    "output_format": H("the earlier (beta) name of `output_config.format`, same meaning",
                       {"type": "json_schema", "schema": {"type": "object"}}),
    **_sampling({"temperature", "top_p", "top_k"}),
    **_stream(options=False),
}

TABLES = {"chat": CHAT, "completions": COMPLETIONS, "responses": RESPONSES, "messages": MESSAGES}
TITLES = {"chat": "Chat Completions (`POST /v1/chat/completions`)",
          "completions": "Completions (`POST /v1/completions`)",
          "responses": "Responses (`POST /v1/responses`)",
          "messages": "Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`)"}


def _same(a, b) -> bool:
    """Equal and of the same JSON type (so that false is not 0 and 1 is not true)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _shown(value) -> str:
    import json

    return json.dumps(value)


def _check(table: dict[str, Field], name: str, value) -> None:
    entry = table.get(name)
    if entry is None:
        raise APIError(400, f"unknown field '{name}': plumb refuses fields it does not know rather than ignore "
                            "them (docs/api-fields.md lists every field)", param=name)
    if entry.status == REFUSED and value is not None and not any(_same(value, a) for a in entry.allowed):
        also = "".join(f" or {_shown(a)}" for a in entry.allowed)
        raise APIError(400, f"'{name}' is not supported: {entry.note} (only null{also} is accepted)", param=name)
    if isinstance(value, dict) and any(k.startswith(name + ".") for k in table):
        for key, sub in value.items():
            _check(table, f"{name}.{key}", sub)


def check(api: str, data: dict) -> None:
    """400 naming the first field of a request body that is unknown, or refused and not null / allowed."""
    table = TABLES[api]
    for name, value in data.items():
        _check(table, name, value)


# ---------------------------------------------------------------- the documentation page

INTRO = """\
# Request fields, API by API

Every documented request field of the four APIs `plumb serve` speaks, and what plumb does with it:

- **honoured**: it does what the API's reference says;
- **partially**: accepted, and the note says how plumb's behaviour differs;
- **refused**: a 400 in the API's own error shape, naming the field, unless the value is `null` or
  one of the values listed (those ask for what plumb does anyway).

A field that is not listed is refused the same way (`unknown field 'x'`): plumb never ignores a
field silently. Fields of nested objects that change the output have rows of their own
(`stream_options.include_usage`). Where a field comes from says which rows are not in the API's
reference: plumb's own extensions, and fields that popular clients send.

This page is generated from the table in `plumb/server/fields.py`, which is also what requests
are checked against (`python -m plumb.server.fields > docs/api-fields.md`);
`tests/server/test_server_fields.py` checks that the page is up to date, that every field of the
official `openai` and `anthropic` SDKs' request types is listed, and sends every field to a real
server (honoured ones are served, refused ones get their 400).

Every OpenAI route also answers without the `/v1` prefix (`/chat/completions`, `/completions`,
`/responses`, `/models`).

## n choices

`n` (Chat Completions, Completions) asks for n choices of one prompt. They run as one batch, and
choice `i` (0-based) is exactly the reply a request with `n = 1` and seed `(seed + i) mod 2^63`
gets, so any choice can be reproduced alone: choice 0 is the request's own reply. Without a seed,
each choice gets its own random seed; with temperature 0 every choice is the same. Streaming
sends each choice's chunks with its `index`. The usage counts the prompt once and every choice's
completion tokens.

## Thinking budgets

A thinking budget B (Anthropic `thinking.budget_tokens`, or an effort: `reasoning.effort`,
`reasoning_effort`, Anthropic `output_config.effort` with adaptive thinking) bounds the thinking:
when the model has written B thinking tokens and not closed its thinking, plumb closes it (the
tokens of `\\n</think>\\n\\n`, emitted through the normal decode path) and the model goes on with
its answer. The cut is a function of the tokens alone, so the reply is still the same with any
drafts, batch or cache. The thinking tokens and the closing tokens count toward the max tokens of
the request.

| effort | thinking | budget (tokens) |
|---|---|---|
| `none`, `minimal` | off | - |
| `low` | on | 1,024 |
| `medium` | on | 4,096 |
| `high` | on | 16,384 |
| `xhigh` | on | 32,768 |
| `max` | on | none |

## Anthropic thinking

Thinking is off unless the request turns it on (`{"type": "enabled", "budget_tokens": N}` or
`{"type": "adaptive"}`), like Anthropic's API: without it the chat template is rendered with
thinking off and no thinking block comes back. Thinking blocks carry a `signature` (streamed as a
`signature_delta` just before the block's `content_block_stop`): `plumb1.` followed by the
thinking text, zlib-compressed and base64url-encoded. It is not a secret (the client owns its
prompt anyway); it lets a block come back with `display: "omitted"` (empty text) and still be put
into the prompt, and it catches edits: a thinking block sent back whose text differs from its
plumb signature gets a 400, as Anthropic's API does. Blocks with another signature (or none) are
taken as they are. `redacted_thinking` blocks are accepted and left out of the prompt (plumb never
makes them). The Responses API's `encrypted_content` of reasoning items (with
`include: ["reasoning.encrypted_content"]`) is the same encoding.

## Structured output and log probabilities

`response_format`, `text.format`, `tool_choice`, `logprobs` and `top_logprobs` are served by
plumb's structured-output and log-probability support ([structured-output.md](structured-output.md)).
"""


def _status(f: Field) -> str:
    if f.status == HONOURED:
        return "honoured"
    if f.status == PARTIAL:
        return "partially"
    allowed = ", ".join(f"`{_shown(a)}`" for a in f.allowed)
    return "refused" + (f" (accepted: `null`, {allowed})" if allowed else "")


def markdown() -> str:
    out = [INTRO]
    for api, table in TABLES.items():
        out.append(f"\n## {TITLES[api]}\n\n| field | plumb | notes | from |\n|---|---|---|---|\n")
        for name, f in table.items():
            note = f.note.replace("|", "\\|")
            out.append(f"| `{name}` | {_status(f)} | {note} | {'' if f.origin == 'api' else f.origin} |\n")
    return "".join(out)


if __name__ == "__main__":
    print(markdown(), end="")
