"""The LoRA side of one model runner: its wrapped layers (loraserve.lora.wrapping),
the adapters in CPU memory (adapter_store) and the device slots (device_slots),
behind the operations the runner's adapter methods and its steps use.

An adapter enters the CPU cache when loaded and takes a device slot when a step
needs it (or at once when added through the API). Pinned adapters are never
evicted from either. Every operation here is deterministic given the calls
made: each tensor-parallel rank runs the same calls on its own manager, so all
of them hold the same adapters in the same slots without telling each other.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from torch import nn

from loraserve.config import LoRAConfig
from loraserve.lora.adapter_store import AdapterStore
from loraserve.lora.device_slots import DeviceSlots
from loraserve.lora.errors import LoRAError
from loraserve.lora.peft_adapter import LoRAModel
from loraserve.lora.punica import PunicaWrapper
from loraserve.lora.request import LoRARequest
from loraserve.lora.residency import LoRAResidency
from loraserve.lora.wrapping import wrap_model

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        lora_config: LoRAConfig,
        punica: PunicaWrapper,
        num_load_threads: int = 2,
        logits_punica: PunicaWrapper | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.config = lora_config
        self.wrappers, self.info = wrap_model(model, lora_config, punica, logits_punica)
        self.store = AdapterStore(lora_config, self.info, num_load_threads, pin_memory)
        self.slots = DeviceSlots(lora_config.max_loras, self.wrappers)
        self._reported = -1  # the change count of the last residency report

    # ---- loading -------------------------------------------------------------------

    def load(self, lora_request: LoRARequest) -> LoRAModel:
        """Read and check an adapter from disk; thread-safe, touches no state."""
        return self.store.load(lora_request)

    def add(self, lora_request: LoRARequest, pinned: bool = False,
            protected: Iterable[str] = ()) -> None:
        """Load now (raises LoRAError) before evicting anything, put it in the CPU
        cache, and give it a device slot if one is free or held by an adapter that
        is not `protected` (those the running requests use)."""
        self._insert(self.load(lora_request), pinned, protected)

    def _insert(self, lora: LoRAModel, pinned: bool, protected: Iterable[str]) -> None:
        # Strict LRU: an evicted adapter that a running request uses keeps its device
        # slot (set_active protects those), so nothing in flight loses its weights.
        # load_inplace: a slot that holds the name must show the new weights.
        self.slots.rewrite(lora)
        self.store.insert(lora, pinned)
        try:
            self.activate(lora.name, protected=protected)
        except RuntimeError:
            pass  # every slot is busy; it gets one when a step needs it

    def start_loads(self, lora_requests: Iterable[LoRARequest]) -> None:
        """Read these adapters on loader threads; see finished_loads and commit_loads."""
        for lora_request in lora_requests:
            self.store.start_background_load(lora_request)

    def finished_loads(self) -> list[tuple[str, LoRAError | None]]:
        """Background reads that are done, with the error of each that failed."""
        return self.store.finished_loads()

    def commit_loads(self, names: Iterable[str], failed: Iterable[str] = (),
                     pinned: Iterable[str] = (), activate: Iterable[str] = (),
                     protected: Iterable[str] = ()) -> None:
        """Put the adapters of finished reads into the CPU cache, in order, and drop
        the failed reads. Those in `activate` (added through the API) take a device
        slot now if they can, those in `pinned` are pinned. Raises LoRAError if a
        read in `names` failed here: on a tensor-parallel rank other than 0, where
        rank 0's read of the same files went through, the group cannot go on."""
        pinned, activate = set(pinned), set(activate)
        for name in failed:
            self.store.drop_load(name)
        for name in names:
            lora = self.store.take_load(name)
            if name in activate:
                self._insert(lora, name in pinned, protected)
            else:
                self.slots.rewrite(lora)
                self.store.insert(lora, name in pinned)

    # ---- residency -----------------------------------------------------------------

    def pin(self, name: str) -> None:
        self.store.pin(name)
        self.slots.pin(name)

    def remove(self, name: str, request_ids: Iterable[int] = ()) -> tuple[bool, frozenset[int]]:
        """Forget an adapter for good: CPU tensors, device slot, a load in progress.
        Returns whether anything of it was held, and the ids now retired (those
        given, and every id it was loaded under)."""
        freed = self.slots.free(name)
        found, retired = self.store.remove(name, request_ids)
        return found or freed, retired

    def activate(self, name: str, protected: Iterable[str] = ()) -> int:
        """Give an adapter a device slot, evicting the least recently used one that
        this step does not need. Returns the slot."""
        cache = self.store.cache
        slot = self.slots.get(name)
        if slot is not None:
            cache.touch(name)
            return slot
        lora = cache.get(name)
        if lora is None:
            raise RuntimeError(f"LoRA {name!r} is neither in a device slot nor in the CPU cache")
        return self.slots.activate(lora, cache.is_pinned(name), protected)

    def set_active(self, names: set[str], running: Iterable[str] = ()) -> dict[str, int]:
        """Slots for every adapter of this step (at most max_loras of them). Adapters
        of running requests keep their slots even when not scheduled this step."""
        if len(names) > self.config.max_loras:
            raise RuntimeError(
                f"{len(names)} adapters in one step exceed max_loras={self.config.max_loras}"
            )
        protected = set(names) | set(running)
        return {name: self.activate(name, protected=protected) for name in names}

    def slots_use(self, path: str) -> bool:
        return self.slots.uses(path)

    # ---- what the worker reports ---------------------------------------------------

    def residency(self) -> LoRAResidency:
        self._reported = self.store.changes + self.slots.changes
        cache, slots = self.store.cache, self.slots
        counts, total = self.store.load_times()
        return LoRAResidency(
            cpu=frozenset(cache.keys()), slots=frozenset(slots.names()),
            pinned=frozenset(self.store.pinned_names()), pinned_slots=slots.pinned_names(),
            load_time_counts=tuple(counts), load_time_sum_s=total,
        )

    def residency_if_changed(self) -> LoRAResidency | None:
        """A new report when anything in it changed since the last one, else None."""
        if self.store.changes + self.slots.changes == self._reported:
            return None
        return self.residency()

    def memory_usage(self) -> dict[str, int]:
        """Bytes of adapter weights in the CPU cache, per adapter. Device slots are
        fixed buffers; an unloaded adapter's slot is zeroed and reused."""
        return self.store.memory_usage()

    def cpu_names(self) -> list[str]:
        return self.store.cache.keys()

    def slot_names(self) -> list[str]:
        return self.slots.names()

    def shutdown(self) -> None:
        self.store.shutdown()
