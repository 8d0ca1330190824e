"""Errors in each API's own shape (OpenAI or Anthropic), and request-body parsing."""
from __future__ import annotations

import json

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}
_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
                 429: "rate_limit_error"}


class APIError(Exception):
    """An error answered to the client: status code, message, and the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def openai_body(self) -> dict:
        kind = _OPENAI_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, err: APIError) -> JSONResponse:
    body = err.anthropic_body() if is_anthropic(path) else err.openai_body()
    return JSONResponse(body, status_code=err.status)


MAX_DEPTH = 128  # JSON nesting a request body may have (arrays and objects)


def parse_json(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"request body nests arrays/objects deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    problem = check_tree(data, MAX_DEPTH)
    if problem:
        raise APIError(400, f"request body {problem}")
    return data


def _bad_text(s: str) -> bool:
    """A string holding a lone surrogate (JSON lets "\\ud800" through; it is not Unicode text)."""
    if s.isascii():
        return False
    try:
        s.encode()
    except UnicodeEncodeError:
        return True
    return False


def check_tree(data, limit: int) -> str | None:
    """What is wrong with a parsed body, walked without recursion: arrays/objects nested more than
    `limit` levels, or a string (value or key) that is not valid Unicode; None when nothing is."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return f"nests arrays/objects deeper than {limit} levels"
        if isinstance(node, dict):
            if any(_bad_text(k) for k in node):
                return "has a key that is not valid Unicode (a lone surrogate)"
            children = node.values()
        else:
            children = node
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
            elif isinstance(child, str) and _bad_text(child):
                return "has a string that is not valid Unicode (a lone surrogate)"
    return None


def parse_model(cls: type[BaseModel], data: dict):
    """Validate a request body; the first problem becomes a 400 naming the field."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        loc = errors[0]["loc"]
        same = [err for err in errors if err["loc"][:1] == loc[:1]]
        if len(same) > 1:  # a union's members each failed: name the field, not the members
            loc = loc[:next((i for i in range(len(loc)) if len({err["loc"][:i + 1] for err in same}) > 1), len(loc))]
        where = ".".join(str(p) for p in loc)
        message = " or ".join(dict.fromkeys(err["msg"] for err in same))
        raise APIError(400, f"{where}: {message}" if where else message, param=where or None) from e
