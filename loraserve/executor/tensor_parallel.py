"""N tensor-parallel ranks: rank 0's model runner in the engine core's process,
ranks 1 .. N-1 in processes of their own, each on its own device (cuda:rank, or
the CPU with gloo).

Every step and every worker call goes to all ranks as one small pickled message
(the method's name and arguments) over the group's CPU channel, and each rank
runs that method on its own runner; the step's tensors then meet in the device
collectives inside the forward pass. A step goes to the other ranks without its
sampling rows: only rank 0 samples, and they take its tokens from a broadcast.

Adapters: each rank reads and caches the adapters itself, from the same calls
(rank 0's background reads and theirs start together; a rank that is behind
waits for its own read when the adapter is committed), so no adapter ever
travels between ranks and no step reads the disk.

A call (not a step) reports every rank's outcome back to rank 0: all ranks
failing alike (a bad adapter) is the call's error; ranks that disagree can no
longer run in step, which is the group's failure. A rank that dies takes the
group with it: rank 0 learns it from a failed collective or from the process's
exit, and either way raises TensorParallelError with the rank, its pid and how
it ended.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.multiprocessing as mp

from loraserve.config import EngineConfig
from loraserve.distributed.parallel_state import (
    TensorParallel,
    TensorParallelError,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from loraserve.executor.base import Executor, check_method
from loraserve.log import configure_logging
from loraserve.worker.input_batch import StepInput, StepOutput
from loraserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# How long shutdown waits for a rank to leave before it is killed.
_JOIN_TIMEOUT_S = 30.0
# A collective fails as soon as a peer's sockets close, a moment before the dead
# process can be reaped: wait this long for it to name the rank.
_REAP_WAIT_S = 1.0
_STEP = "execute"


def rank_device(config: EngineConfig, rank: int) -> torch.device:
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
class RankProcesses:
    """Rank 0's view of the group: its membership and the other ranks' processes."""

    tp: TensorParallel
    processes: list
    # Set once shutdown starts: from then on a rank's exit is expected.
    stopping: bool = False

    @property
    def sentinels(self) -> list[int]:
        """One handle per rank process that becomes ready when it exits."""
        return [proc.sentinel for proc in self.processes]

    def dead_rank(self) -> str | None:
        """Which rank is gone and how, or None while all of them run."""
        for rank, proc in enumerate(self.processes, start=1):
            if not proc.is_alive():
                return f"tensor-parallel rank {rank} (pid {proc.pid}) died: " + (
                    _exit_status(proc.exitcode))
        return None

    def check(self, cause: BaseException | None = None) -> None:
        broken = isinstance(cause, TensorParallelError)
        if broken:
            wait(self.sentinels, _REAP_WAIT_S)
        dead = self.dead_rank()
        if dead is not None:
            raise TensorParallelError(dead) from cause
        if broken:
            raise cause

    def watch(self, on_death: Callable[[str], None], grace_s: float) -> None:
        def watch() -> None:
            wait(self.sentinels)
            time.sleep(grace_s)
            if not self.stopping:
                on_death(self.dead_rank() or "a tensor-parallel rank died")

        threading.Thread(target=watch, name="loraserve-tp-watchdog", daemon=True).start()

    def shutdown(self) -> None:
        """Tell the ranks to stop (they are waiting for a message), then reap them.
        With a rank dead the group carries no message: the rest are killed."""
        self.stopping = True
        clean = self.dead_rank() is None
        if clean:
            try:
                self.tp.broadcast_object(None)
            except TensorParallelError:
                logger.warning("a tensor-parallel rank did not take the stop message")
                clean = False
        for proc in self.processes:
            proc.join(_JOIN_TIMEOUT_S if clean else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        destroy_tensor_parallel(self.tp)


class TensorParallelExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        world = config.parallel_config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        processes = []
        for rank in range(1, world):
            proc = ctx.Process(target=_rank_main, args=(config, rank, init_method),
                               name=f"loraserve-tp-rank-{rank}", daemon=True)
            proc.start()
            processes.append(proc)
        try:
            tp = init_tensor_parallel(0, world, init_method, rank_device(config, 0))
        except Exception:
            for proc in processes:
                proc.kill()
            raise
        self.ranks = RankProcesses(tp, processes)
        try:
            self.driver = ModelRunner(config, tp)
        except BaseException:
            self.ranks.shutdown()
            raise

    def execute(self, step: StepInput) -> StepOutput:
        self.ranks.tp.broadcast_object((_STEP, (step.for_other_ranks(),), {}))
        return self.driver.execute(step)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        check_method(method)
        tp = self.ranks.tp
        tp.broadcast_object((method, args, kwargs))
        error: Exception | None = None
        try:
            result = getattr(self.driver, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - compared with the other ranks first
            error = exc
        outcomes = tp.all_gather_object(_outcome(error))
        for rank, outcome in enumerate(outcomes[1:], start=1):
            # Alike when both succeeded or both raised the same kind of error (its
            # text may name the rank's device).
            if (outcome and outcome[0]) != (outcomes[0] and outcomes[0][0]):
                raise TensorParallelError(
                    f"tensor-parallel ranks disagree on {method}: rank 0 "
                    f"{_describe(outcomes[0])}, rank {rank} {_describe(outcome)}")
        if error is not None:
            raise error
        return result

    def check(self, cause: BaseException | None = None) -> None:
        self.ranks.check(cause)

    def watch(self, on_death: Callable[[str], None], grace_s: float) -> None:
        self.ranks.watch(on_death, grace_s)

    def shutdown(self) -> None:
        self.driver.shutdown()
        self.ranks.shutdown()


def _outcome(error: Exception | None) -> tuple[str, str] | None:
    return None if error is None else (type(error).__name__, str(error))


def _describe(outcome: tuple[str, str] | None) -> str:
    return "succeeded" if outcome is None else f"failed ({outcome[0]}: {outcome[1]})"


def _rank_main(config: EngineConfig, rank: int, init_method: str) -> None:
    """Ranks 1 .. N-1: run every message rank 0 sends until it says stop. A step
    that fails here leaves this rank out of step with the others for good: it
    ends the process, and with it the group."""
    from loraserve.worker.process import configure_torch_threads, die_with_parent

    die_with_parent()
    configure_logging()
    configure_torch_threads(share_with_frontend=False)
    world = config.parallel_config.tensor_parallel_size
    tp = init_tensor_parallel(rank, world, init_method, rank_device(config, rank))
    runner = None
    try:
        runner = ModelRunner(config, tp)
        while (message := tp.broadcast_object()) is not None:
            method, args, kwargs = message
            if method == _STEP:
                runner.execute(*args)
                continue
            error = None
            try:
                getattr(runner, method)(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - rank 0 compares it with its own
                error = exc
            tp.all_gather_object(_outcome(error))
    finally:
        if runner is not None:
            runner.shutdown()
        destroy_tensor_parallel(tp)
