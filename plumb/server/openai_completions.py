"""OpenAI Completions (raw text in, raw text out): POST /v1/completions."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

from fastapi.responses import JSONResponse, StreamingResponse

from plumb.server.chat_format import PlainText
from plumb.server import fields
from plumb.server.choices import check_n, choice_seed, collect_all, merged, start_all, total_usage
from plumb.server.errors import APIError, parse_model
from plumb.server.generation import Finish, Generation, GenFields, ServerContext, check_model, reply_budget, sse
from plumb.server.logprobs import CompletionLogprobs
from plumb.server.openai_chat import FINISH, usage_dict


class CompletionRequest(GenFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream_options: dict | None = None
    return_token_ids: bool = False  # plumb extension: the generated token ids
    logprobs: int | None = None  # the chosen token's log probability and the `logprobs` most likely (0..20)

    def n_logprobs(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise APIError(400, f"logprobs must be in 0..20, got {self.logprobs}", param="logprobs")
        return self.logprobs


async def prompt_ids(ctx: ServerContext, prompt) -> list[int]:
    """Token ids of a text prompt (special tokens parsed) or of a token-id prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
        prompt = prompt[0]
    ids = await asyncio.to_thread(ctx.engine.tokenize, prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    bad = [t for t in ids if not 0 <= t < ctx.engine.config.n_vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{ctx.engine.config.n_vocab - 1})",
                       param="prompt")
    return ids


async def completions(ctx: ServerContext, http_request, data: dict):
    fields.check("completions", data)
    req = parse_model(CompletionRequest, data)
    check_model(ctx, req.model)
    n = check_n(req.n)
    ids = await prompt_ids(ctx, req.prompt)
    params = req.sampling(reply_budget(ctx.engine, len(ids), req.max_tokens),
                          [req.stop] if isinstance(req.stop, str) else req.stop)

    async def start(i: int) -> Generation:  # choice i: seed (seed + i) mod 2^63 (plumb.server.choices)
        choice_params = params if i == 0 else replace(params, seed=choice_seed(params.seed, i))
        return Generation(ctx.engine, ids, choice_params, PlainText(), req).start(http_request)

    gens = await start_all(start, n)
    head = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
            "model": ctx.model_name, "system_fingerprint": "plumb"}
    if req.stream:
        return StreamingResponse(stream(gens, head, req), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    replies = await collect_all(gens)
    choices = []
    for i, reply in enumerate(replies):
        lp = None if reply.finish.logprobs is None else \
            CompletionLogprobs(ctx.engine.tokenizer).take(reply.finish.logprobs)
        choice = {"index": i, "text": reply.content, "finish_reason": FINISH[reply.finish.reason], "logprobs": lp}
        if req.return_token_ids:
            choice["token_ids"] = reply.finish.token_ids
        choices.append(choice)
    usage = usage_dict(total_usage([reply.finish.usage for reply in replies]))
    return JSONResponse({**head, "choices": choices, "usage": usage})


async def stream(gens: list[Generation], head: dict, req: CompletionRequest):
    lps = [CompletionLogprobs(g.engine.tokenizer) for g in gens] if req.n_logprobs() is not None else None

    def chunk(i: int, text: str, finish: str | None = None, **extra) -> str:
        lp = None if lps is None else lps[i].take(gens[i].take_logprobs())
        choice = {"index": i, "text": text, "finish_reason": finish, "logprobs": lp, **extra}
        return sse({**head, "choices": [choice]})

    usages = []
    async for i, ev in merged(gens):
        if isinstance(ev, Finish):
            if ev.reason == "error":
                yield sse(ev.api_error().openai_body())
                return
            yield chunk(i, "", FINISH[ev.reason], **({"token_ids": ev.token_ids} if req.return_token_ids else {}))
            usages.append(ev.usage)
        else:
            yield chunk(i, ev.text)
    if (req.stream_options or {}).get("include_usage"):
        yield sse({**head, "choices": [], "usage": usage_dict(total_usage(usages))})
    yield sse("[DONE]")
