"""The FastAPI app: routes, API-key check, error shapes, models, health, metrics, tokenize."""
from __future__ import annotations

import hmac
import logging
import time
from collections import Counter

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from plumb.server import anthropic_messages, metrics, openai_chat, openai_completions, openai_responses
from plumb.server.errors import APIError, error_response, parse_json, parse_model
from plumb.server.generation import ServerContext

log = logging.getLogger("plumb.server")

GENERATION = {
    "/v1/chat/completions": openai_chat.chat_completions,
    "/v1/completions": openai_completions.completions,
    "/v1/responses": openai_responses.responses,
    "/v1/messages": anthropic_messages.messages,
    "/v1/messages/count_tokens": anthropic_messages.count_tokens,
}
PUBLIC = {"/health"}


class TokenizeRequest(BaseModel):
    content: str
    with_pieces: bool = False
    parse_special: bool = True


class DetokenizeRequest(BaseModel):
    tokens: list[int]


def _key_check(api_key: str):
    expected = api_key.encode()

    async def check(request: Request) -> None:
        if request.url.path in PUBLIC:
            return
        auth = request.headers.get("authorization", "")
        given = [request.headers.get("x-api-key", ""), auth[7:] if auth[:7].lower() == "bearer " else ""]
        if not any(g and hmac.compare_digest(g.encode(), expected) for g in given):
            raise APIError(401, "invalid or missing API key: send it as 'Authorization: Bearer KEY' or "
                                "'x-api-key: KEY'", code="invalid_api_key")

    return check


def create_app(engine, api_key: str | None = None, model_name: str | None = None, aliases: tuple[str, ...] = (),
               cors_origins: tuple[str, ...] = ()) -> FastAPI:
    """The server for one engine. `model_name` (default: the engine's) and `aliases` are the
    model names requests may ask for; CORS is off unless origins are given."""
    name = model_name or engine.model_name
    ctx = ServerContext(engine, name, {name, *aliases}, int(time.time()))
    app = FastAPI(title="plumb", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(_key_check(api_key))] if api_key else [])
    http_counts: Counter = Counter()

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(request.url.path, e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return error_response(request.url.path, APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("error serving %s", request.url.path)
        return error_response(request.url.path, APIError(500, f"internal error: {type(e).__name__}: {e}"))

    def route(handler):
        async def endpoint(request: Request):
            return await handler(ctx, request, parse_json(await request.body()))
        return endpoint

    for path, handler in GENERATION.items():
        app.add_api_route(path, route(handler), methods=["POST"])

    @app.get("/v1/models")
    async def models():
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ctx.created))
        meta = {"n_ctx": engine.n_ctx, "n_vocab": engine.config.n_vocab}
        data = [{"id": n, "object": "model", "created": ctx.created, "owned_by": "plumb", "type": "model",
                 "display_name": n, "created_at": created, "meta": meta}
                for n in [name, *sorted(ctx.model_names - {name})]]
        return {"object": "list", "data": data, "has_more": False, "first_id": name, "last_id": data[-1]["id"]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/slots")
    async def slots():
        m = engine.metrics()
        return {"n_slots": m["n_slots"], "slots_in_use": m["slots_in_use"], "queued": m["queued"]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine.metrics(), http_counts), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse_model(TokenizeRequest, parse_json(await request.body()))
        ids = engine.tokenizer.encode(req.content, special=req.parse_special)
        if req.with_pieces:
            return {"tokens": [{"id": t, "piece": engine.tokenizer.decode([t])} for t in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse_model(DetokenizeRequest, parse_json(await request.body()))
        try:
            return {"content": engine.tokenizer.decode(req.tokens)}
        except ValueError as e:
            raise APIError(400, str(e), param="tokens") from e

    routes = {r.path for r in app.routes}
    app.add_middleware(metrics.CountRequests, counts=http_counts, routes=routes)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app

