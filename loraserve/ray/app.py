"""The Ray Serve application: an ingress, N engine replicas, an adapter registry.

```
client ─HTTP─▶ Ray Serve proxy ─▶ Ingress ──handle (multiplexed id = adapter)──▶ EngineReplica × N
                                  build_app                                     an engine core each
                                      └── load / unload ─▶ AdapterRegistry ◀─ watch ─┘
```

`loraserve serve-ray MODEL --num-replicas N ...` builds and runs it; so does
`serve run loraserve.ray:app_builder argv="MODEL --num-replicas N ..."`, or a
Ray Serve config file whose application names that import path.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import threading
from typing import Any

from ray import serve

from loraserve import envs
from loraserve.entrypoints.api_server import ServerSettings
from loraserve.entrypoints.ray_options import RayOptions
from loraserve.lora.request import LoRARequest
from loraserve.ray.ingress import Ingress, ReplicaApp
from loraserve.ray.registry import AdapterRegistry
from loraserve.ray.replica import EngineReplica

logger = logging.getLogger("loraserve.ray")

APP_NAME = "loraserve"
# Requests in flight that a replica takes before Ray Serve queues them in front of
# it: a replica batches up to --max-num-seqs of them in each engine step.
MIN_ONGOING_REQUESTS = 64
# The ingress and the registry only wait on others.
WAITING_ONGOING_REQUESTS = 10_000
# How often a stopping replica checks whether its requests have finished; Ray
# Serve's 2 s makes every deployment (one after the other) take 2 s to stop, idle
# or not.
SHUTDOWN_WAIT_LOOP_S = 0.1


def static_loras(settings: ServerSettings) -> list[tuple[LoRARequest, bool]]:
    """The --lora-modules adapters with their ids, and whether each is pinned."""
    return [
        (LoRARequest(lora_name=m.name, lora_int_id=i, lora_path=m.path,
                     base_model_name=m.base_model_name or settings.served_model_names[0]),
         m.pinned)
        for i, m in enumerate(settings.lora_modules, start=1)
    ]


def build_application(settings: ServerSettings, tokenizer: Any,
                      options: RayOptions) -> serve.Application:
    static = static_loras(settings)
    registry = serve.deployment(
        AdapterRegistry, name="AdapterRegistry", num_replicas=1,
        max_ongoing_requests=WAITING_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0},
        # The replicas poll it and report to it every few seconds: no line per call.
        logging_config={"enable_access_log": False},
        # Its requests in flight are long polls (watch, wait_applied) waiting for a
        # change that no one will make once the application stops: draining would
        # only wait them out. Its state is in memory, lost on a stop either way.
        graceful_shutdown_timeout_s=0, graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
    ).bind([lora for lora, _ in static])

    config = settings.engine_config
    num_gpus = options.replica_num_gpus
    if num_gpus is None:
        num_gpus = 1 if config.device.type == "cuda" else 0
    if options.max_replicas is not None:
        scaling: dict[str, Any] = {"autoscaling_config": {
            "min_replicas": options.num_replicas,
            "initial_replicas": options.num_replicas,
            "max_replicas": options.max_replicas,
            "target_ongoing_requests": options.target_ongoing_requests,
        }}
    else:
        scaling = {"num_replicas": options.num_replicas}
    replicas = serve.deployment(
        EngineReplica, name="EngineReplica",
        max_ongoing_requests=max(MIN_ONGOING_REQUESTS, config.scheduler_config.max_num_seqs),
        ray_actor_options={"num_cpus": options.replica_num_cpus, "num_gpus": num_gpus},
        graceful_shutdown_timeout_s=settings.shutdown_timeout,
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
        health_check_period_s=5,
        **scaling,
    ).bind(settings, tokenizer, registry, static)

    ingress = serve.deployment(
        serve.ingress(ReplicaApp())(Ingress), name="Ingress",
        max_ongoing_requests=WAITING_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=settings.shutdown_timeout,
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
    )
    pinned = [lora.lora_name for lora, is_pinned in static if is_pinned]
    return ingress.bind(settings, replicas, registry, pinned,
                        envs.ALLOW_RUNTIME_LORA_UPDATING.flag())


def app_builder(args: dict[str, Any]) -> serve.Application:
    """For `serve run` and Ray Serve config files: `argv` holds the `serve-ray`
    arguments (a list, or one string split as a shell would). The host and port
    come from Ray Serve's own http_options there."""
    from loraserve.cli_args import build_parser, build_server_settings, ray_options, validate_args

    argv = args.get("argv", [])
    argv = shlex.split(argv) if isinstance(argv, str) else [str(a) for a in argv]
    parsed = build_parser().parse_args(["serve-ray", *argv])
    validate_args(parsed)
    settings, tokenizer = build_server_settings(parsed)
    return build_application(settings, tokenizer, ray_options(parsed))


def run_application(settings: ServerSettings, tokenizer: Any, options: RayOptions) -> int:
    """Start (or join) a Ray cluster, run the application until SIGINT or SIGTERM,
    then take it down."""
    import ray

    # A cluster we join keeps running (and serving other applications) after us;
    # without one, a new cluster of our own ("local": never another one found here).
    address = options.ray_address or os.environ.get("RAY_ADDRESS")
    ray.init(address=address or "local", include_dashboard=False)
    # After ray.init, which installs handlers of its own that abort the process.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.host or "0.0.0.0", "port": settings.port})
        serve.run(build_application(settings, tokenizer, options), name=APP_NAME,
                  route_prefix="/")
        logger.info("serving %s on http://%s:%d with %d engine replicas",
                    ", ".join(settings.served_model_names), settings.host or "0.0.0.0",
                    settings.port, options.num_replicas)
        stop.wait()
    finally:
        if address is None:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
        ray.shutdown()
    return 0
