"""Pure ASGI middleware of the API server (so streaming and disconnects pass through
untouched): what a request must pass before any handler reads it."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException

from loraserve.entrypoints.errors import APIError, engine_unavailable
from loraserve.entrypoints.shutdown import Drain, shutting_down_error

# Default of --max-request-body-bytes. A whole 1M-token context is about 4-5 MB as
# text and 7-8 MB as token ids in JSON; 16 MiB leaves room for that and for batched
# prompts, while a body the size of the limit still parses in well under a second.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024

# Paths that answer without the API key: liveness and version probes, which load
# balancers and orchestrators call without credentials.
OPEN_PATHS = frozenset({"/health", "/version"})
# Paths that still answer while the server drains: a probe must see the drain.
DRAIN_OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})


class BodyTooLarge(HTTPException):
    """Raised from `receive` as the bytes arrive; an HTTPException so that FastAPI's
    body parsing passes it on (to the handler that answers it in OpenAI's shape)
    instead of turning it into a 400."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body is larger than the server's limit of "
                              f"{limit} bytes.")


class BodySizeLimitMiddleware:
    """Answers 413 for a body over `max_bytes`: at once when Content-Length says so,
    else as soon as the bytes received pass the limit (a chunked body), before the
    rest of it is read."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _response(BodyTooLarge(self.max_bytes), scope, receive, send)
            return
        received = 0
        started = False

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def watching_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except BodyTooLarge as exc:
            # Read outside a handler (none answered it): answer here if still possible.
            if started:
                raise
            await _response(exc, scope, receive, send)


class GuardMiddleware:
    """Checks the API key on every path but the open ones, refuses new requests while
    the server drains, and answers 503 on /v1/* while the engine is gone."""

    def __init__(
        self,
        app: Any,
        api_key: str | None,
        drain: Drain,
        engine_dead: Callable[[], bool],
        open_paths: frozenset[str] = OPEN_PATHS,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.drain = drain
        self.engine_dead = engine_dead
        self.open_paths = open_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._refusal(scope)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        # Counted until the answer is sent (a stream to its end): the drain waits for it.
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1

    def _refusal(self, scope: dict) -> APIError | None:
        # Behind --root-path uvicorn puts the prefix in front of the path: the rules
        # are about the application's own paths.
        path = scope["path"]
        root = scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if self.api_key and path not in self.open_paths and scope.get("method") != "OPTIONS":
            headers = dict(scope.get("headers") or [])
            if not _bearer_matches(headers.get(b"authorization", b""), self.api_key):
                return APIError(401, "Invalid or missing API key.")
        if self.drain.draining and path not in DRAIN_OPEN_PATHS:
            return shutting_down_error()
        if path.startswith("/v1") and self.engine_dead():
            return engine_unavailable()
        return None


def _bearer_matches(header: bytes, api_key: str) -> bool:
    """Whether an Authorization header carries the key as a Bearer credential. The
    scheme is case-insensitive (RFC 7235: `bearer KEY` is as good as `Bearer KEY`),
    the key is not."""
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and secrets.compare_digest(
        token.lstrip(b" "), api_key.encode())


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers") or []:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _response(exc: HTTPException, scope: dict, receive: Any, send: Any) -> None:
    await APIError(exc.status_code, str(exc.detail)).response()(scope, receive, send)
