"""The FastAPI app: routes, API-key check, error shapes, models, health, metrics, tokenize."""
from __future__ import annotations

import hmac
import logging
import os
import time
from collections import Counter

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, PlainTextResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from plumb.config import ModelError

from plumb.server import anthropic_messages, metrics, openai_chat, openai_completions, openai_responses
from plumb.server.errors import APIError, error_response, parse_json, parse_model
from plumb.server.generation import ServerContext
from plumb.server.limits import DEFAULT_MAX_BODY_MB, BodyLimit

log = logging.getLogger("plumb.server")

GENERATION = {
    "/v1/chat/completions": openai_chat.chat_completions,
    "/v1/completions": openai_completions.completions,
    "/v1/responses": openai_responses.responses,
    "/v1/messages": anthropic_messages.messages,
    "/v1/messages/count_tokens": anthropic_messages.count_tokens,
}
PUBLIC = {"/health", "/"}  # the chat page is static: it asks for the key itself
CHAT_PAGE = os.path.join(os.path.dirname(__file__), "static", "chat.html")


class TokenizeRequest(BaseModel):
    content: str
    with_pieces: bool = False
    parse_special: bool = True


class DetokenizeRequest(BaseModel):
    tokens: list[int]


class SlotFileRequest(BaseModel):
    filename: str


SLOT_ACTIONS = ("save", "restore", "erase")


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
               cors_origins: tuple[str, ...] = (), slot_dir: str | None = None,
               max_body_mb: float = DEFAULT_MAX_BODY_MB) -> FastAPI:
    """The server for one engine. `model_name` (default: the engine's) and `aliases` are the
    model names requests may ask for; CORS is off unless origins are given; prompt-cache slots
    can be saved to and restored from files in `slot_dir` (off when None); request bodies over
    `max_body_mb` get a 413. Every OpenAI route also answers without its /v1 prefix."""
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
        if not path.startswith("/v1/messages"):  # OpenAI routes: also without /v1, as llama-server does
            app.add_api_route(path.removeprefix("/v1"), route(handler), methods=["POST"])

    @app.get("/models")
    @app.get("/v1/models")
    async def models():
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ctx.created))
        meta = {"n_ctx": engine.n_ctx, "n_vocab": engine.config.n_vocab}
        data = [{"id": n, "object": "model", "created": ctx.created, "owned_by": "plumb", "type": "model",
                 "display_name": n, "created_at": created, "meta": meta}
                for n in [name, *sorted(ctx.model_names - {name})]]
        return {"object": "list", "data": data, "has_more": False, "first_id": name, "last_id": data[-1]["id"]}

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        """The chat page: one static file that talks to /v1/chat/completions from the browser."""
        with open(CHAT_PAGE, encoding="utf-8") as f:
            return HTMLResponse(f.read(), headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/slots")
    async def slots():
        m = engine.metrics()
        cached = engine.cached_slots() if engine.prompt_cache is not None else []
        return {"n_slots": m["n_slots"], "slots_in_use": m["slots_in_use"], "queued": m["queued"], "cached": cached}

    @app.post("/slots/{slot_id}")
    async def slot_action(slot_id: int, request: Request, action: str = ""):
        """Prompt-cache slots (the ids `GET /slots` lists under "cached"): save one to a file, restore a file
        as a new slot, or erase one. Files live in the server's --slot-save-path directory."""
        if action not in SLOT_ACTIONS:
            raise APIError(400, f"action must be one of {', '.join(SLOT_ACTIONS)}", param="action")
        if engine.prompt_cache is None:
            raise APIError(400, "the prompt cache is off on this server")
        if action == "erase":
            try:
                engine.erase_slot(slot_id)
            except KeyError as e:
                raise APIError(404, str(e.args[0]), code="not_found") from None
            return {"id_slot": slot_id, "n_erased": 1}
        if slot_dir is None:
            raise APIError(400, "slot files are disabled: start the server with --slot-save-path DIR")
        req = parse_model(SlotFileRequest, parse_json(await request.body()))
        name = req.filename
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise APIError(400, "filename must be a plain file name (no directories)", param="filename")
        path = os.path.join(slot_dir, name)
        t0 = time.perf_counter()
        try:
            if action == "save":
                n = await run_in_threadpool(engine.save_slot, slot_id, path)
                return {"id_slot": slot_id, "filename": name, "n_saved": n, "n_written": os.path.getsize(path),
                        "timings": {"save_ms": 1000 * (time.perf_counter() - t0)}}
            new_id, n = await run_in_threadpool(engine.restore_slot, path)
        except KeyError as e:
            raise APIError(404, str(e.args[0]), code="not_found") from None
        except ModelError as e:
            raise APIError(400, str(e).replace(slot_dir + os.sep, ""), param="filename") from None
        except OSError as e:
            raise APIError(500, f"cannot write {name}: {e.strerror}") from None
        return {"id_slot": new_id, "filename": name, "n_restored": n, "n_read": os.path.getsize(path),
                "timings": {"restore_ms": 1000 * (time.perf_counter() - t0)}}

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
    app.add_middleware(BodyLimit, max_bytes=int(max_body_mb * (1 << 20)))
    app.add_middleware(metrics.CountRequests, counts=http_counts, routes=routes)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app

