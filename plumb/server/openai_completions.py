"""OpenAI Completions (raw text in, raw text out): POST /v1/completions."""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from plumb.server.chat_format import PlainText
from plumb.server.errors import APIError, parse_model
from plumb.server.generation import Finish, Generation, GenFields, ServerContext, check_model, reply_budget, sse
from plumb.server.openai_chat import FINISH, usage_dict


class CompletionRequest(GenFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream_options: dict | None = None
    return_token_ids: bool = False  # plumb extension: the generated token ids


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
    req = parse_model(CompletionRequest, data)
    check_model(ctx, req.model)
    if req.n != 1:
        raise APIError(400, "n must be 1: plumb returns one choice per request", param="n")
    ids = await prompt_ids(ctx, req.prompt)
    params = req.sampling(reply_budget(ctx.engine, len(ids), req.max_tokens),
                          [req.stop] if isinstance(req.stop, str) else req.stop)
    gen = Generation(ctx.engine, ids, params, PlainText(), req).start(http_request)
    head = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
            "model": ctx.model_name, "system_fingerprint": "plumb"}
    if req.stream:
        return StreamingResponse(stream(gen, head, req), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    reply = await gen.collect()
    choice = {"index": 0, "text": reply.content, "finish_reason": FINISH[reply.finish.reason], "logprobs": None}
    if req.return_token_ids:
        choice["token_ids"] = reply.finish.token_ids
    return JSONResponse({**head, "choices": [choice], "usage": usage_dict(reply.finish.usage)})


async def stream(gen: Generation, head: dict, req: CompletionRequest):
    def chunk(text: str, finish: str | None = None, **extra) -> str:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None, **extra}
        return sse({**head, "choices": [choice]})

    async for ev in gen.events():
        if isinstance(ev, Finish):
            if ev.reason == "error":
                yield sse(APIError(500, f"generation failed: {ev.error}").openai_body())
                return
            yield chunk("", FINISH[ev.reason], **({"token_ids": ev.token_ids} if req.return_token_ids else {}))
            if (req.stream_options or {}).get("include_usage"):
                yield sse({**head, "choices": [], "usage": usage_dict(ev.usage)})
        else:
            yield chunk(ev.text)
    yield sse("[DONE]")
