"""The names the server answers to: the base model and its LoRA adapters.

Maps a request's `model` field to None (the base model) or a LoRARequest, owns the
adapter ids, and implements /v1/models and runtime load/unload.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

import msgspec

from loraserve.engine.core_client import AsyncEngineClient, EngineDeadError, EngineUtilityError
from loraserve.entrypoints.errors import APIError, bad_request, engine_unavailable, not_found
from loraserve.entrypoints.protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolver

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter named on the command line (`--lora-modules`)."""

    name: str
    path: str
    base_model_name: str | None = None
    pinned: bool = False


class ServingModels:
    def __init__(
        self,
        engine: AsyncEngineClient,
        served_model_names: list[str],
        model_path: str,
        max_model_len: int,
        resolvers: list[LoRAResolver] | None = None,
        allow_runtime_updates: bool = False,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.resolvers = resolvers or []
        self.allow_runtime_updates = allow_runtime_updates
        self.loras: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        # Load, unload and resolve change self.loras across awaits: one at a time.
        self._lock = asyncio.Lock()

    @property
    def base_model_name(self) -> str:
        return self.served_model_names[0]

    def is_base_model(self, name: str | None) -> bool:
        return not name or name in self.served_model_names

    async def init_static_loras(self, modules: list[LoRAModulePath]) -> None:
        """Load the `--lora-modules` adapters; any failure stops start-up."""
        for module in modules:
            request = LoRARequest(
                lora_name=module.name,
                lora_int_id=next(self._ids),
                lora_path=module.path,
                base_model_name=module.base_model_name or self.base_model_name,
            )
            try:
                await self.engine.add_lora(request, pinned=module.pinned)
            except EngineUtilityError as exc:
                raise ValueError(f"--lora-modules {module.name}={module.path}: {exc}") from exc
            self.loras[module.name] = request
            logger.info("LoRA adapter %s loaded from %s%s", module.name, module.path,
                        " (pinned)" if module.pinned else "")

    async def resolve(self, model: str | None) -> LoRARequest | None:
        """The LoRARequest for a request's model field; None for the base model."""
        if self.is_base_model(model):
            return None
        lora = self.loras.get(model)
        if lora is not None:
            return lora
        if self.allow_runtime_updates and self.resolvers:
            lora = await self._resolve_with_plugins(model)
            if lora is not None:
                return lora
        raise not_found(f"The model `{model}` does not exist.", param="model")

    async def _resolve_with_plugins(self, name: str) -> LoRARequest | None:
        async with self._lock:
            if name in self.loras:
                return self.loras[name]
            for resolver in self.resolvers:
                found = await resolver.resolve_lora(self.base_model_name, name)
                if found is None:
                    continue
                request = msgspec.structs.replace(found, lora_int_id=next(self._ids))
                try:
                    await self.engine.add_lora(request)
                except EngineUtilityError as exc:
                    logger.warning("resolved adapter %r failed to load: %s", name, exc)
                    raise bad_request(
                        f"Failed to load LoRA adapter '{name}': {exc}", param="model"
                    ) from exc
                except EngineDeadError as exc:
                    raise engine_unavailable() from exc
                self.loras[name] = request
                return request
        return None

    def list_models(self) -> ModelList:
        cards = [
            ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len)
            for name in self.served_model_names
        ]
        cards += [
            ModelCard(
                id=lora.lora_name,
                root=lora.lora_path,
                parent=lora.base_model_name or self.base_model_name,
                max_model_len=self.max_model_len,
            )
            for lora in self.loras.values()
        ]
        return ModelList(data=cards)

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> str:
        """Load and activate an adapter; raise APIError with vLLM's status codes."""
        name, path = body.lora_name.strip(), body.lora_path.strip()
        if not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        if self.is_base_model(name):
            raise bad_request(f"'{name}' is the name of the base model, not an adapter.")
        async with self._lock:
            existing = self.loras.get(name)
            if existing is not None and not body.load_inplace:
                raise bad_request(
                    f"The lora adapter '{name}' has already been loaded. "
                    "Set 'load_inplace' to true to replace it."
                )
            request = LoRARequest(
                lora_name=name,
                lora_int_id=existing.lora_int_id if existing else next(self._ids),
                lora_path=path,
                base_model_name=self.base_model_name,
                load_inplace=existing is not None,
            )
            try:
                await self.engine.add_lora(request)
            except EngineUtilityError as exc:
                raise bad_request(f"Failed to load LoRA adapter '{name}': {exc}") from exc
            except EngineDeadError as exc:
                raise engine_unavailable() from exc
            self.loras[name] = msgspec.structs.replace(request, load_inplace=False)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> str:
        """Forget the name and free the adapter's memory in the engine."""
        name = body.lora_name.strip()
        if not name:
            raise bad_request("'lora_name' must be provided.")
        async with self._lock:
            if name not in self.loras:
                raise not_found(f"The lora adapter '{name}' cannot be found.")
            # Forget the name first so that no new request selects it meanwhile.
            self.loras.pop(name)
            try:
                await self.engine.remove_lora(name)
            except EngineUtilityError as exc:
                raise APIError(500, f"Failed to unload LoRA adapter '{name}': {exc}") from exc
            except EngineDeadError as exc:
                raise engine_unavailable() from exc
        return f"Success: LoRA adapter '{name}' removed successfully."
