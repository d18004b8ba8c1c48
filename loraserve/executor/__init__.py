"""Executors: how the engine core reaches its model runner(s)."""

from __future__ import annotations

from loraserve.config import EngineConfig
from loraserve.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    """In-process for one rank; a tensor-parallel group for more."""
    if config.parallel_config.tensor_parallel_size > 1:
        from loraserve.executor.tensor_parallel import TensorParallelExecutor

        return TensorParallelExecutor(config)
    from loraserve.executor.in_process import InProcessExecutor

    return InProcessExecutor(config)
