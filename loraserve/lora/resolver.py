"""Find an adapter for a model name the server does not know yet.

The contract is vLLM's (``vllm.lora.resolver``), so that a vLLM resolver plugin
ports by changing its imports: subclass ``LoRAResolver`` and register an instance
with ``LoRAResolverRegistry.register_resolver(name, resolver)``.

Plugins are entry points of the group ``loraserve.lora_resolvers``, each naming a
function that takes no arguments. Either it registers its resolvers itself and
returns None (vLLM's form), or it returns a LoRAResolver, which is registered
under the entry point's name, or None when it is not configured (for example its
environment variable is unset). Which plugins run is chosen by name: the
``--lora-resolvers`` list, else ``LORASERVE_PLUGINS`` (comma-separated), else vLLM's
``VLLM_PLUGINS``, else all of them. ``VLLM_PLUGINS`` may also name vLLM plugins of
other kinds: its names that are no resolver plugin here are skipped. The API server
asks the resolvers in the order they were registered, first match wins, only while
runtime LoRA updating is on.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterable, KeysView
from importlib.metadata import EntryPoint, entry_points

from loraserve import envs
from loraserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "loraserve.lora_resolvers"
# Comma-separated names of the plugins to run; unset: every installed one.
ENV_PLUGINS = envs.PLUGINS.name

# The resolvers that ship with loraserve, run first and in this order. They are
# found even from a checkout whose entry points were never installed.
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


class LoRAResolverRegistryType:
    """Resolvers by name, in the order they were registered."""

    def __init__(self) -> None:
        self.resolvers: dict[str, LoRAResolver] = {}

    def register_resolver(self, resolver_name: str, resolver: LoRAResolver) -> None:
        """Register (or replace) the resolver called resolver_name."""
        if not isinstance(resolver, LoRAResolver):
            raise TypeError(
                f"LoRA resolver {resolver_name!r} must be a LoRAResolver, "
                f"got {type(resolver).__name__}"
            )
        if resolver_name in self.resolvers:
            logger.warning("LoRA resolver %r is registered again; the new one replaces it",
                           resolver_name)
        self.resolvers[resolver_name] = resolver

    def get_resolver(self, resolver_name: str) -> LoRAResolver:
        """The resolver called resolver_name; KeyError, naming those there are, if none."""
        try:
            return self.resolvers[resolver_name]
        except KeyError:
            raise KeyError(
                f"LoRA resolver {resolver_name!r} is not registered; registered: "
                f"{sorted(self.resolvers)}"
            ) from None

    def get_supported_resolvers(self) -> KeysView[str]:
        """The names of the registered resolvers, in registration order."""
        return self.resolvers.keys()


# The one registry of the process, as in vLLM: plugins import it and register into
# it, so it cannot be handed to them. Only plugin loading at start-up writes to it.
LoRAResolverRegistry = LoRAResolverRegistryType()


def plugin_entry_points() -> list[EntryPoint]:
    """Every resolver plugin: the built-in ones first, then the others by name."""
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    for name, value in BUILTIN_RESOLVERS.items():
        found.setdefault(name, EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP))
    builtins = [found.pop(name) for name in BUILTIN_RESOLVERS]
    return builtins + [found[name] for name in sorted(found)]


def selected_plugin_names() -> list[str] | None:
    """The plugin names in LORASERVE_PLUGINS (else VLLM_PLUGINS); None when neither is
    set (all plugins)."""
    value = envs.PLUGINS.raw()
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def _run_plugin(ep: EntryPoint, registry: LoRAResolverRegistryType) -> list[str]:
    """Run one plugin; the names of the resolvers it registered (or replaced)."""
    before = dict(registry.resolvers)
    plugin: Callable[[], LoRAResolver | None] = ep.load()
    resolver = plugin()
    if resolver is not None:
        registry.register_resolver(ep.name, resolver)
    return [name for name, found in registry.resolvers.items() if before.get(name) is not found]


def load_resolvers(names: Iterable[str] | None = None) -> list[LoRAResolver]:
    """Run the resolver plugins and return the resolvers to ask, in order.

    names: the plugins to run (``--lora-resolvers``); None: those named in
    LORASERVE_PLUGINS (or VLLM_PLUGINS), or all when neither is set, and then
    resolvers registered in code before this call are asked too. A named plugin that
    does not exist or fails stops start-up with a clear error; of all plugins, a
    broken one is skipped with its traceback in the log, so that it cannot stop the
    server.
    """
    registry = LoRAResolverRegistry
    chosen = list(names) if names is not None else selected_plugin_names()
    plugins = plugin_entry_points()
    if chosen is not None:
        by_name = {ep.name: ep for ep in plugins}
        unknown = [name for name in chosen if name not in by_name]
        if unknown and names is None and envs.PLUGINS.source() in envs.PLUGINS.aliases:
            # vLLM's list names all its plugins, of every kind: only ours are resolvers.
            logger.info("%s: %s are not LoRA resolver plugins here; skipped",
                        envs.PLUGINS.source(), unknown)
            chosen = [name for name in chosen if name in by_name]
        elif unknown:
            raise ValueError(
                f"unknown LoRA resolver plugin(s) {unknown}; installed: {sorted(by_name)}"
            )
        plugins = [by_name[name] for name in dict.fromkeys(chosen)]
    registered: list[str] = [] if chosen is not None else list(
        registry.get_supported_resolvers()
    )
    for ep in plugins:
        try:
            added = _run_plugin(ep, registry)
        except Exception as exc:
            if chosen is not None:
                raise ValueError(
                    f"LoRA resolver plugin {ep.name!r} failed to load: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            logger.exception("LoRA resolver plugin %r failed to load; skipping it", ep.name)
            continue
        if added:
            logger.info("LoRA resolver plugin %r registered %s", ep.name, added)
        elif chosen is not None:
            logger.warning("LoRA resolver plugin %r registered no resolver (not configured?)",
                           ep.name)
        registered += [name for name in added if name not in registered]
    return [registry.get_resolver(name) for name in registered]
