"""Per-step statistics that the engine core counts itself: how many distinct LoRA
adapters each launched step ran. Kept as running totals (a count per bucket and
the sum), which the engine sends with its scheduler stats and the API server
renders as a histogram as they are: a total is right however many messages carry
it."""

from __future__ import annotations

import bisect

# Upper bounds of the buckets of distinct adapters per step: 0 is a step of the base
# model only; the rest double up to the most adapters a step can run in practice.
STEP_LORA_ADAPTER_BUCKETS: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class StepLoRACounter:
    """Counts the distinct adapters of every launched step."""

    def __init__(self) -> None:
        self._counts = [0] * (len(STEP_LORA_ADAPTER_BUCKETS) + 1)
        self._sum = 0

    def record(self, adapter_names: set[str]) -> None:
        num = len(adapter_names)
        # The first bucket whose bound is not below num (Prometheus' le), else the last.
        self._counts[bisect.bisect_left(STEP_LORA_ADAPTER_BUCKETS, num)] += 1
        self._sum += num

    def totals(self) -> tuple[list[int], int]:
        """Counts per bucket (not cumulative, the last above every bound) and the sum."""
        return list(self._counts), self._sum
