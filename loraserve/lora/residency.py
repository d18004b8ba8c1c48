"""What a worker reports about its adapters: which are in CPU memory, which hold
device slots, which are pinned, and its load timings.

The engine schedules from this report (an adapter is ready when it is in either
place) and exports it in its stats; it never looks inside the worker's caches.
Every rank of a tensor-parallel group holds the same adapters, so rank 0's
report speaks for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAResidency:
    cpu: frozenset[str] = frozenset()  # in the CPU cache
    slots: frozenset[str] = frozenset()  # holding a device slot
    pinned: frozenset[str] = frozenset()  # pinned in the CPU cache
    pinned_slots: frozenset[str] = frozenset()  # pinned and holding a device slot
    # Every load so far: count per bucket of LORA_LOAD_TIME_BUCKETS_S (plus one
    # for longer loads) and their total seconds.
    load_time_counts: tuple[int, ...] = ()
    load_time_sum_s: float = 0.0

    def is_ready(self, name: str) -> bool:
        """Usable by a step without reading the disk."""
        return name in self.cpu or name in self.slots
