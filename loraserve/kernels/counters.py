"""Counters that let the last program of a group finish a launch's work in the
same launch (the decode GEMM's split-K sum, the attention's split-KV merge).

``counter_buffer(owner, device, size)`` is a zeroed int32 buffer, one per
(owner, device), made on the first call. A kernel that counts on it puts its
counters back to 0 before it ends, so the buffer is ready for the next launch
or CUDA graph replay. It must be made outside graph capture (the eager warm-up
before a capture does that): made inside, it would belong to the graph's pool.
Launches that share a buffer run one after another, on one stream.
"""

from __future__ import annotations

import torch

_buffers: dict[tuple[str, torch.device], torch.Tensor] = {}


def counter_buffer(owner: str, device: torch.device, size: int) -> torch.Tensor:
    buffer = _buffers.get((owner, device))
    if buffer is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner}: run it once outside graph capture first")
        buffer = torch.zeros(size, dtype=torch.int32, device=device)
        _buffers[(owner, device)] = buffer
    return buffer
