"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A decode step on the 8B shape is ~450 short kernels, one after another. Each
normally starts only when the one before has finished and its memory is
flushed: its launch and ramp-up (a few µs, measured on the weight GEMMs,
benchmarks/RESULTS.md) are paid with the GPU idle. On Hopper and later a kernel
launched with PDL may start while the one before it runs: it first lets its own
successor launch (``gdc_launch_dependents``), may do work that reads nothing
the kernels before it write (the decode GEMM prefetches its weights), and then
waits (``gdc_wait``) until the previous kernel has finished and its writes are
visible. Every write and every read of an activation comes after that wait.

``l2_prefetch(ptrs)`` starts pulling lines into L2 without waiting for them:
the decode GEMM asks for the start of its weight rows before that wait.

``pdl_args(device)`` gives the launch arguments: the kernel's PDL constexpr and
Triton's ``launch_pdl``, always equal (a kernel launched early that does not
wait would race). PDL is on wherever the device and Triton support it: compiled
(not interpreted) kernels on a GPU of compute capability 9.0 or later.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loraserve import envs

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - a Triton without grid dependency control
    gdc_launch_dependents = gdc_wait = None


@functools.lru_cache(maxsize=8)
def _device_supports(device: torch.device) -> bool:
    return (
        gdc_wait is not None
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 9
        and not envs.triton_interpret()
    )


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Launch arguments of a kernel that starts with ``pdl_begin(PDL)`` (or its own
    wait): ``kernel[grid](..., **pdl_args(device))``."""
    on = _device_supports(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (PDL only)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def l2_prefetch(ptrs):
    """Start loading the 128-byte lines at ``ptrs`` into L2; nothing waits for them.
    Compiled CUDA only (the interpreter has no inline assembly)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
        dtype=tl.int32, is_pure=False, pack=1,
    )
