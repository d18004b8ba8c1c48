"""The engine's side of adapters: what it asks of the worker, and what it knows.

The worker (through the executor) owns the adapters' tensors: its CPU cache,
device slots and background reads. The engine keeps the worker's last report of
what is resident (scheduling needs to know what is ready without a call per
request), which reads it started, the runtime adds (API loads) in progress, and
which adapters were unloaded for good.

A read runs on the worker's loader threads, and nothing becomes resident until
the engine commits it: first it asks which reads are done, then it commits
exactly those, in that order, on every rank. So every tensor-parallel rank
inserts the same adapters at the same point and their caches never drift apart.

Unloading is for good: the (name, id) pairs of an unloaded adapter are retired,
so that a request which still carries one (it chose the adapter just before the
unload) is refused rather than load it from disk again. Only an explicit add
brings a retired pair back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loraserve.executor.base import Executor
from loraserve.lora.errors import LoRAError
from loraserve.lora.request import LoRARequest
from loraserve.lora.residency import LoRAResidency


@dataclass
class FinishedLoads:
    # Reads that failed: (the adapter's name, why). Its requests fail with it.
    failed: list[tuple[str, LoRAError]]
    # Runtime adds that ended: (the request, None, or why it failed).
    adds: list[tuple[LoRARequest, LoRAError | None]]


class EngineAdapters:
    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.residency: LoRAResidency = executor.call("lora_residency")
        # Background reads started on the worker and not yet committed.
        self._loading: dict[str, LoRARequest] = {}
        # Runtime adds in progress: name -> whether to pin it.
        self._adds: dict[str, bool] = {}
        self._retired: set[tuple[str, int]] = set()

    def update(self, residency: LoRAResidency | None) -> None:
        """Take the worker's latest report (None: nothing changed)."""
        if residency is not None:
            self.residency = residency

    def is_ready(self, name: str) -> bool:
        return self.residency.is_ready(name)

    def is_retired(self, lora_request: LoRARequest) -> bool:
        """Whether this adapter, under this id, was unloaded (and not added since)."""
        return (lora_request.lora_name, lora_request.lora_int_id) in self._retired

    @property
    def adds_pending(self) -> bool:
        return bool(self._adds)

    # ---- loading -------------------------------------------------------------------

    def add(self, lora_request: LoRARequest, pinned: bool, protected: Iterable[str]) -> None:
        """Read the adapter now, on every rank (raises LoRAError), and cache it."""
        self.update(self.executor.call("add_lora", lora_request, pinned, list(protected)))
        self._retired.discard((lora_request.lora_name, lora_request.lora_int_id))

    def start_loads(self, lora_requests: Iterable[LoRARequest]) -> None:
        """Start background reads of these adapters, unless one is under way (a
        load_inplace request always starts a new read: it brings new weights)."""
        new = [r for r in lora_requests if r.lora_name not in self._loading or r.load_inplace]
        if new:
            self.executor.call("start_lora_loads", new)
            self._loading.update((r.lora_name, r) for r in new)

    def begin_add(self, lora_request: LoRARequest, pinned: bool) -> None:
        """A runtime add: read in the background, then cache it (pinned if asked)
        and give it a device slot if one can be had; poll() says when it ended."""
        self._adds[lora_request.lora_name] = pinned
        self.start_loads([lora_request])

    def poll(self, protected: Iterable[str]) -> FinishedLoads:
        """Commit every finished read: on success the adapter enters the CPU cache
        (a runtime add also takes a device slot if it can without evicting one of
        `protected`); on failure its error is returned."""
        finished = FinishedLoads([], [])
        if not self._loading:
            return finished
        done: list[tuple[str, LoRAError | None]] = self.executor.call("finished_lora_loads")
        if not done:
            return finished
        ok = [name for name, error in done if error is None]
        adds = [name for name, _ in done if name in self._adds]
        self.update(self.executor.call(
            "commit_lora_loads", ok, [name for name, error in done if error is not None],
            [name for name in adds if self._adds[name]], adds, list(protected)))
        for name, error in done:
            request = self._loading.pop(name)
            if name in self._adds:
                del self._adds[name]
                finished.adds.append((request, error))
                if error is None:
                    self._retired.discard((name, request.lora_int_id))
            if error is not None:
                finished.failed.append((name, error))
        return finished

    # ---- residency -----------------------------------------------------------------

    def remove(self, name: str, request_ids: Iterable[int]) -> bool:
        """Forget an adapter for good on every rank; its ids (and `request_ids`) are
        retired. Whether anything of it was held."""
        found, retired, residency = self.executor.call("remove_lora", name, list(request_ids))
        self.update(residency)
        self._retired.update((name, i) for i in retired)
        self._loading.pop(name, None)
        self._adds.pop(name, None)
        return found

    def pin(self, name: str) -> None:
        self.update(self.executor.call("pin_lora", name))

    def memory_usage(self) -> dict[str, int]:
        return self.executor.call("lora_memory_usage")
