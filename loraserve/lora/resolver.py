"""Find an adapter for a model name the server does not know yet.

A resolver is a plugin: a callable registered under the entry-point group
``loraserve.lora_resolvers`` that returns a LoRAResolver, or None when it is not
configured (for example its environment variable is unset). The API server asks
the resolvers in order, first match wins, only while runtime LoRA updating is on.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from loraserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "loraserve.lora_resolvers"

# The resolvers that ship with loraserve, tried first and in this order. They are
# used even from a checkout whose entry points were never installed.
BUILTIN_RESOLVERS = {
    "lora_filesystem_resolver": "loraserve.lora.resolvers.filesystem:create_resolver",
    "lora_hf_hub_resolver": "loraserve.lora.resolvers.hf_hub:create_resolver",
}


class LoRAResolver(abc.ABC):
    """Maps an adapter name to a local PEFT adapter directory."""

    @abc.abstractmethod
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """Return a LoRARequest for lora_name (its lora_int_id is replaced by the
        server's own), or None when this resolver does not have it."""


def _entry_points() -> list[EntryPoint]:
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    for name, value in BUILTIN_RESOLVERS.items():
        found.setdefault(name, EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP))
    builtins = [found.pop(name) for name in BUILTIN_RESOLVERS]
    return builtins + [found[name] for name in sorted(found)]


def load_resolvers() -> list[LoRAResolver]:
    """Instantiate every configured resolver plugin, in the order they are tried."""
    resolvers: list[LoRAResolver] = []
    for ep in _entry_points():
        try:
            factory: Callable[[], LoRAResolver | None] = ep.load()
            resolver = factory()
        except Exception:  # noqa: BLE001 - a broken plugin must not stop the server
            logger.exception("LoRA resolver plugin %r failed to load; skipping it", ep.name)
            continue
        if resolver is not None:
            logger.info("LoRA resolver %r is active", ep.name)
            resolvers.append(resolver)
    return resolvers
