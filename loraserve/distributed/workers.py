"""The worker processes of a tensor-parallel engine.

The engine-core process is rank 0: it schedules, runs its shard of the model and
samples. It spawns ranks 1 .. N-1 here; each builds the same model runner on its
own device (cuda:rank, or the CPU), then runs every step that rank 0 sends it:
the step's inputs and the adapter slots written since the last step arrive as one
small pickled message (``ModelRunner.share_step``), the step's tensors go through
the device collectives inside the forward pass.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import torch.multiprocessing as mp

from loraserve.config import EngineConfig
from loraserve.distributed.parallel_state import (
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
)

logger = logging.getLogger(__name__)

# How long shutdown waits for a worker to leave before it is killed.
_JOIN_TIMEOUT_S = 30.0


def rank_device(config: EngineConfig, rank: int):
    import torch

    if config.device.type == "cuda":
        return torch.device("cuda", rank)
    return config.device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class WorkerGroup:
    """Rank 0's view of the group: its own membership and the other processes."""

    tp: TensorParallel
    processes: list

    def shutdown(self) -> None:
        """Tell the workers to stop (they are waiting for a step), then reap them."""
        try:
            self.tp.broadcast_object(None)
        except Exception:  # noqa: BLE001 - a dead worker: kill the rest below
            logger.warning("a tensor-parallel worker did not take the stop message")
        for proc in self.processes:
            proc.join(_JOIN_TIMEOUT_S)
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
    from loraserve.engine.core_proc import _die_with_parent
    from loraserve.engine.torch_threads import configure_torch_threads
    from loraserve.worker.model_runner import ModelRunner

    _die_with_parent()
    configure_torch_threads(share_with_frontend=False)
    world = config.parallel_config.tensor_parallel_size
    tp = init_tensor_parallel(rank, world, init_method, rank_device(config, rank))
    try:
        runner = ModelRunner(config, tp)
        while runner.run_shared_step():
            pass
    finally:
        destroy_tensor_parallel(tp)
