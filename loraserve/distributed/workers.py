"""The worker processes of a tensor-parallel engine.

The engine-core process is rank 0: it schedules, runs its shard of the model and
samples. It spawns ranks 1 .. N-1 here; each builds the same model runner on its
own device (cuda:rank, or the CPU), then runs every step that rank 0 sends it:
the step's inputs and the adapter slots written since the last step arrive as one
small pickled message (``ModelRunner.share_step``), the step's tensors go through
the device collectives inside the forward pass.

A worker that dies takes the group with it: rank 0 finds out from a failed
collective or from the process's exit, and either way raises TensorParallelError
with the rank, its pid and how it ended.
"""

from __future__ import annotations

import logging
import signal
import socket
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from loraserve.config import EngineConfig
from loraserve.distributed.parallel_state import (
    TensorParallel,
    TensorParallelError,
    destroy_tensor_parallel,
    init_tensor_parallel,
)

logger = logging.getLogger(__name__)

# How long shutdown waits for a worker to leave before it is killed.
_JOIN_TIMEOUT_S = 30.0
# A collective fails as soon as a peer's sockets close, a moment before the dead
# process can be reaped: wait this long for it to name the rank.
_REAP_WAIT_S = 1.0


def rank_device(config: EngineConfig, rank: int):
    import torch

    if config.device.type == "cuda":
        return torch.device("cuda", rank)
    return config.device


def _exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class WorkerGroup:
    """Rank 0's view of the group: its own membership and the other processes."""

    tp: TensorParallel
    processes: list
    # Set once shutdown starts: from then on a worker's exit is expected.
    stopping: bool = False

    @property
    def sentinels(self) -> list[int]:
        """One handle per worker that becomes ready when it exits."""
        return [proc.sentinel for proc in self.processes]

    def dead_rank(self) -> str | None:
        """Which worker is gone and how, or None while all of them run."""
        for rank, proc in enumerate(self.processes, start=1):
            if not proc.is_alive():
                return f"tensor-parallel rank {rank} (pid {proc.pid}) died: " + (
                    _exit_status(proc.exitcode))
        return None

    def check(self, cause: BaseException | None = None) -> None:
        """Raise TensorParallelError if a worker has died, or if `cause` (what a
        step raised) is a failed collective: the group cannot run another step."""
        broken = isinstance(cause, TensorParallelError)
        if broken:
            wait(self.sentinels, _REAP_WAIT_S)
        dead = self.dead_rank()
        if dead is not None:
            raise TensorParallelError(dead) from cause
        if broken:
            raise cause

    def shutdown(self) -> None:
        """Tell the workers to stop (they are waiting for a step), then reap them.
        With a rank dead the group carries no message: the rest are killed."""
        self.stopping = True
        clean = self.dead_rank() is None
        if clean:
            try:
                self.tp.broadcast_object(None)
            except TensorParallelError:
                logger.warning("a tensor-parallel worker did not take the stop message")
                clean = False
        for proc in self.processes:
            proc.join(_JOIN_TIMEOUT_S if clean else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        destroy_tensor_parallel(self.tp)


def start_workers(config: EngineConfig) -> WorkerGroup:
    """Spawn ranks 1 .. N-1 and join the group as rank 0."""
    world = config.parallel_config.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    processes = []
    for rank in range(1, world):
        proc = ctx.Process(target=_worker_main, args=(config, rank, init_method),
                           name=f"loraserve-tp-worker-{rank}", daemon=True)
        proc.start()
        processes.append(proc)
    try:
        tp = init_tensor_parallel(0, world, init_method, rank_device(config, 0))
    except Exception:
        for proc in processes:
            proc.kill()
        raise
    return WorkerGroup(tp, processes)


def _worker_main(config: EngineConfig, rank: int, init_method: str) -> None:
    from loraserve.worker.model_runner import ModelRunner
    from loraserve.worker.process import configure_torch_threads, die_with_parent

    die_with_parent()
    configure_torch_threads(share_with_frontend=False)
    world = config.parallel_config.tensor_parallel_size
    tp = init_tensor_parallel(rank, world, init_method, rank_device(config, rank))
    try:
        runner = ModelRunner(config, tp)
        while runner.run_shared_step():
            pass
    finally:
        destroy_tensor_parallel(tp)
