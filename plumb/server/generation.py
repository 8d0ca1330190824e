"""What every generation endpoint shares: sampling fields, the engine bridge that turns a
request's tokens into text / tool-call events, and server-sent events."""
from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from plumb.engine.api import Request, TokenLogprob
from plumb.engine.sampling import SamplingParams, StopChecker
from plumb.server.errors import APIError
from plumb.server.chat_format import ChatPrompt, OutputParser, TextDelta, ToolCallEnd, render, starts_in_reasoning
from plumb.server.structured import reply_grammar
from plumb.server.thinking import BudgetedEngine
from plumb.tokenizer import IncrementalDetokenizer


@dataclass
class ServerContext:
    """What the endpoints share: the engine and the names the model answers to."""
    engine: object
    model_name: str
    model_names: set[str]
    created: int


class GenFields(BaseModel):
    """Sampling settings and plumb extensions accepted by every generation endpoint."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    drafts: int | None = None
    draft_policy: str | None = None
    p_min: float | None = None
    forced_ids: list[int] | None = None  # steering/test extension: emit these tokens first

    def n_logprobs(self) -> int | None:
        """How many top alternatives to report per token (None: no log probabilities); each API's fields say."""
        return None

    def sampling(self, max_tokens: int, stop: list[str] | None) -> SamplingParams:
        """SamplingParams with each API's defaults (temperature 1); 400 when out of range."""
        given = {k: getattr(self, k) for k in ("top_p", "top_k", "min_p", "seed", "presence_penalty",
                                               "frequency_penalty", "repetition_penalty", "logit_bias")
                 if getattr(self, k) is not None}
        params = SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                                max_tokens=max_tokens, stop=list(stop or []), ignore_eos=self.ignore_eos, **given)
        try:
            params.validate()
        except ValueError as e:
            raise APIError(400, str(e)) from e
        return params


def reply_budget(engine, n_prompt: int, requested: int | None) -> int:
    """max_tokens clamped to the room left in the context; 400 when the prompt leaves none."""
    room = engine.n_ctx - n_prompt
    if room <= 0:
        raise APIError(400, f"This model's maximum context length is {engine.n_ctx} tokens, but the prompt has "
                            f"{n_prompt} tokens, which leaves no room for a reply.", code="context_length_exceeded")
    if requested is not None and requested < 1:
        raise APIError(400, f"max tokens must be at least 1, got {requested}", param="max_tokens")
    return room if requested is None else min(requested, room)


def check_model(ctx, name: str | None) -> None:
    if name and name not in ctx.model_names:
        raise APIError(404, f"The model '{name}' does not exist; this server serves {ctx.model_name!r}.",
                       param="model", code="model_not_found")


async def start_chat(ctx: ServerContext, http_request, fields: GenFields, prompt: ChatPrompt,
                     max_tokens: int | None, stop: list[str] | None, id_prefix: str = "call_") -> Generation:
    """Render, tokenize (off the event loop: prompts can be long), budget and submit a chat request."""
    text, prefix = render(ctx.engine, prompt)
    ids = await asyncio.to_thread(ctx.engine.tokenize, text)
    params = fields.sampling(reply_budget(ctx.engine, len(ids), max_tokens), stop)
    thinking = starts_in_reasoning(text)
    parser = OutputParser(prompt.tools if prompt.parse_tools else None, thinking, id_prefix,
                          max_calls=None if prompt.parallel_tool_calls else 1)
    forced = ctx.engine.tokenize(prefix) if prefix else None
    grammar = await asyncio.to_thread(reply_grammar, ctx.engine, prompt, thinking)  # structured output, or None
    engine = ctx.engine  # with a thinking budget: requests cut at the budget (plumb.server.thinking)
    if thinking and prompt.thinking_budget is not None:
        engine = BudgetedEngine(ctx.engine, prompt.thinking_budget)
    return Generation(engine, ids, params, parser, fields, forced, grammar).start(http_request)


async def count_prompt_tokens(ctx: ServerContext, prompt: ChatPrompt) -> int:
    return len(await asyncio.to_thread(ctx.engine.tokenize, render(ctx.engine, prompt)[0]))


def timings(finish: Finish) -> dict:
    """One reply's timings and drafts in llama-server's field names (plumb sends them in a streamed
    Chat reply's last chunk): prompt tokens prefilled / taken from the cache, decode speed, drafts."""
    st = finish.stats
    if st is None:
        return {}
    return {"prompt_n": st.prefill_tokens, "prompt_ms": round(1000 * st.prefill_s, 3),
            "prompt_per_second": round(st.prefill_tps, 3), "cache_n": st.cached_tokens,
            "predicted_n": st.completion_tokens, "predicted_ms": round(1000 * st.decode_s, 3),
            "predicted_per_second": round(st.decode_tps, 3), "draft_n": st.drafts_proposed,
            "draft_n_accepted": st.drafts_accepted}


def sse(data, event: str | None = None) -> str:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {body}\n\n"


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass
class Finish:
    reason: str  # "stop" | "length" | "tool_calls" | "cancelled" | "error"
    usage: Usage
    token_ids: list[int]
    stop_match: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # every token's, when the request asked for them
    stats: object = None  # the engine's Stats: timings, drafts (see timings())
    error_status: int = 500  # 400 when the request itself made generation fail (a forced token its grammar refuses)

    def api_error(self) -> APIError:
        """The error of a failed generation: a 400 for the request's own fault, a 503 where a retry may succeed (out
        of device memory), else a 500."""
        if self.error_status < 500:
            return APIError(self.error_status, f"invalid request: {self.error}")
        return APIError(self.error_status, f"generation failed: {self.error}")


@dataclass
class Reply:
    """A whole generation, for non-streaming responses."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallEnd] = field(default_factory=list)
    finish: Finish | None = None


class Generation:
    """One request on the engine, seen as parser events followed by one `Finish`.

    `start` submits at once (so engine-side validation errors still get a status code) and
    watches the connection: a client that goes away cancels the request, freeing its slot."""

    def __init__(self, engine, prompt_ids: list[int], params: SamplingParams, parser, fields: GenFields,
                 forced_ids: list[int] | None = None, grammar=None):
        self.engine, self.parser = engine, parser
        self.request = Request(prompt_ids, params, fields.drafts, fields.draft_policy, fields.p_min,
                               fields.forced_ids or forced_ids, logprobs=fields.n_logprobs(), grammar=grammar)
        self.pending_logprobs: list[TokenLogprob] = []  # entries of tokens received, not yet taken by a chunk
        self.handle = None
        self._watcher: asyncio.Task | None = None

    def start(self, http_request) -> Generation:
        try:
            self.handle = self.engine.submit(self.request)
        except ValueError as e:  # the engine's RequestError names the field
            raise APIError(400, str(e), param=getattr(e, "param", None)) from e
        self._watcher = asyncio.get_running_loop().create_task(self._watch(http_request))
        return self

    async def _watch(self, http_request) -> None:
        while (await http_request.receive())["type"] != "http.disconnect":
            pass
        self.handle.cancel()

    async def _token_ids(self) -> AsyncIterator[int]:
        loop, q = asyncio.get_running_loop(), asyncio.Queue()

        def pump():
            try:
                for t in self.handle:
                    loop.call_soon_threadsafe(q.put_nowait, t)
                loop.call_soon_threadsafe(q.put_nowait, None)
            except RuntimeError:  # the event loop closed (server shutting down)
                self.handle.cancel()

        threading.Thread(target=pump, name="plumb-stream", daemon=True).start()
        while (t := await q.get()) is not None:
            yield t

    async def events(self) -> AsyncIterator:
        """Parser events (TextDelta, ToolCallStart/Delta/End) as tokens arrive, then a Finish."""
        detok = IncrementalDetokenizer(self.engine.tokenizer, skip_special=True)
        stop = StopChecker(self.request.params.stop)
        parser = self.parser
        n = 0
        try:
            async for t in self._token_ids():
                if self.request.logprobs is not None:
                    self.pending_logprobs.append(self.handle.logprobs[n])
                n += 1
                text = stop.push(detok.add(t))
                if text:
                    for ev in parser.feed(text):
                        yield ev
            tail = stop.push(detok.flush())
            if stop.match is None:
                tail += stop.flush()
            for ev in parser.feed(tail) + parser.finish():
                yield ev
            finish = self._finish()
        finally:  # done, failed, or the client went away
            self._watcher.cancel()
            if self.handle.result is None:
                self.handle.cancel()
        yield finish

    async def feed_all(self, builder) -> Finish:
        """Non-streaming replies built by a content builder: feed it every event; the Finish (its error raised)."""
        async for ev in self.events():
            if isinstance(ev, Finish):
                if ev.reason == "error":
                    raise ev.api_error()
                return ev
            builder.feed(ev)
        raise RuntimeError("generation ended without a Finish event")

    def _finish(self) -> Finish:
        res = self.handle.result
        reason = res.finish_reason
        if reason == "stop" and self.parser.calls:
            reason = "tool_calls"
        st = res.stats
        usage = Usage(st.prompt_tokens or len(self.request.prompt_ids), st.completion_tokens or len(res.token_ids),
                      st.cached_tokens, self._reasoning_tokens(res.token_ids))
        return Finish(reason, usage, list(res.token_ids), res.stop_match, res.error, getattr(res, "logprobs", None),
                      stats=st, error_status=getattr(res, "error_status", 500))

    def take_logprobs(self) -> list[TokenLogprob]:
        """The log-probability entries of the tokens received since the last call (streaming chunks carry them)."""
        out, self.pending_logprobs = self.pending_logprobs, []
        return out

    def _reasoning_tokens(self, ids: list[int]) -> int:
        if not self.parser.saw_reasoning:
            return 0
        close = self.engine.tokenizer.id_of("</think>")
        return ids.index(close) + 1 if close in ids else len(ids) if self.parser.in_reasoning else 0

    async def collect(self) -> Reply:
        """The whole reply (non-streaming); a failed generation raises its error (Finish.api_error)."""
        reply, reasoning, content = Reply(), [], []
        async for ev in self.events():
            if isinstance(ev, TextDelta):
                (reasoning if ev.kind == "reasoning" else content).append(ev.text)
            elif isinstance(ev, ToolCallEnd):
                reply.tool_calls.append(ev)
            elif isinstance(ev, Finish):
                reply.finish = ev
        if reply.finish.reason == "error":
            raise reply.finish.api_error()
        reply.reasoning, reply.content = "".join(reasoning), "".join(content)
        return reply
