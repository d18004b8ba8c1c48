"""The scheduler's queue of waiting requests, one per scheduling policy.

fcfs: arrival order; a request put back (preempted, or skipped this step) goes to
the front. priority: by (priority, arrival time), lower first, as vLLM orders it;
a request put back returns to the place its priority and arrival give it, which,
for one skipped this step, is the place it had.
"""

from __future__ import annotations

import bisect
import itertools
import weakref
from collections import deque
from collections.abc import Iterable, Iterator

from loraserve.config import SCHEDULING_POLICIES
from loraserve.engine.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, req: Request) -> None:
        """A new request: last in line."""
        self._queue.append(req)

    def put_back(self, reqs: Iterable[Request]) -> None:
        """Requests taken out this step, back at the front, in their order."""
        self._queue.extendleft(reversed(list(reqs)))

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, req: Request) -> None:
        self._queue.remove(req)

    def __contains__(self, req: object) -> bool:
        return req in self._queue

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityQueue:
    def __init__(self) -> None:
        # Sorted by key; the counter keeps requests of equal priority and arrival
        # time in the order they came, and never compares two requests.
        self._keys: list[tuple[int, float, int]] = []
        self._reqs: list[Request] = []
        # Each request's turn in the order of first arrival here, kept while it
        # runs so that it comes back to the same place.
        self._order: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()
        self._counter = itertools.count()

    def _key(self, req: Request) -> tuple[int, float, int]:
        if req not in self._order:
            self._order[req] = next(self._counter)
        return (req.priority, req.arrival_time, self._order[req])

    def add(self, req: Request) -> None:
        key = self._key(req)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._reqs.insert(i, req)

    def put_back(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            self.add(req)

    def pop(self) -> Request:
        self._keys.pop(0)
        return self._reqs.pop(0)

    def remove(self, req: Request) -> None:
        i = self._reqs.index(req)
        del self._keys[i], self._reqs[i]

    def __contains__(self, req: object) -> bool:
        return req in self._reqs

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)

    def __len__(self) -> int:
        return len(self._reqs)


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, not {policy!r}")
