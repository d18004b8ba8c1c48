"""Attention over the paged KV cache on CUDA: the Triton kernels of
``loraserve.kernels``, one launch a layer for the whole batch, safe to capture
in a CUDA graph.

The rotary embedding and the KV-cache write ride along: decode batches (one
query token a sequence) rotate q and k and store k and v inside the attention
launch itself; other batches rotate and store in one rotary kernel before it.

Imported only where the model runner picks the Triton backend (it needs triton).
"""

from __future__ import annotations

import torch

from loraserve.kernels.fused_norm_rope import rotary_embedding_
from loraserve.kernels.paged_attention import (
    NewKV,
    make_workspace,
    paged_attention,
    write_kv_cache,
)
from loraserve.model.rope import RotaryEmbedding
from loraserve.worker.attention import AttentionMetadata


class TritonPagedAttention:
    # Reads the device tensors of AttentionMetadata (query_start_loc_t, ...).
    device_metadata = True

    def __init__(self, meta: AttentionMetadata, workspace: torch.Tensor | None) -> None:
        self.meta = meta
        self.workspace = workspace

    @staticmethod
    def make_workspace(num_q_heads: int, head_dim: int, device: torch.device) -> torch.Tensor:
        """The split-KV workspace, one for every layer and step."""
        return make_workspace(num_q_heads, head_dim, device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        rotary: RotaryEmbedding | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rotary`` rotates q and k at ``positions`` first."""
        meta = self.meta
        # q, k and v are strided views of the QKV output; the kernels take strides,
        # so no copies.
        new_kv = None
        if rotary is None:
            write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        elif rotary.rotary_dim != q.shape[-1]:
            # A partial rotary: torch rotates, then the cache write.
            q, k = rotary(positions, q, k)
            write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        elif meta.max_query_len == 1:
            # Decode: the attention launch rotates q and k and writes the cache.
            new_kv = NewKV(k, v, positions, rotary.cos, rotary.sin, meta.slot_mapping)
        else:
            # The rotary kernel rotates q and k in place and stores k and v.
            rotary_embedding_(q, k, positions, rotary.cos, rotary.sin,
                              (v, kv_cache, meta.slot_mapping))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        paged_attention(
            q, kv_cache, out, meta.query_start_loc_t, meta.seq_lens_t,
            meta.block_tables_t, scale, sliding_window, max_query_len=meta.max_query_len,
            workspace=self.workspace, new_kv=new_kv,
        )
        return out
