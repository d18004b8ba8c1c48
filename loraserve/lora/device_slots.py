"""Device slots (max_loras): which adapter each slot of the wrappers' weight stacks
holds, an LRU over them, and writing an adapter into every wrapper's slot.

An adapter takes a slot when a step needs it (or at once when added through the
API); a module the adapter does not target has its slot zeroed. A pinned adapter
never leaves its slot, and an adapter a running request uses keeps it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import torch

from loraserve.lora.lru import LRUCache
from loraserve.lora.peft_adapter import LoRAModel

logger = logging.getLogger(__name__)


class DeviceSlots:
    def __init__(self, num_slots: int, wrappers: Mapping[str, torch.nn.Module]) -> None:
        self.num_slots = num_slots
        self.wrappers = wrappers
        # name -> slot index. Free slots are the ones not in the map.
        self.slots: LRUCache[int] = LRUCache(num_slots)
        # Per slot, the wrapper paths its adapter has weights for.
        self._slot_modules: dict[int, frozenset[str]] = {}
        # Bumped whenever which adapter holds a slot, or a pin, changes.
        self.changes = 0

    def __contains__(self, name: str) -> bool:
        return name in self.slots

    def get(self, name: str) -> int | None:
        """The adapter's slot, marked as just used; None when it holds none."""
        return self.slots.get(name)

    def slot_of(self, name: str) -> int | None:
        """The adapter's slot, leaving the LRU order alone."""
        return self.slots.peek(name)

    def activate(self, lora: LoRAModel, pinned: bool = False,
                 protected: Iterable[str] = ()) -> int:
        """Give an adapter a slot, evicting the least recently used one that is
        neither pinned nor `protected`. Returns the slot; raises RuntimeError when
        every slot is held."""
        name = lora.name
        slot = self.slots.get(name)
        if slot is not None:
            return slot
        used = set(self.slots.values())
        free = [s for s in range(self.num_slots) if s not in used]
        if not free:
            victim = self.slots.oldest_evictable(set(protected) | {name})
            if victim is None:
                raise RuntimeError(
                    f"no free LoRA slot for {name!r}: all {self.num_slots} are in use")
            free = [self.slots.pop(victim)]
            logger.debug("LoRA %s leaves slot %d", victim, free[0])
        slot = free[0]
        self.write(slot, lora)
        self.slots.put(name, slot)
        if pinned:
            self.slots.pin(name)
        return slot

    def rewrite(self, lora: LoRAModel) -> None:
        """New weights under a name that holds a slot (load_inplace)."""
        slot = self.slots.peek(lora.name)
        if slot is not None:
            self.write(slot, lora)

    def pin(self, name: str) -> None:
        if name in self.slots:
            self.slots.pin(name)
            self.changes += 1

    def free(self, name: str) -> bool:
        """Zero and free the adapter's slot; whether it held one."""
        slot = self.slots.pop(name)
        if slot is None:
            return False
        self.write(slot, None)
        return True

    def write(self, slot: int, lora: LoRAModel | None) -> None:
        self.changes += 1
        with torch.no_grad():
            for path, wrapper in self.wrappers.items():
                wrapper.set_slot(slot, lora.modules.get(path) if lora is not None else None)
        self._slot_modules[slot] = frozenset(lora.modules) if lora is not None else frozenset()

    def uses(self, path: str) -> bool:
        """Whether an adapter in a slot has weights for the wrapper at `path`."""
        return any(path in modules for modules in self._slot_modules.values())

    def names(self) -> list[str]:
        return self.slots.keys()

    def pinned_names(self) -> set[str]:
        return {name for name in self.slots.keys() if self.slots.is_pinned(name)}
