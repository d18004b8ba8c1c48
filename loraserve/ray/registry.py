"""The adapters a Ray application serves, shared by its ingress and its replicas.

Ray Serve routes a request to one replica; it has no call that reaches every
replica. So the ingress writes each runtime load and unload here, every engine
replica follows the registry (a long-poll `watch` that also says which version
it has applied), and the ingress answers the client once every live replica has
caught up. A replica that has not polled for a while counts as gone: Ray Serve
replaces a dead replica, and the new one reads the whole registry as it starts.
The replicas also report their Prometheus metrics here, for the ingress's
/metrics.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec

from loraserve.lora.request import LoRARequest

# A replica that has neither polled nor waited in a poll for this long is gone.
REPLICA_TIMEOUT_S = 30.0


@dataclass
class RegistrySnapshot:
    """Every adapter by name, and for each the version that last (re)loaded it:
    a replica reloads an adapter whose generation changed (a load in place)."""

    version: int
    loras: dict[str, LoRARequest] = field(default_factory=dict)
    generations: dict[str, int] = field(default_factory=dict)


class AdapterRegistry:
    """One replica (a Ray Serve deployment of its own); its state is in memory, so a
    restart of it keeps the static adapters and loses the runtime changes."""

    def __init__(self, static_loras: list[LoRARequest]) -> None:
        self._version = 1
        self._loras = {lora.lora_name: lora for lora in static_loras}
        self._generations = dict.fromkeys(self._loras, self._version)
        # replica id -> (the version it has applied, when it last polled)
        self._applied: dict[str, tuple[int, float]] = {}
        self._polling: dict[str, int] = {}  # replicas waiting in watch now, by count
        self._changed: asyncio.Condition | None = None
        self._metrics: dict[str, tuple[str, float]] = {}  # replica id -> (text, when)

    @property
    def _condition(self) -> asyncio.Condition:
        # Created on first use, inside the replica's event loop.
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def snapshot(self) -> RegistrySnapshot:
        return RegistrySnapshot(self._version, dict(self._loras), dict(self._generations))

    async def publish(self, lora: LoRARequest) -> int:
        """Add an adapter, or replace one of the same name (a load in place)."""
        stored = msgspec.structs.replace(lora, load_inplace=False)
        return await self._change(lambda: self._loras.__setitem__(lora.lora_name, stored),
                                  lora.lora_name)

    async def withdraw(self, lora_name: str) -> int:
        return await self._change(lambda: self._loras.pop(lora_name, None), lora_name)

    async def _change(self, apply, lora_name: str) -> int:
        async with self._condition:
            apply()
            self._version += 1
            if lora_name in self._loras:
                self._generations[lora_name] = self._version
            else:
                self._generations.pop(lora_name, None)
            self._condition.notify_all()
            return self._version

    async def watch(self, replica_id: str, applied: int, timeout_s: float
                    ) -> RegistrySnapshot | None:
        """Record that `replica_id` has applied version `applied`, then wait up to
        timeout_s for a newer one; None when nothing changed."""
        async with self._condition:
            self._applied[replica_id] = (applied, time.monotonic())
            self._condition.notify_all()
            self._polling[replica_id] = self._polling.get(replica_id, 0) + 1
            try:
                await asyncio.wait_for(
                    self._condition.wait_for(lambda: self._version != applied), timeout_s
                )
            except TimeoutError:
                return None
            finally:
                self._polling[replica_id] -= 1
            return self.snapshot()

    def lagging(self, version: int) -> list[str]:
        """The live replicas that have not applied `version` yet."""
        now = time.monotonic()
        return sorted(
            replica for replica, (applied, seen) in self._applied.items()
            if applied < version
            and (self._polling.get(replica, 0) > 0 or now - seen < REPLICA_TIMEOUT_S)
        )

    async def wait_applied(self, version: int, timeout_s: float) -> list[str]:
        """Wait until every live replica has applied `version`; returns the ones
        still behind at the timeout (none: every replica has it)."""
        async with self._condition:
            try:
                await asyncio.wait_for(
                    self._condition.wait_for(lambda: not self.lagging(version)), timeout_s
                )
            except TimeoutError:
                pass
            return self.lagging(version)

    def report_metrics(self, replica_id: str, text: str) -> None:
        self._metrics[replica_id] = (text, time.monotonic())

    def metrics(self) -> dict[str, str]:
        """The latest Prometheus text of each live replica."""
        now = time.monotonic()
        self._metrics = {replica: (text, seen) for replica, (text, seen)
                         in self._metrics.items() if now - seen < REPLICA_TIMEOUT_S}
        return {replica: text for replica, (text, _) in self._metrics.items()}

