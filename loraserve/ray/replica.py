"""One engine replica of the Ray application: an engine core and the serving layer.

Each replica holds an AsyncEngineClient (its own engine-core process, as under
`loraserve serve`) and the same handlers. The ingress calls `handle` through a
Ray Serve handle; for a request to an adapter it routes with the adapter's name
as the multiplexed model id, and the multiplexing hook here reads the adapter
into this replica's engine. Ray Serve then sends that adapter's requests to
replicas that hold it, and evicts the least recently used adapter past
`--max-cpu-loras` (the engine's CPU cache drops it too, in its own time, without
failing a request that still runs with it).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import BaseModel
from ray import serve

from loraserve import envs
from loraserve.entrypoints.api_server import (
    ServerSettings,
    build_server_state,
    record_engine_ready,
    server_metrics,
)
from loraserve.entrypoints.core_client import AsyncEngineClient, EngineDeadError, EngineUtilityError
from loraserve.entrypoints.errors import APIError, engine_unavailable, not_found
from loraserve.entrypoints.request_tokenizer import RequestTokenizer
from loraserve.entrypoints.serving_models import ServingModels, load_error
from loraserve.lora.request import LoRARequest
from loraserve.ray.registry import RegistrySnapshot

logger = logging.getLogger("loraserve.ray.replica")

# How long one registry poll waits for a change before it polls again.
WATCH_TIMEOUT_S = 10.0
METRICS_REPORT_S = 2.0

# Set by the multiplexing hook in the task of the request that made it read the
# adapter: the hook runs only when the replica does not hold the adapter yet.
_READ_FOR_THIS_REQUEST: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "loraserve_adapter_read", default=False
)

# The serving layer's handler for each endpoint the ingress forwards.
ENDPOINTS = {
    "completions": ("completion", "create_completion"),
    "chat": ("chat", "create_chat_completion"),
    "tokenize": ("tokenization", "tokenize"),
    "detokenize": ("tokenization", "detokenize"),
}


@dataclass
class ReplyHead:
    """The first item of every reply: which replica answered, and either an error,
    a JSON body, or (neither) the SSE events that follow."""

    replica: str
    engine_pid: int | None
    # The request named an adapter this replica did not hold, and it read it.
    adapter_read: bool = False
    json: dict | None = None
    error: tuple[int, str, str | None, str] | None = None  # status, message, param, type


class EngineReplica:
    async def __init__(self, settings: ServerSettings, tokenizer: Any, registry: Any,
                       static_loras: list[tuple[LoRARequest, bool]]) -> None:
        """static_loras: the --lora-modules adapters and whether each is pinned; each
        replica reads them all as it starts, so that a bad one stops the start."""
        self.registry = registry
        self.replica = _replica_name()
        self.metrics = server_metrics(settings)
        self.engine = AsyncEngineClient(tokenizer, settings.eos_token_id, self.metrics)
        self.request_tokenizer = RequestTokenizer(tokenizer)
        ready = await self.engine.start(settings.engine_config,
                                        float(envs.ENGINE_READY_TIMEOUT_S.get()))
        record_engine_ready(self.metrics, settings, ready)
        try:
            await self._set_up(settings, ready, registry, static_loras)
        except BaseException:
            await self.engine.shutdown()
            raise
        logger.info("replica %s ready (engine pid %d)", self.replica, ready.pid)

    async def _set_up(self, settings: ServerSettings, ready: Any, registry: Any,
                      static_loras: list[tuple[LoRARequest, bool]]) -> None:
        self.model_path = settings.model or ready.model_path
        self.max_model_len = ready.max_model_len
        self.models = ServingModels(self.engine, settings.served_model_names,
                                    self.model_path, ready.max_model_len)
        self.state = build_server_state(settings, self.engine, self.models,
                                        self.request_tokenizer, ready.max_model_len,
                                        self.metrics)
        for lora, pinned in static_loras:
            try:
                await self.engine.add_lora(lora, pinned=pinned)
            except EngineUtilityError as exc:
                raise ValueError(f"--lora-modules {lora.lora_name}={lora.lora_path}: {exc}"
                                 ) from exc
        self._snapshot = RegistrySnapshot(version=0)
        await self._apply(await registry.snapshot.remote())
        # Pinned adapters never leave the engine: they need no multiplexing place.
        num_pinned = sum(pinned for _, pinned in static_loras)
        lora_config = settings.engine_config.lora_config
        max_cpu_loras = lora_config.max_cpu_loras if lora_config else 1

        async def hold_adapter(lora_name: str) -> str:  # the hook wants a plain function
            return await self._read_adapter(lora_name)

        self._hold_adapter = serve.multiplexed(
            max_num_models_per_replica=max(1, max_cpu_loras - num_pinned)
        )(hold_adapter)
        self._tasks = [asyncio.create_task(self._follow_registry()),
                       asyncio.create_task(self._report_metrics())]

    # -- requests -----------------------------------------------------------------

    async def handle(self, endpoint: str, body: BaseModel) -> AsyncIterator[Any]:
        """Run one request: a ReplyHead, then the SSE events of a streamed answer."""
        head = ReplyHead(self.replica, self.engine.engine_pid)
        try:
            adapter = serve.get_multiplexed_model_id()
            if adapter:
                await self._hold_adapter(adapter)
                head.adapter_read = _READ_FOR_THIS_REQUEST.get()
            serving, method = ENDPOINTS[endpoint]
            result = await getattr(getattr(self.state, serving), method)(body)
        except EngineDeadError:
            result = engine_unavailable()
        except APIError as exc:
            result = exc
        if isinstance(result, APIError):
            head.error = (result.status, result.message, result.param, result.error_type)
            yield head
            return
        if isinstance(result, BaseModel):
            head.json = result.model_dump()
            yield head
            return
        yield head
        async for event in result:
            yield event

    async def _read_adapter(self, lora_name: str) -> str:
        """The multiplexing hook: read the adapter into the engine's CPU cache."""
        lora = self.models.loras.get(lora_name)
        if lora is None:
            raise not_found(f"The model `{lora_name}` does not exist.", param="model")
        try:
            await self.engine.add_lora(lora)
        except EngineUtilityError as exc:
            raise load_error(exc) from exc
        _READ_FOR_THIS_REQUEST.set(True)
        return lora_name

    async def check_adapter(self, lora: LoRARequest) -> tuple[str, str] | None:
        """Read an adapter the ingress is about to publish: None when the engine takes
        it, else the engine's (error type, reason)."""
        try:
            await self.engine.add_lora(lora)
        except EngineUtilityError as exc:
            return exc.error_type, str(exc)
        return None

    async def describe(self) -> dict[str, Any]:
        """The replica, its model, the adapter names it answers to and those its
        engine holds now."""
        return {"replica": self.replica, "engine_pid": self.engine.engine_pid,
                "model_path": self.model_path, "max_model_len": self.max_model_len,
                "adapters": sorted(self.models.loras),
                "engine_adapters": sorted(await self.engine.list_loras())}

    async def engine_stats(self) -> dict[str, Any]:
        stats = await self.engine.get_stats()
        return {"replica": self.replica, "engine_pid": self.engine.engine_pid,
                "scheduler": msgspec.structs.asdict(stats),
                "lora_memory_bytes": await self.engine.lora_memory_usage()}

    def check_health(self) -> None:
        # Ray Serve replaces a replica whose engine core has died.
        if self.engine.is_dead:
            raise RuntimeError("the engine core died")

    async def __del__(self) -> None:
        for task in getattr(self, "_tasks", []):
            task.cancel()
        await self.engine.shutdown()
        self.request_tokenizer.shutdown()

    # -- following the registry ---------------------------------------------------

    async def _follow_registry(self) -> None:
        while True:
            try:
                snapshot = await self.registry.watch.remote(
                    self.replica, self._snapshot.version, WATCH_TIMEOUT_S
                )
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the registry restarts; poll again
                logger.exception("polling the adapter registry failed")
                await asyncio.sleep(1.0)
                continue
            if snapshot is not None:
                await self._apply(snapshot)

    async def _report_metrics(self) -> None:
        while True:
            try:
                await self.registry.report_metrics.remote(self.replica,
                                                          self.metrics.render().decode())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the registry restarts; report again
                logger.exception("reporting metrics to the adapter registry failed")
            await asyncio.sleep(METRICS_REPORT_S)

    async def _apply(self, snapshot: RegistrySnapshot) -> None:
        """Take the registry's adapters: names resolve from now on; an unloaded one
        leaves the engine, one loaded in place is read again if the engine has it."""
        before = self._snapshot
        self.models.adopt(snapshot.loras)
        removed = [name for name in before.loras if name not in snapshot.loras]
        reloaded = [name for name, generation in snapshot.generations.items()
                    if name in before.generations and before.generations[name] != generation]
        if removed or reloaded:
            present = set(await self.engine.list_loras())
            for name in removed:
                await self.engine.remove_lora(name)
            for name in reloaded:
                if name in present:
                    lora = msgspec.structs.replace(snapshot.loras[name], load_inplace=True)
                    try:
                        await self.engine.add_lora(lora)
                    except EngineUtilityError as exc:
                        logger.error("reloading LoRA adapter %s failed: %s", name, exc)
        self._snapshot = snapshot


def _replica_name() -> str:
    """The replica's Ray actor name: what `ray.get_actor(name, namespace="serve")`
    finds, so that an operator (or a test) can tell replicas apart and stop one."""
    import ray

    try:
        name = ray.get_runtime_context().get_actor_name()
    except Exception:  # noqa: BLE001 - outside an actor (a unit test)
        name = None
    return name or f"pid-{os.getpid()}"
