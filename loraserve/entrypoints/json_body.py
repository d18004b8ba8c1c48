"""Request bodies parsed as strict JSON.

Python's json module takes what no tokenizer, msgpack encoder or JSON response can
handle later: lone UTF-16 surrogates ("\\ud800", or their raw bytes), NaN and
Infinity literals, and nesting deep enough to overflow the stack. pydantic's
parser (jiter) refuses all of these, so such a body is a 400 at the door instead
of a 500 somewhere inside.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = pydantic_core.from_json(body, allow_inf_nan=False)
            except ValueError as exc:
                # FastAPI answers a JSONDecodeError as a validation error (our 400).
                raise json.JSONDecodeError(_reason(body, exc), "", 0) from None
        return self._json


class StrictJSONRoute(APIRoute):
    """An APIRoute whose handlers read the body with StrictJSONRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler


def _reason(body: bytes, exc: ValueError) -> str:
    """Why the body was refused, in words for the case that lenient JSON parsers
    accept (where the parser's own message, like 'unexpected end of hex escape',
    does not say it)."""
    try:
        json.loads(body)
    except (ValueError, RecursionError):
        return str(exc)
    return (f"{exc}: strings must be valid Unicode (no lone surrogates) and numbers "
            "finite (no NaN or Infinity)")
