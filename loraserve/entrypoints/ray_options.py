"""The `serve-ray` flags (generated from these fields, see loraserve/options.py):
how many replicas, what each reserves, which cluster. Imports without Ray."""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.options import OptionError, option, positive_int


def _ray(default: object = None, **meta: object) -> object:
    return option(default, group="Ray Serve", **meta)


@dataclass
class RayOptions:
    num_replicas: int = _ray(1, type=positive_int,
                             help="Engine replicas to start with (each runs its own engine core).")
    # Set: Ray Serve's autoscaling runs between num_replicas and this.
    max_replicas: int | None = _ray(
        type=positive_int, help="Let Ray Serve's autoscaling add replicas under load, up to this "
        "many (default: a fixed --num-replicas).")
    target_ongoing_requests: float = _ray(
        16.0, help="Autoscaling target: requests in flight per replica.")
    replica_num_cpus: float = _ray(1.0, help="CPUs Ray reserves for each engine replica.")
    # None: one GPU when the engine runs on CUDA, else none.
    replica_num_gpus: float | None = _ray(
        type=float, help="GPUs Ray reserves for each engine replica (default: 1 with --device "
        "cuda or auto on a GPU machine, else 0).")
    # None: $RAY_ADDRESS, else a local cluster.
    ray_address: str | None = _ray(
        help="The Ray cluster to join, as ray.init takes it (default: $RAY_ADDRESS, else a "
        "local cluster on this machine).")

    def __post_init__(self) -> None:
        if self.max_replicas is not None and self.max_replicas < self.num_replicas:
            raise OptionError("{max_replicas} ({value}) must be at least {num_replicas} "
                              "({limit})", value=self.max_replicas, limit=self.num_replicas)
        if self.target_ongoing_requests <= 0:
            raise OptionError("{target_ongoing_requests} must be above 0")
