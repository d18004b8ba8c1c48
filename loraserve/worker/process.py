"""Setting up a process that runs a model runner (the engine core, each
tensor-parallel rank): it dies with its parent, and how many CPU threads torch
may use in it.

Left alone, torch starts one intra-op thread per core of the machine, whatever
share of it the process may run on, and the API server's own threads (HTTP,
tokenizers, detokenizing) then fight the engine's for the same cores: under that
contention a short answer can take tens of seconds. The engine takes the cores
the process may run on, leaves one to the API server, and stays within torch's
own default (its count when nobody set one) and a cap past which more threads
mostly wait on each other. OMP_NUM_THREADS, when set, wins.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)

ENV_NUM_THREADS = "OMP_NUM_THREADS"
_PR_SET_PDEATHSIG = 1
# Intra-op parallelism of a serving step (one decode token per sequence, or a
# prefill chunk) stops paying off well before this many threads.
MAX_AUTO_THREADS = 32


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as taskset or a
    container's cpuset restricts it), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def pick_num_threads(
    cpus: int,
    share_with_frontend: bool,
    torch_default: int,
    env: Mapping[str, str] | None = None,
) -> int:
    """torch's intra-op thread count for an engine that may run on `cpus` CPUs;
    `share_with_frontend` leaves one of them to the API server process, and
    `torch_default` is torch's count before anyone set it."""
    env = os.environ if env is None else env
    override = env.get(ENV_NUM_THREADS, "").strip()
    if override:
        try:
            value = int(override)
        except ValueError:
            value = 0
        if value >= 1:
            return value
        logger.warning("ignoring %s=%r: not a positive integer", ENV_NUM_THREADS, override)
    if share_with_frontend and cpus > 1:
        cpus -= 1
    return max(1, min(cpus, torch_default, MAX_AUTO_THREADS))


def configure_torch_threads(share_with_frontend: bool) -> int:
    """Set torch's thread counts for the engine in this process; returns the
    intra-op count."""
    num = pick_num_threads(available_cpus(), share_with_frontend, torch.get_num_threads())
    torch.set_num_threads(num)
    try:
        # loraserve runs nothing in parallel across ops (no torch.jit.fork); one
        # inter-op thread spares a pool of idle threads per core.
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # only possible before the first parallel op; too late in this process
    logger.info("torch uses %d CPU threads", num)
    return num


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, so no engine or rank
    is orphaned."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass  # not Linux: the engine loop's parent-pid check still catches it
