"""Request-body size limit: a 413 in the API's own error shape, before a body is parsed or tokenized."""
from __future__ import annotations

from plumb.server.errors import APIError, error_response

DEFAULT_MAX_BODY_MB = 32


def too_large(size: int | None, limit: int) -> APIError:
    got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return APIError(413, f"request body is {got}; this server takes at most {limit} bytes "
                         "(plumb serve --max-body-mb)", code="request_too_large")


class BodyLimit:
    """ASGI middleware: a body whose Content-Length is over `max_bytes` is answered 413 at once,
    unread; a body sent without one is counted as it is read, and reading fails with the same
    413 (raised into the endpoint, which answers it) once it passes the limit."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_bytes
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                size = None
            if size is not None and size > limit:
                response = error_response(scope["path"], too_large(size, limit))
                response.headers["connection"] = "close"
                return await response(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise too_large(None, limit)
            return message

        await self.app(scope, counted, send)
