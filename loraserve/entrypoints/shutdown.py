"""Graceful shutdown: on SIGTERM or SIGINT the server stops taking requests, lets
the ones in flight finish for up to --shutdown-timeout seconds, then answers
whatever still runs in OpenAI's shape, so that every client gets a complete answer
or an error it can read, never a cut connection:

- a new request: 503 (the server keeps listening until the requests in flight are
  done, so that a new one gets an answer it can read, and retry elsewhere, rather
  than a refused connection; /health says 503 too);
- a request still running at the deadline: 503, or for a stream an error event
  followed by `data: [DONE]`.

Once no request is in flight (or at the deadline) uvicorn's own shutdown runs: it
closes the listening socket and the idle connections.

A second Ctrl-C (uvicorn's force exit) brings the deadline forward to now.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import uvicorn

from loraserve.entrypoints.errors import APIError

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
# After the deadline, the time the handlers get to write their 503s before uvicorn
# cancels them.
_ANSWER_GRACE_S = 2.0
_TICK_S = 0.1


def shutting_down_error() -> APIError:
    return APIError(503, "The server is shutting down.")


class Drain:
    """Where the server is in its shutdown: `draining` once it has begun (new
    requests are refused), `expired` once in-flight requests must end.
    `in_flight` counts the requests taken and not yet answered."""

    def __init__(self) -> None:
        self.draining = False
        self.expired = asyncio.Event()
        self.in_flight = 0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with the drain in front of its own shutdown.

    `end_requests` is called at the deadline if requests are still in flight; it
    must make every request still waiting on the engine raise
    `shutting_down_error()`."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drain,
        timeout_s: float,
        end_requests: Callable[[APIError], None],
    ) -> None:
        # uvicorn's own wait only covers writing the answers: the drain is done by then.
        config.timeout_graceful_shutdown = _ANSWER_GRACE_S
        super().__init__(config)
        self.drain = drain
        self.timeout_s = timeout_s
        self.end_requests = end_requests

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.drain.draining = True
        # Still listening: GuardMiddleware answers new requests 503 meanwhile.
        loop = asyncio.get_running_loop()
        end = loop.time() + self.timeout_s
        while self.drain.in_flight and loop.time() < end and not self.force_exit:
            await asyncio.sleep(min(_TICK_S, max(0.0, end - loop.time())))
        self.drain.expired.set()
        if self.drain.in_flight:
            logger.info("shutdown timeout reached: ending %d request(s) still running",
                        self.drain.in_flight)
            self.end_requests(shutting_down_error())
        await super().shutdown(sockets)
