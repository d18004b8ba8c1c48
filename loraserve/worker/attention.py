"""Attention over the paged KV cache.

The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads,
head_dim]. A sequence's tokens live in the blocks its block table lists, in
order. This backend is plain torch: correct, not fast (the CPU, and the
reference). On a GPU the model runner picks the Triton one
(``loraserve.worker.triton_attention``), behind the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    # Where each new token's K and V go: block_id * block_size + offset (-1: skip).
    slot_mapping: torch.Tensor  # [T] int64
    # Per sequence: start of its query tokens in the flat batch (len B + 1).
    query_start_loc: list[int]
    # Per sequence: tokens in the cache after this step (context + new).
    seq_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    # The same on the device, for kernels (int32; block_tables padded [B, max_blocks]).
    query_start_loc_t: torch.Tensor | None = None
    seq_lens_t: torch.Tensor | None = None
    block_tables_t: torch.Tensor | None = None
    # Host bound on any sequence's query length (1 for decode).
    max_query_len: int | None = None


def block_table_tensor(block_tables: list[list[int]], pin_memory: bool = False) -> torch.Tensor:
    """Block tables as one int32 [B, longest] host tensor, rows padded with block 0
    (kernels read only the blocks below each sequence's length)."""
    width = max(len(b) for b in block_tables)
    rows = [b + [0] * (width - len(b)) for b in block_tables]
    return torch.tensor(rows, dtype=torch.int32, pin_memory=pin_memory)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Each layer's cache: block 0, zeros that no sequence gets and nothing writes,
    then the ``num_blocks`` blocks that the block allocator hands out (ids 1 to
    ``num_blocks``). Key lanes past a sequence's end read block 0, so the GPU
    kernel loads their values unmasked (``loraserve.kernels.paged_attention``)."""
    shape = (2, 1 + num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


class TorchPagedAttention:
    """Reference backend: writes new K/V into the cache, then attends per sequence."""

    # Reads the host lists of AttentionMetadata, not its device tensors.
    device_metadata = False

    def __init__(self, meta: AttentionMetadata, workspace: torch.Tensor | None = None) -> None:
        self.meta = meta

    @staticmethod
    def make_workspace(
        num_q_heads: int, head_dim: int, device: torch.device
    ) -> torch.Tensor | None:
        """Scratch memory shared by every layer's attention: none needed."""
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        rotary=None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rotary`` (a RotaryEmbedding) rotates q and k at ``positions`` first."""
        if rotary is not None:
            q, k = rotary(positions, q, k)
        meta = self.meta
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
        value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
        key_cache[meta.slot_mapping] = k.to(key_cache.dtype)
        value_cache[meta.slot_mapping] = v.to(value_cache.dtype)

        out = torch.empty_like(q)
        group = q.shape[1] // num_kv_heads
        for i, seq_len in enumerate(meta.seq_lens):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            num_q = end - start
            blocks = torch.tensor(meta.block_tables[i], dtype=torch.long, device=q.device)
            keys = kv_cache[0][blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            values = kv_cache[1][blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
            qs = q[start:end].transpose(0, 1)  # [H, q, D]
            ks = keys.transpose(0, 1).repeat_interleave(group, dim=0)
            vs = values.transpose(0, 1).repeat_interleave(group, dim=0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            out[start:end] = o.transpose(0, 1)
        return out
