"""The names the server answers to: the base model and its LoRA adapters.

Maps a request's `model` field to None (the base model) or a LoRARequest, owns the
adapter ids, and implements /v1/models and runtime load/unload.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from dataclasses import dataclass

import msgspec

from loraserve.entrypoints.core_client import AsyncEngineClient, EngineDeadError, EngineUtilityError
from loraserve.entrypoints.errors import (
    APIError,
    bad_request,
    engine_unavailable,
    invalid_user_input,
    not_found,
)
from loraserve.entrypoints.protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from loraserve.lora.errors import LoRAError, LoRANotFoundError
from loraserve.lora.peft_config import check_config_rank, read_peft_config
from loraserve.lora.request import LoRARequest, lora_name_error
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
        max_loras: int | None = None,
    ) -> None:
        """model_path: the base model as `--model` named it (a Hub id or a
        directory), which its model card shows as `root`. max_loras: the engine's
        device slots, for the runtime pins to leave one to the other adapters
        (None: not checked here)."""
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.resolvers = resolvers or []
        self.allow_runtime_updates = allow_runtime_updates
        self.loras: dict[str, LoRARequest] = {}
        self.max_loras = max_loras
        # Pinned adapters keep their device slots for good.
        self.pinned: set[str] = set()
        self._ids = itertools.count(1)
        # Load, unload and resolve change self.loras across awaits: one at a time.
        self._lock = asyncio.Lock()

    @property
    def base_model_name(self) -> str:
        return self.served_model_names[0]

    def is_base_model(self, name: str | None) -> bool:
        return not name or name in self.served_model_names

    def adopt(self, loras: dict[str, LoRARequest]) -> None:
        """Answer to adapters that were loaded elsewhere (the Ray application keeps
        them in its registry); ids given from now on continue past theirs."""
        self.loras = dict(loras)
        last = max((lora.lora_int_id for lora in self.loras.values()), default=0)
        self._ids = itertools.count(last + 1)

    async def init_static_loras(self, modules: list[LoRAModulePath], preload: int,
                                max_lora_rank: int) -> None:
        """Serve the `--lora-modules` adapters. The pinned ones and the first
        `preload` others (what the CPU cache holds) are read now, side by side;
        the rest are registered, their adapter_config.json checked, and read on
        first use, so that a thousand adapters start in seconds. Any failure (of a
        read, or of a check) stops start-up."""
        requests = [(module, LoRARequest(
            lora_name=module.name,
            lora_int_id=next(self._ids),
            lora_path=module.path,
            base_model_name=module.base_model_name or self.base_model_name,
        )) for module in modules]
        unpinned = [pair for pair in requests if not pair[0].pinned]
        later = unpinned[max(0, preload - (len(requests) - len(unpinned))):]
        for module, _ in later:
            _check_adapter_config(module, max_lora_rank)
        await asyncio.gather(*(self._load_static(module, request) for module, request in requests
                               if module.pinned or (module, request) not in later))
        self.loras.update((module.name, request) for module, request in requests)
        if later:
            logger.info("%d more LoRA adapters registered; each is read on first use",
                        len(later))

    async def _load_static(self, module: LoRAModulePath, request: LoRARequest) -> None:
        try:
            await self.engine.add_lora(request, pinned=module.pinned)
        except EngineUtilityError as exc:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {exc}") from exc
        if module.pinned:
            self.pinned.add(module.name)
        logger.info("LoRA adapter %s loaded from %s%s", module.name, module.path,
                    " (pinned)" if module.pinned else "")

    async def resolve(self, model: str | None) -> LoRARequest | None:
        """The LoRARequest for a request's model field; None for the base model."""
        if self.is_base_model(model):
            return None
        lora = self.loras.get(model)
        if lora is not None:
            return lora
        # A name that no adapter may have is not asked about: it does not exist,
        # like any other unknown name, and resolvers only ever see bounded names.
        if self.allow_runtime_updates and self.resolvers and lora_name_error(model) is None:
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
                logger.info("LoRA adapter %s found by resolver %s and loaded from %s", name,
                            type(resolver).__name__, request.lora_path)
                return request
        return None

    def list_models(self) -> ModelList:
        cards = [self._base_card(name) for name in self.served_model_names]
        cards += [self._lora_card(lora) for lora in self.loras.values()]
        return ModelList(data=cards)

    def model_card(self, model_id: str) -> ModelCard:
        """GET /v1/models/{id}: the card of a served name or a loaded adapter."""
        if model_id in self.served_model_names:
            return self._base_card(model_id)
        lora = self.loras.get(model_id)
        if lora is None:
            raise not_found(f"The model `{model_id}` does not exist.", param="model")
        return self._lora_card(lora)

    def _base_card(self, name: str) -> ModelCard:
        return ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len)

    def _lora_card(self, lora: LoRARequest) -> ModelCard:
        return ModelCard(
            id=lora.lora_name,
            root=lora.lora_path,
            parent=lora.base_model_name or self.base_model_name,
            max_model_len=self.max_model_len,
        )

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> str:
        """Load and activate an adapter; raise APIError with vLLM's status codes."""
        name, path = body.lora_name.strip(), body.lora_path.strip()
        if not name or not path:
            raise invalid_user_input("Both 'lora_name' and 'lora_path' must be provided.")
        reason = lora_name_error(name)
        if reason is not None:
            raise invalid_user_input(f"Invalid 'lora_name': {reason}.", param="lora_name")
        if self.is_base_model(name):
            raise invalid_user_input(
                f"'{name}' is the name of the base model, not an adapter.", param="lora_name"
            )
        async with self._lock:
            existing = self.loras.get(name)
            if existing is not None and not body.load_inplace:
                raise invalid_user_input(
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True.", param="lora_name",
                )
            self._check_slots_left(name, body.pinned)
            request = LoRARequest(
                lora_name=name,
                lora_int_id=existing.lora_int_id if existing else next(self._ids),
                lora_path=path,
                base_model_name=self.base_model_name,
                load_inplace=existing is not None,
            )
            try:
                await self.engine.add_lora(request, pinned=body.pinned)
            except EngineUtilityError as exc:
                raise load_error(exc) from exc
            except EngineDeadError as exc:
                raise engine_unavailable() from exc
            self.loras[name] = msgspec.structs.replace(request, load_inplace=False)
            if body.pinned:
                self.pinned.add(name)
        logger.info("LoRA adapter %s loaded from %s at run time%s%s", name, path,
                    " in place" if existing is not None else "",
                    " (pinned)" if name in self.pinned else "")
        return f"Success: LoRA adapter '{name}' added successfully."

    def _check_slots_left(self, name: str, pin: bool) -> None:
        """With runtime updates any adapter may be asked for later, and pinned
        adapters never give up their slots: at least one slot must stay unpinned."""
        if self.max_loras is None or name in self.pinned:
            return  # unchecked, or an in-place reload of an adapter pinned already
        pinned = sorted(self.pinned | {name} if pin else self.pinned)
        if len(pinned) < self.max_loras:
            return
        if pin:
            raise bad_request(
                f"Pinning '{name}' would leave all {self.max_loras} device slots (--max-loras) "
                f"to pinned adapters ({', '.join(pinned)}) and none for any other adapter.",
                param="pinned",
            )
        raise bad_request(
            f"All {self.max_loras} device slots (--max-loras) are held by pinned adapters "
            f"({', '.join(pinned)}): '{name}' could never run.", param="lora_name",
        )

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> str:
        """Forget the name and free the adapter's memory in the engine."""
        name = body.lora_name.strip()
        if not name:
            raise invalid_user_input("'lora_name' must be provided.")
        async with self._lock:
            if name not in self.loras:
                raise not_found(f"The lora adapter '{name}' cannot be found.")
            # Forget the name first so that no new request selects it meanwhile.
            self.loras.pop(name)
            self.pinned.discard(name)
            try:
                await self.engine.remove_lora(name)
            except EngineUtilityError as exc:
                raise APIError(500, f"Failed to unload LoRA adapter '{name}': {exc}") from exc
            except EngineDeadError as exc:
                raise engine_unavailable() from exc
        logger.info("LoRA adapter %s unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."


def load_error(exc: EngineUtilityError) -> APIError:
    """The engine's reason an adapter did not load, with vLLM's status: 404 when
    there is no adapter at the path, 400 when there is one that loraserve cannot
    serve (bad rank, DoRA, modules_to_save, bad JSON or tensors)."""
    if exc.error_type == LoRANotFoundError.__name__:
        return not_found(str(exc), param="lora_path")
    return bad_request(str(exc), param="lora_path")


def _check_adapter_config(module: LoRAModulePath, max_lora_rank: int) -> None:
    """What can be checked of an adapter without reading its weights: its
    adapter_config.json (in a local folder; a Hub repo is fetched on first use)."""
    path = os.path.expanduser(module.path)
    if not os.path.isdir(path):
        if os.path.exists(path) or path.startswith(("/", "./", "../")):
            raise ValueError(f"--lora-modules {module.name}={module.path}: no adapter "
                             "directory at that path")
        return
    try:
        check_config_rank(module.name, read_peft_config(module.name, path), max_lora_rank)
    except LoRAError as exc:
        raise ValueError(f"--lora-modules {module.name}={module.path}: {exc}") from exc
