"""Random paged-attention batches and the torch reference, shared by the CPU and GPU tests."""

from __future__ import annotations

import torch

from loraserve.worker.attention import AttentionMetadata, TorchPagedAttention


def make_batch(
    specs: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    pad_tokens: int = 0,
    pad_seqs: int = 0,
    seed: int = 0,
    device: str = "cpu",
    num_blocks: int | None = None,
    max_blocks: int | None = None,
) -> dict:
    """specs: (cached tokens, new tokens) per sequence; blocks are scattered at random.

    ``pad_tokens`` tokens (slot -1) and ``pad_seqs`` empty sequences follow the
    real ones, as in a batch padded to a CUDA-graph size. Block 0 holds zeros and
    no sequence gets it, as in the engine's cache (paged_attention's contract).
    """
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    seq_lens = [c + n for c, n in specs]
    nblocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = num_blocks or sum(nblocks) + 3
    max_blocks = max_blocks or max(nblocks) + 1
    perm = (torch.randperm(num_blocks - 1, generator=g, device=dev) + 1).tolist()
    tables, pos = [], 0
    for nb in nblocks:
        tables.append(perm[pos : pos + nb])
        pos += nb
    q_lens = [n for _, n in specs]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    real_t = starts[-1]
    slots = []
    for (c, n), table in zip(specs, tables, strict=True):
        for p in range(c, c + n):
            slots.append(table[p // block_size] * block_size + p % block_size)
    t = real_t + pad_tokens
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)

    def rand(*size):
        return torch.randn(*size, generator=g, device=dev).to(dtype)

    bt = torch.zeros(len(specs) + pad_seqs, max_blocks, dtype=torch.int32)
    for i, table in enumerate(tables):
        bt[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_tables=tables,
        block_size=block_size,
    )
    cache = rand(*shape)
    cache[:, 0] = 0
    return {
        "q": rand(t, num_q_heads, head_dim),
        "k": rand(t, num_kv_heads, head_dim),
        "v": rand(t, num_kv_heads, head_dim),
        "cache": cache,
        "slot_mapping": torch.tensor(slots + [-1] * pad_tokens, dtype=torch.long, device=dev),
        "query_start_loc": torch.tensor(
            starts + [real_t] * pad_seqs, dtype=torch.int32, device=dev
        ),
        "seq_lens": torch.tensor(seq_lens + [0] * pad_seqs, dtype=torch.int32, device=dev),
        "block_tables": bt.to(dev),
        "meta": meta,
        "real_t": real_t,
        "max_query_len": max(q_lens),
    }


def reference(
    b: dict, scale: float, window: int | None, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """TorchPagedAttention on the real tokens (in ``dtype`` if given): (out, updated cache)."""
    dtype = dtype or b["q"].dtype
    cache = b["cache"].to(dtype, copy=True)
    rt = b["real_t"]
    q, k, v = (b[n][:rt].to(dtype) for n in ("q", "k", "v"))
    out = TorchPagedAttention(b["meta"]).forward(q, k, v, cache, scale, window)
    return out, cache


def run_kernels(b, scale, window=None, out=None, **kw):
    """The Triton write_kv_cache then paged_attention on batch b; returns (out, cache)."""
    from loraserve.kernels import paged_attention as pa

    cache = b["cache"].clone()
    pa.write_kv_cache(b["k"], b["v"], cache, b["slot_mapping"])
    out = torch.full_like(b["q"], float("nan")) if out is None else out
    pa.paged_attention(b["q"], cache, out, b["query_start_loc"], b["seq_lens"],
                       b["block_tables"], scale, sliding_window=window, **kw)
    return out, cache


def pad_like_a_graph(b: dict) -> dict:
    """b (made with ``pad_tokens``) with each padding token turned into the
    one-token sequence a padded decode graph gives it: seq_len 1, slot -1."""
    pads = b["q"].shape[0] - b["real_t"]
    dev = b["q"].device
    extra = torch.arange(1, pads + 1, dtype=torch.int32, device=dev) + b["real_t"]
    rows = torch.zeros(pads, b["block_tables"].shape[1], dtype=torch.int32, device=dev)
    return dict(
        b,
        query_start_loc=torch.cat([b["query_start_loc"], extra]),
        seq_lens=torch.cat([b["seq_lens"], torch.ones(pads, dtype=torch.int32, device=dev)]),
        block_tables=torch.cat([b["block_tables"], rows]),
    )


def decode_rotary(b: dict):
    """For a decode batch b: a rotary table (rotate-half, all of head_dim) long
    enough for it, and each token's position (its sequence's last; 0 for padding)."""
    from transformers import LlamaConfig

    from loraserve.model.rope import RotaryEmbedding

    head_dim = b["q"].shape[-1]
    config = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim)
    rope = RotaryEmbedding(config, max(b["meta"].seq_lens) + 1).to(b["q"].device)
    positions = torch.zeros(b["q"].shape[0], dtype=torch.long, device=b["q"].device)
    positions[: b["real_t"]] = torch.tensor(b["meta"].seq_lens, device=positions.device) - 1
    return rope, positions


def rotated(b: dict, rope, positions: torch.Tensor) -> dict:
    """b with q and k rotated by the model's torch rotary."""
    q, k = rope(positions, b["q"], b["k"])
    return dict(b, q=q, k=k)


def run_with_new_kv(b, rope, positions, scale, window=None, **kw):
    """paged_attention doing the rotary and the KV write itself (``new_kv``) on
    decode batch b; returns (out, cache)."""
    from loraserve.kernels import paged_attention as pa

    cache = b["cache"].clone()
    out = torch.full_like(b["q"], float("nan"))
    new_kv = pa.NewKV(b["k"], b["v"], positions, rope.cos, rope.sin, b["slot_mapping"])
    pa.paged_attention(b["q"], cache, out, b["query_start_loc"], b["seq_lens"],
                       b["block_tables"], scale, sliding_window=window, max_query_len=1,
                       new_kv=new_kv, **kw)
    return out, cache
