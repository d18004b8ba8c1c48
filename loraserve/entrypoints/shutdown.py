"""Graceful shutdown: on SIGTERM or SIGINT the server stops taking requests, lets
the ones in flight finish for up to --shutdown-timeout seconds, then answers
whatever still runs in OpenAI's shape, so that every client gets a complete answer
or an error it can read, never a cut connection:

- a new request: 503 (uvicorn has also closed the listening socket);
- a request still running at the deadline: 503, or for a stream an error event
  followed by `data: [DONE]`.

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
    requests are refused), `expired` once in-flight requests must end."""

    def __init__(self) -> None:
        self.draining = False
        self.expired = asyncio.Event()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with the drain deadline in front of its own shutdown.

    `end_requests` is called once at the deadline; it must make every request still
    waiting on the engine raise `shutting_down_error()`."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drain,
        timeout_s: float,
        end_requests: Callable[[APIError], None],
    ) -> None:
        config.timeout_graceful_shutdown = timeout_s + _ANSWER_GRACE_S
        super().__init__(config)
        self.drain = drain
        self.timeout_s = timeout_s
        self.end_requests = end_requests

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.drain.draining = True
        deadline = asyncio.create_task(self._deadline(), name="drain-deadline")
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _deadline(self) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.timeout_s
        while loop.time() < end and not self.force_exit:
            await asyncio.sleep(min(_TICK_S, max(0.0, end - loop.time())))
        if self.server_state.tasks:
            logger.info("shutdown timeout reached: ending %d request(s) still running",
                        len(self.server_state.tasks))
        self.drain.expired.set()
        self.end_requests(shutting_down_error())
