"""CUDA graphs for decode steps, one per padded batch size and LoRA case.

A decode step (one new token per sequence) of B sequences replays the graph of
the smallest captured size >= B. Inputs are copied into static buffers; padded
rows get slot -1 everywhere (no KV write, no adapter) and a one-token sequence,
so they compute harmless garbage that nobody reads.

Every copy or small kernel around the graph costs the device a gap: a dozen of
them (input copies, padding fills, the pending-token fill, the argmax) leave a
batch-32 step's device 4% idle (benchmarks/RESULTS.md). So the step's per-token inputs
travel in one host-to-device copy of one [5, max_bs] buffer (token ids, where
each token comes from, positions, slots, and the sequence lengths as int32),
padding rows filled on the host; the block tables only when they changed; the
graph itself takes the tokens the last step sampled (async scheduling) from the
`sampled` row beside them, and ends with the greedy argmax, written there.

LoRA cases. vLLM captures every size once per case, [0, max_loras + 1] by
default, which doubles start-up. Our LoRA kernels launch grids that depend on the
slot count only, not on how many adapters a batch uses, and they skip tokens of
slot -1 at no cost worth a second graph. So by default a LoRA engine captures a
single set, the LoRA one, and runs base-only batches through it too. With
`specialize_active_lora` it also captures a no-LoRA set, which saves the (small)
LoRA launches in steps that use no adapter.
"""

from __future__ import annotations

import logging
import time

import torch

from loraserve.worker.attention import AttentionMetadata, block_table_tensor
from loraserve.worker.forward_context import ForwardContext
from loraserve.worker.input_batch import PreparedInputs

logger = logging.getLogger(__name__)

# Rows of the host-written part of DecodeGraphs.step_inputs (rows 1-5 there; row 0
# is `sampled`).
_IDS, _SOURCE, _POSITIONS, _SLOTS, _SEQ_LENS = range(5)
_ROWS = 5


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, ctx: ForwardContext, max_batch: int, specialize_active_lora: bool) -> None:
        """Graphs for decode batches of up to `max_batch` sequences."""
        self.ctx = ctx
        self.sizes = capture_sizes(max_batch)
        max_bs = self.sizes[-1]
        dev = ctx.device
        lora = ctx.lora
        specialize = specialize_active_lora
        self.cases = [True] if lora and not specialize else ([False, True] if lora else [False])
        # Row 0: the last step's sampled ids (device-written). Rows 1-5 come from the
        # host in one copy: token ids, each token's source (an index into rows 0-1
        # flattened: a pending token's row in `sampled`, else its own id), positions,
        # slots, and the sequence lengths as int32 in the first half of row 5.
        self.step_inputs = torch.zeros(1 + _ROWS, max_bs, dtype=torch.long, device=dev)
        self.sampled = self.step_inputs[0]
        self._from_host = self.step_inputs[1:]
        self._from_host[_SLOTS].fill_(-1)
        self._from_host[_SOURCE] = torch.arange(max_bs, 2 * max_bs, device=dev)
        self._from_host[_SEQ_LENS].view(torch.int32)[:max_bs].fill_(1)
        self.token_source = self._from_host[_SOURCE]
        self.positions = self._from_host[_POSITIONS]
        self.slot_mapping = self._from_host[_SLOTS]
        self.seq_lens = self._from_host[_SEQ_LENS].view(torch.int32)[:max_bs]
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_bs, ctx.max_blocks_per_seq, dtype=torch.int32,
                                        device=dev)
        # The rows last copied into block_tables (the requests' lists grow in place).
        self._tables_on_device: list[list[int]] | None = None
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def padded_size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def _forward(self, bs: int, with_lora: bool) -> torch.Tensor:
        ctx = self.ctx
        ctx.punica.use_device_mapping(bs, with_lora)
        if ctx.logits_punica is not None:
            # Every token of a decode step samples: the lm_head's rows are the tokens.
            ctx.logits_punica.use_device_mapping(bs, with_lora, like=ctx.punica)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=[], seq_lens=[],
            block_tables=[], block_size=ctx.block_size,
            query_start_loc_t=self.query_start_loc[: bs + 1], seq_lens_t=self.seq_lens[:bs],
            block_tables_t=self.block_tables[:bs], max_query_len=1,
        )
        # Each token's id: its own (row 1), or the one the last step sampled (row 0).
        input_ids = self.step_inputs[:2].view(-1)[self.token_source[:bs]]
        hidden = ctx.model(input_ids, self.positions[:bs], ctx.kv_caches,
                           ctx.attention(meta, ctx.attn_workspace))
        logits = ctx.model.compute_logits(hidden)
        ctx.argmax(logits, out=self.sampled[:bs])
        return logits

    @torch.no_grad()
    def capture(self) -> None:
        ctx = self.ctx
        dev = ctx.device
        torch.cuda.synchronize(dev)
        # torch.cuda.graph empties the allocator cache on entry; do it first so the
        # growth of reserved memory is what the graph pools take.
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(dev)
        start = time.perf_counter()
        ctx.punica.token_slots.fill_(-1)
        if ctx.logits_punica is not None:
            ctx.logits_punica.token_slots.fill_(-1)
        warmed_lora: set[tuple] = set()
        for bs in reversed(self.sizes):
            lora_kernels = ctx.lora_launch_configs(bs)
            for case in self.cases:
                # Warm-up: compiles kernels and sizes workspaces. The LoRA ops need it
                # only where they meet new launch configs: from the largest size down,
                # a smaller batch on the same configs needs no more workspace.
                self._forward(bs, case and lora_kernels not in warmed_lora)
                if case:
                    warmed_lora.add(lora_kernels)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    logits = self._forward(bs, case)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[(bs, case)] = (graph, logits)
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - start
        # Graph pools live in the caching allocator: its growth is the graphs' cost.
        self.capture_bytes = torch.cuda.memory_reserved(dev) - reserved_before
        logger.info(
            "captured %d CUDA graphs (%d sizes x %d LoRA cases) in %.1f s using %.2f GiB",
            len(self.graphs), len(self.sizes), len(self.cases), self.capture_seconds,
            self.capture_bytes / 2**30,
        )

    def run(self, inputs: PreparedInputs) -> torch.Tensor:
        n = len(inputs.input_ids)
        bs = self.padded_size(n)
        if len(self.cases) == 2:
            case = any(s >= 0 for s in inputs.token_lora_slots)
        else:
            case = self.cases[0]
        ctx = self.ctx
        self._from_host.copy_(self._host_inputs(inputs), non_blocking=True)
        # A sequence gains a block every block_size steps: most steps keep the tables.
        if inputs.block_tables != self._tables_on_device:
            table = block_table_tensor(inputs.block_tables, ctx.pin_memory)
            self.block_tables[:n, : table.shape[1]].copy_(table, non_blocking=True)
            self._tables_on_device = [list(row) for row in inputs.block_tables]
        if case:
            slots = ctx.punica.token_slots
            slots[:n].copy_(ctx.host_tensor(inputs.token_lora_slots, slots.dtype),
                            non_blocking=True)
            slots[n:bs].fill_(-1)
        if inputs.pending_dst:
            # Only rank 0 sampled them (tensor parallelism; a no-op on one rank).
            ctx.tp.broadcast(self.sampled)
        graph, logits = self.graphs[(bs, case)]
        graph.replay()
        return logits[:n]

    def _host_inputs(self, inputs: PreparedInputs) -> torch.Tensor:
        """`_from_host` (rows 1-5 of `step_inputs`) for this step, in pinned memory;
        padding rows get token 0, slot -1 and length 1."""
        max_bs = self.sizes[-1]
        n = len(inputs.input_ids)
        pad = max_bs - n
        source = list(range(max_bs, 2 * max_bs))
        for dst, src in zip(inputs.pending_dst, inputs.pending_src, strict=True):
            source[dst] = src
        host = torch.empty(_ROWS, max_bs, dtype=torch.long, pin_memory=self.ctx.pin_memory)
        host[_IDS:_SEQ_LENS] = torch.tensor([
            inputs.input_ids + [0] * pad, source, inputs.positions + [0] * pad,
            inputs.slot_mapping + [-1] * pad,
        ])
        seq_lens = host[_SEQ_LENS].view(torch.int32)
        seq_lens[:max_bs] = torch.tensor(inputs.seq_lens + [1] * pad, dtype=torch.int32)
        seq_lens[max_bs:] = 0
        return host
