"""Loads the model (and its LoRA wrappers), owns the KV cache tensors, and runs
one step: inputs -> forward -> logits -> sampled tokens.

Which kernels run is chosen once, from the device (``backend.select_backend``):
on a GPU the model, the LoRA op and attention run Triton kernels, decode
steps replay CUDA graphs (see cuda_graphs.py) and, with
``cudagraph_mode=FULL_AND_PIECEWISE``, the other steps replay piecewise graphs
(piecewise_graphs.py); on a CPU everything is plain torch. On a GPU the KV
cache is sized from gpu_memory_utilization after a profiling pass.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from loraserve.config import EngineConfig
from loraserve.distributed.parallel_state import SINGLE, TensorParallel
from loraserve.lora.manager import LoRAManager
from loraserve.model.registry import build_model
from loraserve.model.rope import head_dim_of
from loraserve.model.weight_loader import init_dummy_weights, load_weights
from loraserve.worker.attention import (
    AttentionMetadata,
    allocate_kv_cache,
    block_table_tensor,
    kv_block_bytes,
)
from loraserve.worker.backend import select_backend
from loraserve.worker.input_batch import PENDING_TOKEN, StepInput
from loraserve.worker.piecewise_graphs import PiecewiseGraphs
from loraserve.worker.sampler import (
    PromptLogprobsBatch,
    SampledBatch,
    Sampler,
    prompt_logprobs,
)

logger = logging.getLogger(__name__)

# CPU has no memory profile to size against: cap the KV cache at this much.
_CPU_KV_CACHE_BYTES = 2 << 30


@dataclass
class PreparedInputs:
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    token_lora_slots: list[int]
    sample_indices: list[int]
    is_decode: bool  # one token per sequence, every sequence samples
    # Pending tokens (async scheduling): where each goes in input_ids, and its
    # row in the previous step's sampled ids, which are still on the device.
    pending_dst: list[int] = field(default_factory=list)
    pending_src: list[int] = field(default_factory=list)
    # Prompt logprobs: the rows of the hidden states whose logits are read, the
    # prompt token each predicts, and per asking sequence its row count and top-k.
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_counts: list[int] = field(default_factory=list)
    prompt_num_top: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TensorParallel = SINGLE) -> None:
        self.config = config
        # Under tensor parallelism: this rank's place; rank 0 drives every step.
        self.tp = tp
        mc = config.model_config
        self.device = config.device
        if tp.world_size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", tp.rank)
        self.dtype = mc.dtype
        torch.manual_seed(mc.seed)
        self.backend = select_backend(self.device)
        start = time.perf_counter()
        model = build_model(mc.hf_config, self.dtype, self.device, mc.max_model_len,
                            self.backend.ops, tp)
        if mc.load_format == "dummy":
            init_dummy_weights(model, mc.seed)
        else:
            load_weights(model, mc.model)
        self.model = model.eval()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info("model %s loaded in %.1f s: %.2f GiB of %s weights on %s (%s kernels)",
                    mc.served_model_name or mc.model, time.perf_counter() - start,
                    weight_bytes / 2**30, str(self.dtype).removeprefix("torch."), self.device,
                    self.backend.name)

        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        num_slots = config.lora_config.max_loras if config.lora_config else 1
        self.punica = self.backend.punica_wrapper(self.max_num_tokens, num_slots, self.device)
        # The LoRA facade the engine drives: adapter caches, device slots, loads.
        self.loras: LoRAManager | None = None
        # The lm_head's LoRA maps the rows whose logits are computed, not the tokens.
        self.logits_punica = None
        if config.lora_config is not None:
            if "lm_head" in self.model.lora_modules:
                self.logits_punica = self.backend.punica_wrapper(
                    self.max_num_tokens, num_slots, self.device)
            self.loras = LoRAManager(self.model, config.lora_config, self.punica,
                                     logits_punica=self.logits_punica)
            if tp.world_size > 1 and tp.is_driver:
                # The slots rank 0 writes, for the other ranks to write the same.
                self.loras.slots.slot_log = []

        hf = mc.hf_config
        self.num_layers = hf.num_hidden_layers
        # This rank's heads (all of them without tensor parallelism).
        num_heads = getattr(model, "num_heads", hf.num_attention_heads)
        self.num_kv_heads = getattr(model, "num_kv_heads", None) or getattr(
            hf, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(hf)
        self.block_size = config.cache_config.block_size
        self.max_blocks_per_seq = -(-mc.max_model_len // self.block_size)
        self.attn_workspace = self.backend.attention.make_workspace(
            num_heads, self.head_dim, self.device)
        self.sampler = Sampler(self.device, mc.seed, argmax=self.backend.ops.argmax)
        self.pin_memory = self.device.type == "cuda"  # see host_tensor
        # The last step's sampled ids on the device, and each request's row there.
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}

        # A scratch KV cache of one block serves the profiling pass.
        self.kv_caches = allocate_kv_cache(
            self.num_layers, 1, self.block_size, self.num_kv_heads, self.head_dim,
            self.dtype, self.device,
        )
        peak = self._profile() if self.device.type == "cuda" else 0
        # Every rank's cache holds the same blocks: the smallest count fits them all.
        self.num_kv_blocks = tp.min_int(self._decide_num_blocks(peak))
        self.kv_caches = allocate_kv_cache(
            self.num_layers, self.num_kv_blocks, self.block_size, self.num_kv_heads,
            self.head_dim, self.dtype, self.device,
        )
        self.graphs = None
        self.pieces: PiecewiseGraphs | None = None
        if self.backend.decode_graphs is not None and not config.enforce_eager:
            self.graphs = self.backend.decode_graphs(self)
            self.graphs.capture()
            if config.cudagraph_mode == "FULL_AND_PIECEWISE":
                # One memory pool for both kinds of graph: only one runs at a time.
                self.pieces = PiecewiseGraphs(self)
                self.pieces.capture(pool=self.graphs.pool)

    # ---- memory ------------------------------------------------------------------

    @torch.no_grad()
    def _profile(self) -> int:
        """Run the largest step once (LoRA on, if enabled) and return peak bytes."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.max_num_tokens
        # As many sequences as a step may hold, none longer than max_model_len.
        max_len = self.config.model_config.max_model_len
        num_seqs = min(n, max(self.config.scheduler_config.max_num_seqs, -(-n // max_len)))
        per_seq = [n // num_seqs + (1 if i < n % num_seqs else 0) for i in range(num_seqs)]
        qsl = [0]
        for count in per_seq:
            qsl.append(qsl[-1] + count)
        inputs = PreparedInputs(
            input_ids=[0] * n, positions=[p for c in per_seq for p in range(c)],
            slot_mapping=[-1] * n, query_start_loc=qsl, seq_lens=per_seq,
            block_tables=[[0] * -(-c // self.block_size) for c in per_seq],
            token_lora_slots=[0 if self.loras else -1] * n,
            sample_indices=[q - 1 for q in qsl[1:]], is_decode=False,
        )
        hidden = self._forward_eager(inputs)
        self.compute_logits(hidden[: num_seqs], inputs.token_lora_slots[: num_seqs])
        del hidden
        torch.cuda.synchronize(self.device)
        # Only the transient part: what stays allocated is already off the free memory.
        return torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(
            self.device)

    def _decide_num_blocks(self, peak_bytes: int) -> int:
        cc = self.config.cache_config
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        per_block = kv_block_bytes(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )
        sc = self.config.scheduler_config
        wanted = sc.max_num_seqs * self.max_blocks_per_seq
        # allocate_kv_cache adds block 0, of zeros, to the blocks counted here.
        if cc.kv_cache_memory_bytes is not None:
            blocks = max(1, cc.kv_cache_memory_bytes // per_block - 1)
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Everything in use now (weights, LoRA slots, other processes) plus the
            # activation peak of the largest step must fit in our share.
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(
                self.device)
            in_use = total - free - cached
            budget = int(total * cc.gpu_memory_utilization) - in_use - peak_bytes
            blocks = budget // per_block - 1
            if blocks < 1:
                raise RuntimeError(
                    f"no memory left for the KV cache: {in_use / 2**30:.1f} GiB in use and "
                    f"{peak_bytes / 2**30:.1f} GiB of activations exceed a "
                    f"{cc.gpu_memory_utilization:.2f} share of {total / 2**30:.1f} GiB; raise "
                    "--gpu-memory-utilization or lower --max-num-batched-tokens"
                )
        else:
            blocks = max(1, min(wanted, _CPU_KV_CACHE_BYTES // per_block))
        logger.info("KV cache: %d blocks of %d tokens, %.2f GiB", blocks, self.block_size,
                    blocks * per_block / 2**30)
        return blocks

    # ---- a step --------------------------------------------------------------------

    def prepare(self, step: StepInput, lora_slots: dict[str, int]) -> PreparedInputs:
        bs = self.block_size
        inputs = PreparedInputs([], [], [], [0], [], [], [], [], True)
        for seq in step.seqs:
            n = len(seq.token_ids)
            if seq.token_ids[-1] == PENDING_TOKEN:
                inputs.pending_dst.append(len(inputs.input_ids) + n - 1)
                inputs.pending_src.append(self._last_rows[seq.request_id])
            inputs.input_ids.extend(seq.token_ids)
            pos = range(seq.start_pos, seq.start_pos + n)
            inputs.positions.extend(pos)
            inputs.slot_mapping.extend(seq.block_ids[p // bs] * bs + p % bs for p in pos)
            inputs.query_start_loc.append(inputs.query_start_loc[-1] + n)
            inputs.seq_lens.append(seq.start_pos + n)
            inputs.block_tables.append(seq.block_ids)
            slot = lora_slots.get(seq.lora_name, -1) if seq.lora_name is not None else -1
            inputs.token_lora_slots.extend([slot] * n)
            if seq.sampling is not None:
                inputs.sample_indices.append(inputs.query_start_loc[-1] - 1)
            plp = seq.prompt_logprobs
            if plp is not None and plp.targets:
                first = inputs.query_start_loc[-2] + plp.first
                inputs.prompt_rows.extend(range(first, first + len(plp.targets)))
                inputs.prompt_targets.extend(plp.targets)
                inputs.prompt_counts.append(len(plp.targets))
                inputs.prompt_num_top.append(plp.num_top)
            if n != 1 or seq.sampling is None:
                inputs.is_decode = False
        return inputs

    @torch.no_grad()
    def launch(
        self, step: StepInput, lora_slots: dict[str, int]
    ) -> tuple[SampledBatch | None, PromptLogprobsBatch | None]:
        """Queue the step's forward pass and sampling on the device without waiting
        for them: the sampled batch (None when no sequence samples this step) and the
        prompt logprobs of the sequences that asked for them (None when none did)."""
        inputs = self.prepare(step, lora_slots)
        if self.tp.world_size > 1:
            self.share_step(inputs)
        sampling = [s for s in step.seqs if s.sampling is not None]
        rows = [s.sampling for s in sampling]
        graphs = self.graphs
        batch = None
        prompt_lps = None
        if self._uses_graph(inputs):
            logits = graphs.run(inputs)
            if self.sampler.argmax_suffices(rows):
                # The graph took the argmax already, into graphs.sampled.
                batch = self.sampler.from_argmax(graphs.sampled[: len(rows)])
        else:
            hidden = self._forward(inputs)
            if inputs.prompt_rows:
                row_slots = [inputs.token_lora_slots[r] for r in inputs.prompt_rows]
                prompt_lps = prompt_logprobs(
                    lambda h, rows: self.compute_logits(h, row_slots[rows]),
                    hidden[self.to_device(inputs.prompt_rows)],
                    inputs.prompt_targets, inputs.prompt_counts, inputs.prompt_num_top)
            if not sampling:
                self._last_sampled, self._last_rows = None, {}
                return None, prompt_lps
            logits = self.compute_logits(
                hidden[self.to_device(inputs.sample_indices)],
                [inputs.token_lora_slots[i] for i in inputs.sample_indices])
        if batch is None:
            batch = self.sampler.sample(logits, rows)
            if graphs is not None:
                # A decode graph takes the next step's pending tokens from there.
                graphs.sampled[: len(rows)].copy_(batch.token_ids)
        self._last_sampled = batch.token_ids
        self._last_rows = {s.request_id: i for i, s in enumerate(sampling)}
        return batch, prompt_lps

    def _uses_graph(self, inputs: PreparedInputs) -> bool:
        # A sequence reading prompt logits has a chunk without sampling or longer
        # than one token: such a step is never a decode step, so never a graph.
        return (self.graphs is not None and inputs.is_decode
                and self.graphs.fits(len(inputs.seq_lens)))

    # ---- tensor parallelism ------------------------------------------------------

    def share_step(self, inputs: PreparedInputs) -> None:
        """Rank 0: send the step and the adapter slots written since the last one."""
        log = self.loras.slots.slot_log if self.loras is not None else None
        writes = list(log) if log else []
        if log:
            log.clear()
        self.tp.broadcast_object((inputs, writes))

    @torch.no_grad()
    def run_shared_step(self) -> bool:
        """Ranks 1 .. N-1: run rank 0's next step on this shard (no logits: rank 0
        samples). False when rank 0 stops the group."""
        message = self.tp.broadcast_object()
        if message is None:
            return False
        inputs, writes = message
        for slot, adapter in writes:
            self.loras.write_shared_slot(slot, adapter)
        if self._uses_graph(inputs):
            self.graphs.run(inputs)
        else:
            self._forward(inputs)
        return True

    def compute_logits(self, hidden: torch.Tensor, row_slots: list[int]) -> torch.Tensor:
        """Logits of these rows of the hidden states; ``row_slots`` are their adapters'
        slots, for the lm_head's LoRA."""
        if self.logits_punica is not None:
            if self.loras.slots_use("lm_head"):
                self.logits_punica.update_mapping(row_slots)
            else:
                # No adapter in a slot adapts the lm_head: skip its mapping and op.
                self.logits_punica.any_lora = False
        return self.model.compute_logits(hidden)

    def host_tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """Host inputs go through pinned memory: a copy from pageable memory may wait
        for the step already running on the device."""
        return torch.tensor(values, dtype=dtype, pin_memory=self.pin_memory)

    def to_device(self, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return self.host_tensor(values, dtype).to(self.device, non_blocking=True)

    def fill_pending(self, input_ids: torch.Tensor, inputs: PreparedInputs) -> None:
        """Put the tokens the previous step sampled, still on the device, in place.
        Only rank 0 holds them; the other ranks take its ids."""
        if not inputs.pending_dst:
            return
        if self.tp.is_driver:
            input_ids[self.to_device(inputs.pending_dst)] = self._last_sampled[
                self.to_device(inputs.pending_src)]
        self.tp.broadcast(input_ids)

    def _forward(self, inputs: PreparedInputs) -> torch.Tensor:
        """The hidden states of a step that no decode graph takes: replayed in
        pieces where a token bucket fits it, else eager. Every rank decides alike,
        so their collectives match."""
        if self.pieces is not None and self.pieces.fits(len(inputs.input_ids)):
            return self.pieces.run(inputs)
        return self._forward_eager(inputs)

    def _forward_eager(self, inputs: PreparedInputs) -> torch.Tensor:
        self.punica.update_mapping(inputs.token_lora_slots)
        meta = self.attention_metadata(inputs)
        attn = self.backend.attention(meta, self.attn_workspace)
        input_ids = self.to_device(inputs.input_ids)
        self.fill_pending(input_ids, inputs)
        return self.model(input_ids, self.to_device(inputs.positions), self.kv_caches, attn)

    def attention_metadata(self, inputs: PreparedInputs) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.to_device(inputs.slot_mapping),
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            block_tables=inputs.block_tables,
            block_size=self.block_size,
        )
        if self.backend.attention.device_metadata:
            meta.block_tables_t = block_table_tensor(
                inputs.block_tables, self.pin_memory).to(self.device, non_blocking=True)
            meta.query_start_loc_t = self.to_device(inputs.query_start_loc, torch.int32)
            meta.seq_lens_t = self.to_device(inputs.seq_lens, torch.int32)
            meta.max_query_len = max(
                b - a for a, b in zip(inputs.query_start_loc, inputs.query_start_loc[1:],
                                      strict=False)
            )
        return meta
