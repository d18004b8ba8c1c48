"""One tensor-parallel group: this process's rank and the collectives the
parallel layers need.

With one rank (the default) every collective is a no-op and torch.distributed
is never initialised, so a single-device engine runs exactly as without
tensor parallelism. With N ranks, tensors go over the device backend (NCCL on
CUDA, gloo on the CPU) and each step's inputs over a gloo group on the CPU.

A collective that fails (a rank died, or stopped answering for the timeout)
leaves the ranks out of step for good: it raises TensorParallelError, which the
engine treats as its own death, never as one request's failure.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

# A rank that waits longer than this for the others inside a step (or while the
# ranks load their weights) has lost them.
_TIMEOUT = datetime.timedelta(minutes=30)
# Ranks 1 .. N-1 wait for rank 0's next step message for as long as the server is
# idle: that wait must not time out. A dead rank 0 ends them anyway (its sockets
# close, and they die with their parent).
_IDLE_TIMEOUT = datetime.timedelta(days=365)

_F = TypeVar("_F", bound=Callable[..., Any])


class TensorParallelError(RuntimeError):
    """The group is broken: a rank died, or a collective failed or timed out. No
    step can run on it any more."""


def _collective(method: _F) -> _F:
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except RuntimeError as exc:  # gloo's and NCCL's errors, timeouts included
            raise TensorParallelError(f"a tensor-parallel collective failed: {exc}") from exc

    return run  # type: ignore[return-value]


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    # The group for tensors on the model's device, and one (gloo, with the idle
    # timeout) for Python objects: the step messages and start-up sizes.
    group: Any = None
    cpu_group: Any = None

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, samples and answers; the others run their shard."""
        return self.rank == 0

    def shard(self, size: int) -> tuple[int, int]:
        """(start, length) of this rank's equal share of ``size``."""
        part = size // self.world_size
        return self.rank * part, part

    @_collective
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    @_collective
    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world_size, *t.shape]: every rank's t, in rank order."""
        if self.world_size == 1:
            return t.unsqueeze(0)
        out = torch.empty((self.world_size * t.shape[0], *t.shape[1:]), dtype=t.dtype,
                          device=t.device)
        dist.all_gather_into_tensor(out, t.contiguous(), group=self.group)
        return out.view(self.world_size, *t.shape)

    @_collective
    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's t on every rank, in place."""
        if self.world_size > 1:
            dist.broadcast(t, src=0, group=self.group)
        return t

    @_collective
    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's (picklable) obj on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    @_collective
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's (picklable) obj, in rank order."""
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.cpu_group)
        return gathered

    @_collective
    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (sizes every rank must agree on)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


SINGLE = TensorParallel()


def init_tensor_parallel(rank: int, world_size: int, init_method: str,
                         device: torch.device) -> TensorParallel:
    """Join the group of ``world_size`` processes (every rank calls this)."""
    if world_size == 1:
        return SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=_TIMEOUT)
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    tp = TensorParallel(rank, world_size, group, cpu_group)
    # The first collective sets up the communicator: do it now, not inside a
    # CUDA graph capture.
    tp.all_reduce(torch.zeros(1, device=device))
    return tp


def destroy_tensor_parallel(tp: TensorParallel) -> None:
    if tp.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
