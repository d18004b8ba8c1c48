"""A least-recently-used map with pinning, shared by the CPU cache and device slots."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Generic, TypeVar

V = TypeVar("V")


class LRUCache(Generic[V]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, V] = OrderedDict()
        self._pinned: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[str]:
        """Oldest first."""
        return list(self._items)

    def values(self) -> list[V]:
        return list(self._items.values())

    def get(self, key: str) -> V | None:
        if key not in self._items:
            return None
        self._items.move_to_end(key)
        return self._items[key]

    def peek(self, key: str) -> V | None:
        return self._items.get(key)

    def touch(self, key: str) -> None:
        if key in self._items:
            self._items.move_to_end(key)

    def pin(self, key: str) -> None:
        if key not in self._items:
            raise KeyError(key)
        self._pinned.add(key)

    def is_pinned(self, key: str) -> bool:
        return key in self._pinned

    def oldest_evictable(self, protected: Iterable[str] = ()) -> str | None:
        protected = set(protected)
        for key in self._items:
            if key not in self._pinned and key not in protected:
                return key
        return None

    def put(self, key: str, value: V, protected: Iterable[str] = ()) -> list[tuple[str, V]]:
        """Insert (most recent) and evict the oldest unpinned, unprotected entries while
        over capacity. Returns what was evicted. If everything left is pinned or
        protected, the cache stays over capacity rather than drop something in use."""
        self._items[key] = value
        self._items.move_to_end(key)
        evicted = []
        protected = set(protected) | {key}
        while len(self._items) > self.capacity:
            victim = self.oldest_evictable(protected)
            if victim is None:
                break
            evicted.append((victim, self.pop(victim)))
        return evicted

    def pop(self, key: str) -> V | None:
        self._pinned.discard(key)
        return self._items.pop(key, None)
