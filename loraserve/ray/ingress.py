"""The Ray application's ingress: `loraserve serve`'s HTTP app over engine replicas.

The FastAPI app is the one `loraserve serve` runs (api_server.build_app: same
routes, middleware and error shapes). What it calls differs: the request
handlers forward to an engine replica through a Ray Serve handle, routed by the
adapter the request names; runtime loads and unloads check the adapter on one
replica, then publish it through the registry to all of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel
from ray.exceptions import RayError, RayTaskError

from loraserve.engine.protocol import SchedulerStats
from loraserve.entrypoints.api_server import (
    ServerSettings,
    ServerState,
    build_app,
    http_settings,
)
from loraserve.entrypoints.core_client import EngineDeadError, EngineUtilityError
from loraserve.entrypoints.errors import APIError, engine_unavailable
from loraserve.entrypoints.serving_common import SSE_DONE, sse_error
from loraserve.entrypoints.serving_models import ServingModels
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import load_resolvers
from loraserve.ray.replica import ReplyHead

logger = logging.getLogger("loraserve.ray.ingress")

# Response headers that say which replica answered.
REPLICA_HEADER = "x-loraserve-replica"
ENGINE_PID_HEADER = "x-loraserve-engine-pid"
# "1" when the replica did not hold the request's adapter and read it for it.
ADAPTER_READ_HEADER = "x-loraserve-adapter-read"
# How long a load or unload waits for every replica to apply it.
PUBLISH_TIMEOUT_S = 60.0
METRICS_REFRESH_S = 2.0


def replica_unavailable(exc: Exception) -> APIError:
    return engine_unavailable(f"The replica serving this request is gone ({type(exc).__name__}); "
                              "retry the request.")


class ReplicaApp:
    """The ASGI app given to serve.ingress. build_app needs the replica's handles
    and settings, which only the ingress's constructor has, so this forwards to the
    app that the constructor builds. Ray Serve runs one ingress per process."""

    app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def receive_until_disconnect() -> dict:
            # Ray Serve fetches the request's messages from its proxy; once the
            # client has gone the proxy cancels that fetch, and Ray raises the
            # cancellation (TaskCancelledError) instead of saying http.disconnect
            # as uvicorn does. It is the same event: let the app see it as one.
            try:
                return await receive()
            except RayError:
                return {"type": "http.disconnect"}

        await type(self).app(scope, receive_until_disconnect, send)


class Ingress:
    async def __init__(self, settings: ServerSettings, replicas: Any, registry: Any,
                       pinned: list[str], allow_runtime_updates: bool) -> None:
        info = await replicas.describe.remote()
        snapshot = await registry.snapshot.remote()
        models = ServingModels(
            ClusterAdapters(replicas, registry),
            settings.served_model_names,
            settings.model or info["model_path"],
            info["max_model_len"],
            resolvers=load_resolvers(settings.lora_resolvers) if allow_runtime_updates else [],
            allow_runtime_updates=allow_runtime_updates,
        )
        models.adopt(snapshot.loras)
        serving = RemoteServing(replicas, models, set(pinned))
        self.metrics = ClusterMetrics(registry)
        self.metrics.start()
        state = ServerState(
            engine=ClusterEngine(replicas, self.metrics),
            models=models,
            completion=serving,
            chat=serving,
            tokenization=serving,
            metrics=self.metrics,
            allow_runtime_lora=allow_runtime_updates,
            **http_settings(settings),
        )
        ReplicaApp.app = build_app(state)


class RemoteServing:
    """The serving layer's handlers, run on the replica the request routes to: an
    adapter's name is the multiplexed model id; the base model goes anywhere."""

    def __init__(self, replicas: Any, models: ServingModels, pinned: set[str]) -> None:
        self.replicas = replicas
        self.models = models
        self.pinned = pinned  # on every replica: routed like the base model

    async def create_completion(self, body: BaseModel) -> Any:
        return await self._forward("completions", body)

    async def create_chat_completion(self, body: BaseModel) -> Any:
        return await self._forward("chat", body)

    # Tokenizing runs no adapter: any replica does it.
    async def tokenize(self, body: BaseModel) -> Any:
        return await self._forward("tokenize", body, by_adapter=False)

    async def detokenize(self, body: BaseModel) -> Any:
        return await self._forward("detokenize", body, by_adapter=False)

    async def _forward(self, endpoint: str, body: BaseModel, by_adapter: bool = True) -> Any:
        lora = await self.models.resolve(getattr(body, "model", None))
        adapter = (lora.lora_name if by_adapter and lora is not None
                   and lora.lora_name not in self.pinned else "")
        handle = self.replicas.options(stream=True, multiplexed_model_id=adapter)
        reply = handle.handle.remote(endpoint, body)
        try:
            head: ReplyHead = await reply.__anext__()
        except asyncio.CancelledError:  # the client went away
            reply.cancel()
            raise
        except RayTaskError:
            raise
        except RayError as exc:
            raise replica_unavailable(exc) from exc
        headers = {REPLICA_HEADER: head.replica, ENGINE_PID_HEADER: str(head.engine_pid),
                   ADAPTER_READ_HEADER: str(int(head.adapter_read))}
        if head.error is not None:
            status, message, param, error_type = head.error
            error = APIError(status, message, param, error_type)
            return JSONResponse(error.body(), status_code=status, headers=headers)
        if head.json is not None:
            return JSONResponse(head.json, headers=headers)
        return StreamingResponse(_events(reply), media_type="text/event-stream",
                                 headers=headers)


async def _events(reply: Any) -> AsyncIterator[str]:
    """The replica's SSE events; a replica lost mid-stream ends it as a dead engine
    does under `loraserve serve`: an error event, then [DONE]."""
    try:
        async for event in reply:
            yield event
    except RayError as exc:
        yield sse_error(replica_unavailable(exc))
        yield SSE_DONE
    finally:
        reply.cancel()


class ClusterAdapters:
    """What ServingModels asks of an engine to load and unload adapters, for every
    replica at once: an adapter is read on one replica (the engine's own checks
    decide, with its error), then published to all of them."""

    def __init__(self, replicas: Any, registry: Any) -> None:
        self.replicas = replicas
        self.registry = registry

    async def add_lora(self, lora: LoRARequest, pinned: bool = False) -> None:
        if pinned:
            # The registry publishes adapters without a pin: refuse rather than
            # answer success for a pin that no replica would hold.
            raise EngineUtilityError("ValueError", "serve-ray pins adapters only at start-up "
                                     "(--lora-modules with \"pinned\": true)")
        try:
            error = await self.replicas.check_adapter.remote(lora)
        except RayError as exc:
            raise EngineDeadError(str(replica_unavailable(exc))) from exc
        if error is not None:
            raise EngineUtilityError(*error)
        await self._reach_every_replica(await self.registry.publish.remote(lora))

    async def remove_lora(self, lora_name: str) -> bool:
        await self._reach_every_replica(await self.registry.withdraw.remote(lora_name))
        return True

    async def _reach_every_replica(self, version: int) -> None:
        lagging = await self.registry.wait_applied.remote(version, PUBLISH_TIMEOUT_S)
        if lagging:
            # They take the change when they poll again; the registry has it.
            logger.warning("replicas %s have not applied adapter change %d yet",
                           lagging, version)


class ClusterEngine:
    """What build_app asks of the engine directly. The replicas' engines live and die
    with their replicas, which Ray Serve replaces; the ingress itself never holds a
    dead engine. /v1/engine_stats answers for the replica the call lands on."""

    is_dead = False
    shutting_down = False

    def __init__(self, replicas: Any, metrics: ClusterMetrics) -> None:
        self.replicas = replicas
        self.metrics = metrics
        self._last: dict[str, Any] = {}

    @property
    def engine_pid(self) -> int | None:
        return self._last.get("engine_pid")

    async def get_stats(self) -> SchedulerStats:
        try:
            self._last = await self.replicas.engine_stats.remote()
        except RayError as exc:
            raise replica_unavailable(exc) from exc
        return msgspec.convert(self._last["scheduler"], SchedulerStats)

    async def lora_memory_usage(self) -> dict[str, int]:
        return dict(self._last.get("lora_memory_bytes", {}))

    async def shutdown(self) -> None:
        self.metrics.stop()


class ClusterMetrics:
    """/metrics of the application: every replica's series, with a `replica` label.
    The replicas report to the registry; this refreshes from it in the background,
    since a Prometheus render is synchronous."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self._text = b""
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._refresh())

    def render(self) -> bytes:
        return self._text

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _refresh(self) -> None:
        while True:
            try:
                self._text = merge_metrics(await self.registry.metrics.remote())
            except Exception:  # noqa: BLE001 - a registry restart; the next round retries
                logger.exception("collecting the replicas' metrics failed")
            await asyncio.sleep(METRICS_REFRESH_S)


def merge_metrics(texts: dict[str, str]) -> bytes:
    """Prometheus texts by replica, as one exposition with a `replica` label."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            merged.samples += [s._replace(labels={**s.labels, "replica": replica})
                               for s in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
