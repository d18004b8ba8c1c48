"""Which implementation runs each device-specific part of a step, chosen once.

A model runner calls ``select_backend(device)`` once and builds everything from
the answer: the model's layers compute through ``ops``, the LoRA layers through
a ``punica_wrapper``, attention through ``attention``, and decode steps replay
``decode_graphs`` where there are any. On a CUDA device with Triton installed
that is the Triton kernels of ``loraserve.kernels``; anywhere else plain torch.
The Triton side is imported here and nowhere else, so an install without
Triton (a CPU machine) imports loraserve without it.

Tests that run the Triton kernels on a CPU (``TRITON_INTERPRET=1``) call the
kernels directly; an engine on a CPU always takes the torch backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from loraserve.lora.punica import PunicaWrapper, TorchPunicaWrapper
from loraserve.model.ops import TORCH_OPS, TorchOps
from loraserve.worker.attention import TorchPagedAttention

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    name: str
    # The decoder's norms, linear layers and activation.
    ops: TorchOps
    # The LoRA op, one object a model: cls(max_num_tokens, num_slots, device).
    punica_wrapper: type[PunicaWrapper]
    # Per step: cls(attention_metadata, workspace); cls.make_workspace(...) once.
    attention: type[Any]
    # CUDA graphs of decode steps, cls(runner); None where steps run eagerly only.
    decode_graphs: type[Any] | None


TORCH_BACKEND = Backend("torch", TORCH_OPS, TorchPunicaWrapper, TorchPagedAttention, None)


def select_backend(device: torch.device) -> Backend:
    """The Triton backend on a CUDA device where Triton is installed, else torch."""
    if device.type != "cuda":
        return TORCH_BACKEND
    try:
        import triton  # noqa: F401
    except ImportError:
        logger.warning("Triton is not installed: attention and LoRA run in plain torch "
                       "on %s, without CUDA graphs (pip install 'loraserve[triton]')", device)
        return TORCH_BACKEND
    from loraserve.lora.punica_triton import TritonPunicaWrapper
    from loraserve.model.triton_ops import TritonOps
    from loraserve.worker.cuda_graphs import DecodeGraphs
    from loraserve.worker.triton_attention import TritonPagedAttention

    return Backend("triton", TritonOps(), TritonPunicaWrapper, TritonPagedAttention, DecodeGraphs)
