"""Which adapters the waiting requests may bring into a step, when there are more
adapters than device slots (max_loras).

The adapters of all running requests hold slots, and so do pinned adapters; a
waiting request whose adapter is among them joins the batch at no cost. A request
for another adapter needs a slot to come free: at most max_loras adapters run at
once.

fcfs (vLLM's rule): free places go to new adapters in queue order. An adapter
keeps its place for as long as any of its requests runs, and its new requests
join the batch ahead of older requests for adapters without a place; under a
steady load of many adapters those older requests may wait without bound.

slot-aware: free places go first to starving adapters (below), then to adapters
that still sit in a device slot from earlier (no copy into a slot), then to the
rest in queue order. A waiting request passed over for lack of a place counts
its steps; once one has waited max_wait_steps, a running adapter is drained: it
admits no new request, so its place comes free when its running requests end,
and the starving adapter takes it. The drained adapter is the one whose running
requests are closest to their ends (the fewest tokens left at most), so the wait
is short; its own waiting requests count their steps like any other and get a
place back in turn. No request is passed over for longer than max_wait_steps
plus the rest of one adapter's running requests, and the batch keeps every
request of the adapters that hold places meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable

from loraserve.config import LORA_SCHEDULING_POLICIES
from loraserve.engine.request import Request


class LoRAAdmission:
    def __init__(self, max_loras: int, policy: str = "fcfs", max_wait_steps: int = 32,
                 max_model_len: int = 1 << 30) -> None:
        if policy not in LORA_SCHEDULING_POLICIES:
            raise ValueError(f"unknown LoRA scheduling policy {policy!r}")
        self.max_loras = max_loras
        self.policy = policy
        self.max_wait_steps = max_wait_steps
        self.max_model_len = max_model_len
        # slot-aware: running adapters that admit no new request until they leave.
        self.draining: set[str] = set()

    def allowed(self, waiting: Iterable[Request], running: list[Request], ready: set[str],
                slot_holders: Iterable[str], slot_resident: Iterable[str] = ()) -> set[str]:
        """The adapters whose waiting requests may join this step. `ready`: adapters
        usable without a disk read; `slot_holders`: adapters that keep a slot
        whatever runs (pinned); `slot_resident`: adapters in a device slot now.
        A waiting request passed over for lack of a place counts it in its
        slot_waits (the scheduler does)."""
        running_loras = {r.lora_name for r in running if r.lora_name is not None}
        holding = running_loras | set(slot_holders)
        self.draining &= running_loras
        # New adapters asked for, in queue order, each with its longest wait.
        asked: dict[str, int] = {}
        for req in waiting:
            name = req.lora_name
            if name is not None and name in ready and name not in holding:
                asked[name] = max(asked.get(name, 0), req.slot_waits)
        candidates = list(asked)
        if self.policy == "slot-aware":
            starving = {name for name in candidates if asked[name] >= self.max_wait_steps}
            self._drain_for(len(starving), running, holding, set(slot_holders))
            resident = set(slot_resident)
            candidates.sort(key=lambda name: (name not in starving, name not in resident))
        room = max(0, self.max_loras - len(holding))
        return (holding - self.draining) | set(candidates[:room])

    def _drain_for(self, num_starving: int, running: list[Request], holding: set[str],
                   pinned: set[str]) -> None:
        """Drain running adapters until the places that are free or coming free
        cover the starving adapters."""
        coming_free = max(0, self.max_loras - len(holding)) + len(self.draining)
        if num_starving <= coming_free:
            return
        left: dict[str, int] = {}  # per running adapter, the most tokens a request has left
        for req in running:
            name = req.lora_name
            if name is not None and name not in pinned and name not in self.draining:
                left[name] = max(left.get(name, 0), req.max_tokens_left(self.max_model_len))
        for name in sorted(left, key=lambda n: (left[n], n))[:num_starving - coming_free]:
            self.draining.add(name)
