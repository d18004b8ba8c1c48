"""Piecewise CUDA graphs for the steps the decode graphs do not take: a prefill
chunk, or a prefill chunk beside decodes, as continuous serving mostly runs.

Such a step has ragged query lengths, so its attention cannot be one captured
launch for every batch of a size. Everything else in a layer (norms, the
projections and their LoRA updates, the MLP) depends on the token count only.
So each layer is cut around its attention: for every token-count bucket T,
piece 0 is the embedding and layer 0 up to its QKV projection, piece i runs the
rest of layer i-1 and layer i up to its QKV projection, and the last piece the
rest of the last layer and the final norm. A step of n tokens pads to the
smallest bucket T >= n, replays the pieces of T and runs each layer's attention
eagerly between them, on its n real tokens and their exact metadata.

Eager, a mixed step of an 8B model launches some 20 kernels a layer (40 with
LoRA: shrink and expand beside each projection, the side-stream joins), and the
host's launch time bounds the step. Replayed, a layer costs one graph launch
plus its attention.

The pieces hand each other their tensors through static buffers: the QKV
output, the attention output and the residual stream ([max T, width] each,
allocated once); so every piece's own temporaries are free again when it ends
and all pieces of all buckets share one memory pool with the decode graphs.
Padded rows (n..T) carry stale but finite values, no adapter (slot -1) and no
KV write, and nobody reads them.

On a CPU (tests) the same pieces run as plain calls in the same order
(``capture=False``), so the cut, the buffers and the padding are checked
against the reference there too.
"""

from __future__ import annotations

import logging
import time

import torch

from loraserve.worker.forward_context import ForwardContext, PendingTokens
from loraserve.worker.input_batch import PreparedInputs

logger = logging.getLogger(__name__)

# Steps above this many tokens run eagerly: there the device's time, not the
# host's, bounds the step, and a bucket's graphs would cost memory for nothing.
MAX_TOKENS = 2048


def token_buckets(max_tokens: int) -> list[int]:
    """Bucket sizes up to max_tokens: steps of 16 to 128, then of an eighth of
    each power of two, so that padding costs at most 1/8 beyond 128 tokens."""
    sizes = list(range(16, 129, 16))
    size = 128
    while size < max_tokens:
        step = max(16, size // 8)
        size += step
        sizes.append(size)
    sizes = [s for s in sizes if s < max_tokens]
    return sorted(set(sizes + [max_tokens]))


class PiecewiseGraphs:
    def __init__(self, ctx: ForwardContext, max_num_tokens: int, capture: bool = True) -> None:
        """Pieces for steps of up to `max_num_tokens` tokens (or MAX_TOKENS)."""
        self.ctx = ctx
        self.capture_graphs = capture
        self.model = ctx.model.model
        self.sizes = token_buckets(min(MAX_TOKENS, max_num_tokens))
        max_t = self.sizes[-1]
        attn = self.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.q_size, self.kv_size = attn.head_dim, attn.q_size, attn.kv_size
        hidden = ctx.model.config.hidden_size
        dev, dtype = ctx.device, ctx.dtype
        # Rows 0-1: token ids and positions, from the host in one copy.
        self.step_inputs = torch.zeros(2, max_t, dtype=torch.long, device=dev)
        self.input_ids, self.positions = self.step_inputs[0], self.step_inputs[1]
        self.qkv = torch.zeros(max_t, self.q_size + 2 * self.kv_size, dtype=dtype, device=dev)
        self.attn_out = torch.zeros(max_t, self.q_size, dtype=dtype, device=dev)
        self.residual = torch.zeros(max_t, hidden, dtype=dtype, device=dev)
        self.hidden_out = torch.zeros(max_t, hidden, dtype=dtype, device=dev)
        self.lora = ctx.lora
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def padded_size(self, num_tokens: int) -> int:
        return next(s for s in self.sizes if s >= num_tokens)

    @property
    def num_pieces(self) -> int:
        return len(self.model.layers) + 1

    # ---- the pieces ----------------------------------------------------------------

    def _qkv_views(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv[:rows].split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(rows, self.num_heads, self.head_dim),
                k.view(rows, self.num_kv_heads, self.head_dim),
                v.view(rows, self.num_kv_heads, self.head_dim))

    def _piece(self, index: int, size: int) -> None:
        """Piece `index` at `size` tokens, from and into the static buffers."""
        layers = self.model.layers
        if index == 0:
            if self.lora and self.capture_graphs:
                # Regroup the tokens by adapter from the slots staged on the device.
                self.ctx.punica.use_device_mapping(size, True)
            hidden, residual = self.model.embed_tokens(self.input_ids[:size]), None
        else:
            hidden, residual = layers[index - 1].after_attention(self.attn_out[:size],
                                                                 self.residual[:size])
        if index == len(layers):
            self.hidden_out[:size].copy_(self.model.norm(hidden, residual)[0])
            return
        q, k, v, residual = layers[index].before_attention(hidden, residual)
        _store(self.residual[:size], residual)
        for buffer, value in zip(self._qkv_views(size), (q, k, v), strict=True):
            _store(buffer, value)

    def _attend(self, index: int, num_tokens: int, attn) -> None:
        layer = self.model.layers[index]
        out = layer.self_attn.attend(self.positions[:num_tokens], *self._qkv_views(num_tokens),
                                     self.ctx.kv_caches[index], attn)
        self.attn_out[:num_tokens].copy_(out)

    # ---- capture and run -------------------------------------------------------------

    @torch.no_grad()
    def capture(self, pool=None) -> None:
        """Capture every bucket's pieces, largest first (`pool`: share the decode
        graphs' memory pool)."""
        dev = self.ctx.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(dev)
        start = time.perf_counter()
        self.pool = pool
        if self.lora:
            self.ctx.punica.token_slots.fill_(-1)
        for size in reversed(self.sizes):
            # Warm-up: compiles each piece's kernels at this size and sizes workspaces.
            for index in range(self.num_pieces):
                self._piece(index, size)
            graphs = []
            for index in range(self.num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._piece(index, size)
                if self.pool is None:
                    self.pool = graph.pool()
                graphs.append(graph)
            self.graphs[size] = graphs
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - start
        # What the pieces add to the caching allocator (the pool is shared).
        self.capture_bytes = torch.cuda.memory_reserved(dev) - reserved_before
        logger.info("captured %d piecewise CUDA graphs (%d token buckets up to %d x %d pieces) "
                    "in %.1f s using %.2f GiB", len(self.graphs) * self.num_pieces,
                    len(self.sizes), self.sizes[-1], self.num_pieces, self.capture_seconds,
                    self.capture_bytes / 2**30)

    def run(self, inputs: PreparedInputs, pending: PendingTokens) -> torch.Tensor:
        """The final hidden states [n, hidden] of the step's n tokens."""
        ctx = self.ctx
        n = len(inputs.input_ids)
        size = self.padded_size(n)
        pad = size - n
        host = ctx.host_tensor([inputs.input_ids + [0] * pad, inputs.positions + [0] * pad])
        self.step_inputs[:, :size].copy_(host, non_blocking=True)
        pending.fill(self.input_ids[:n], ctx)
        slots = inputs.token_lora_slots + [-1] * pad
        if self.lora and self.capture_graphs:
            device_slots = ctx.punica.token_slots
            device_slots[:size].copy_(ctx.host_tensor(slots, device_slots.dtype),
                                      non_blocking=True)
        elif self.lora:
            ctx.punica.update_mapping(slots)
        attn = ctx.attention_for(inputs)
        graphs = self.graphs.get(size) if self.capture_graphs else None
        for index in range(self.num_pieces):
            if graphs is None:
                self._piece(index, size)
            else:
                graphs[index].replay()
            if index < len(self.model.layers):
                self._attend(index, n, attn)
        return self.hidden_out[:n]


def _store(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """Copy value into buffer, unless an in-place op already put it there."""
    if value.data_ptr() != buffer.data_ptr():
        buffer.copy_(value)
