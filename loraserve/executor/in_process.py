"""One rank: the model runner lives in the engine core's own process."""

from __future__ import annotations

from typing import Any

from loraserve.config import EngineConfig
from loraserve.executor.base import Executor, check_method
from loraserve.worker.input_batch import StepInput, StepOutput
from loraserve.worker.model_runner import ModelRunner


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.driver = ModelRunner(config)

    def execute(self, step: StepInput) -> StepOutput:
        return self.driver.execute(step)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        check_method(method)
        return getattr(self.driver, method)(*args, **kwargs)

    def shutdown(self) -> None:
        self.driver.shutdown()
