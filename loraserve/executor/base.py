"""The executor: what the engine core runs its steps and worker calls through.

The engine asks for two things only: `execute(step)` runs one step, and
`call(method, *args)` runs one of the worker's methods (its adapter
operations). Each becomes the same ModelRunner method on every rank of the
tensor-parallel group, in the same order, so every rank holds the same adapters
in the same slots; the answer is rank 0's. The engine never touches a runner.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from loraserve.structured_output.bitmask import TokenMask
from loraserve.worker.input_batch import StepInput, StepOutput
from loraserve.worker.model_runner import ModelRunner


class Executor(ABC):
    # Rank 0's runner, in this process. The engine reaches it only through
    # execute and call; tests and benchmarks may look inside.
    driver: ModelRunner

    @property
    def num_kv_blocks(self) -> int:
        """KV cache blocks per rank (every rank holds the same count)."""
        return self.driver.num_kv_blocks

    @abstractmethod
    def execute(self, step: StepInput) -> StepOutput:
        """Queue one step on every rank; rank 0's sampled tokens come back."""

    @abstractmethod
    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a public ModelRunner method on every rank; rank 0's answer."""

    def sample_deferred(self, masks: list[TokenMask | None]) -> None:
        """Sample the last step's deferred rows with these masks: rank 0 alone
        samples, so no other rank takes part."""
        self.driver.sample_deferred(masks)

    def check(self, cause: BaseException | None = None) -> None:
        """Raise TensorParallelError if a rank died, or if `cause` (what a step
        raised) is a broken collective: that is the engine's failure, never one
        request's. One rank has nothing to check."""
        return None

    def watch(self, on_death: Callable[[str], None], grace_s: float) -> None:
        """Call on_death(reason) from a thread if a rank dies and the group is not
        stopped within grace_s: rank 0 may then be stuck in a collective. One rank
        has nothing to watch."""
        return None

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank."""


def check_method(method: str) -> None:
    if method.startswith("_") or not callable(getattr(ModelRunner, method, None)):
        raise ValueError(f"{method!r} is not a worker method")
