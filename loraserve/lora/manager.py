"""The LoRA side of one model runner: its wrapped layers (loraserve.lora.wrapping),
the adapters in CPU memory (adapter_store) and the device slots (device_slots),
behind the operations the engine and the runner use.

An adapter enters the CPU cache when loaded and takes a device slot when a step
needs it (or at once when added through the API). Pinned adapters are never
evicted from either.
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
    ) -> None:
        self.config = lora_config
        self.wrappers, self.info = wrap_model(model, lora_config, punica, logits_punica)
        self.store = AdapterStore(lora_config, self.info, num_load_threads)
        self.slots = DeviceSlots(lora_config.max_loras, self.wrappers)

    # ---- loading -------------------------------------------------------------------

    def load(self, lora_request: LoRARequest) -> LoRAModel:
        """Read and check an adapter from disk; thread-safe, touches no state."""
        return self.store.load(lora_request)

    def add(self, lora_request: LoRARequest, pinned: bool = False,
            loaded: LoRAModel | None = None) -> LoRAModel:
        """Load (unless `loaded` was read elsewhere already) before evicting anything,
        then put into the CPU cache."""
        lora = loaded if loaded is not None else self.load(lora_request)
        self.insert(lora, pinned)
        return lora

    def insert(self, lora: LoRAModel, pinned: bool = False) -> None:
        # Strict LRU: an evicted adapter that a running request uses keeps its device
        # slot (set_active protects those), so nothing in flight loses its weights.
        # load_inplace: a slot that holds the name must show the new weights.
        self.slots.rewrite(lora)
        self.store.insert(lora, pinned)

    def start_background_load(self, lora_request: LoRARequest) -> None:
        self.store.start_background_load(lora_request)

    def poll_loads(self) -> list[tuple[str, LoRAError | None]]:
        """Move finished background loads into the CPU cache; report failures."""
        done = []
        for lora, name, error in self.store.poll_loads():
            if lora is not None:
                self.insert(lora)
            done.append((name, error))
        return done

    # ---- residency -----------------------------------------------------------------

    def is_ready(self, name: str) -> bool:
        """Usable this step without touching the disk."""
        return name in self.store.cache or name in self.slots

    def is_retired(self, lora_request: LoRARequest) -> bool:
        return self.store.is_retired(lora_request)

    def pin(self, name: str) -> None:
        self.store.cache.pin(name)
        self.slots.pin(name)

    def remove(self, name: str, request_ids: Iterable[int] = ()) -> bool:
        """Forget an adapter for good: CPU tensors, device slot, a load in progress;
        its ids are retired. Returns whether anything of it was held."""
        freed = self.slots.free(name)
        return self.store.remove(name, request_ids) or freed

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

    def write_shared_slot(self, slot: int, adapter: tuple[str, int, str] | None) -> None:
        """Another rank: write the slot that rank 0 wrote, reading the adapter from
        its folder (rank 0 checked it already)."""
        lora = self.load(LoRARequest(*adapter)) if adapter is not None else None
        self.slots.write(slot, lora)

    def slots_use(self, path: str) -> bool:
        return self.slots.uses(path)

    # ---- what the engine reports ---------------------------------------------------

    def memory_usage(self) -> dict[str, int]:
        """Bytes of adapter weights in the CPU cache, per adapter. Device slots are
        fixed buffers; an unloaded adapter's slot is zeroed and reused."""
        return self.store.memory_usage()

    def cpu_names(self) -> list[str]:
        return self.store.cache.keys()

    def slot_names(self) -> list[str]:
        return self.slots.names()

    def pinned_slot_names(self) -> set[str]:
        """Pinned adapters holding a device slot: nothing evicts them from it."""
        return self.slots.pinned_names()

    def pinned_names(self) -> list[str]:
        return self.store.pinned_names()

    def load_times(self) -> tuple[list[int], float]:
        return self.store.load_times()

    def shutdown(self) -> None:
        self.store.shutdown()
