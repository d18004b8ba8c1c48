"""Wall-clock timing of device work, which runs asynchronously to the host."""

from __future__ import annotations

import time

import torch

from loraserve import LLM


def sync() -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(llm: LLM, prompts, params, loras) -> float:
    """Seconds of one ``generate``, from an idle device to an idle device."""
    sync()
    start = time.perf_counter()
    llm.generate(prompts, params, loras, use_tqdm=False)
    sync()
    return time.perf_counter() - start
