"""The buckets that adapter load times are counted in, for the engine's stats and
the Prometheus histogram alike."""

from __future__ import annotations

import bisect

LORA_LOAD_TIME_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)  # fmt: skip


def lora_load_time_bucket(seconds: float) -> int:
    """The index in SchedulerStats.lora_load_time_counts that a load time falls in:
    the first bucket whose bound it does not exceed, or the last (unbounded) one."""
    return bisect.bisect_left(LORA_LOAD_TIME_BUCKETS_S, seconds)
