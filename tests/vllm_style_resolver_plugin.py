"""A LoRA resolver plugin written the way one is written for vLLM, with only its
imports changed (``vllm.lora.*`` to ``loraserve.lora.*``): a LoRAResolver subclass,
and a registration function without arguments for the entry point to name.

It maps the names in the JSON object in ALIASES_ENV to adapter paths.
"""

import json
import os

from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolver, LoRAResolverRegistry

ALIASES_ENV = "ALIAS_RESOLVER_ADAPTERS"
RESOLVER_NAME = "Alias Resolver"


class AliasResolver(LoRAResolver):
    def __init__(self, aliases: dict[str, str]):
        self.aliases = aliases

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        path = self.aliases.get(lora_name)
        if path is None:
            return None
        return LoRARequest(lora_name=lora_name, lora_int_id=abs(hash(lora_name)) or 1,
                           lora_path=path)


def register_alias_resolver():
    """Register the resolver when it is configured; do nothing otherwise."""
    aliases = json.loads(os.environ.get(ALIASES_ENV) or "{}")
    if aliases:
        LoRAResolverRegistry.register_resolver(RESOLVER_NAME, AliasResolver(aliases))
