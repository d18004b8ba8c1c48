"""The worker: loads the model (and its LoRA wrappers), owns the KV cache tensors
and the adapters, and runs one step: adapter slots -> inputs -> forward -> logits
-> sampled tokens.

An executor drives it (loraserve.executor): the engine's `execute(step)` and
`call(method, ...)` become the same method call on the runner of every
tensor-parallel rank, so the public methods here are what an engine can ask of
a worker. Each rank keeps its own adapters; the calls and steps it gets are the
same on every rank, so its adapters are the same too.

Which kernels run is chosen once, from the device (``backend.select_backend``):
on a GPU the model, the LoRA op and attention run Triton kernels, decode
steps replay CUDA graphs (see cuda_graphs.py) and, with
``cudagraph_mode=FULL_AND_PIECEWISE``, the other steps replay piecewise graphs
(piecewise_graphs.py); on a CPU everything is plain torch. On a GPU the KV
cache is sized from gpu_memory_utilization after a profiling pass.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from loraserve.config import EngineConfig, LoRAConfig
from loraserve.distributed.parallel_state import SINGLE, TensorParallel
from loraserve.lora.errors import LoRAError
from loraserve.lora.manager import LoRAManager
from loraserve.lora.request import LoRARequest
from loraserve.lora.residency import LoRAResidency
from loraserve.lora.slot_memory import resolve_max_loras
from loraserve.model.registry import build_model
from loraserve.model.rope import head_dim_of
from loraserve.model.weight_loader import init_dummy_weights, load_weights
from loraserve.structured_output.bitmask import TokenMask
from loraserve.worker.attention import allocate_kv_cache, kv_block_bytes
from loraserve.worker.backend import select_backend
from loraserve.worker.forward_context import ForwardContext, PendingTokens
from loraserve.worker.input_batch import PENDING_TOKEN, PreparedInputs, StepInput, StepOutput
from loraserve.worker.piecewise_graphs import PiecewiseGraphs
from loraserve.worker.sampler import (
    DEFERRED_PLACEHOLDER,
    SampledBatch,
    Sampler,
    SamplingRow,
    prompt_logprobs,
)

logger = logging.getLogger(__name__)

# CPU has no memory profile to size against: cap the KV cache at this much.
_CPU_KV_CACHE_BYTES = 2 << 30


@dataclass
class _DeferredRows:
    """Rows of a step's sampled batch still to be sampled, with their logits."""

    batch: SampledBatch
    index: list[int]  # their rows in the batch
    logits: torch.Tensor
    rows: list[SamplingRow]


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
        if config.lora_config is not None and config.lora_config.auto_max_loras:
            # --max-loras auto: the slots are sized from what the weights left.
            config = self.config = dataclasses.replace(config, lora_config=resolve_max_loras(
                config.lora_config, mc.hf_config, self.dtype, self.device,
                config.cache_config.gpu_memory_utilization,
                config.scheduler_config.max_num_seqs, tp))
        num_slots = config.lora_config.max_loras if config.lora_config else 1
        self.punica = self.backend.punica_wrapper(self.max_num_tokens, num_slots, self.device)
        # This worker's adapters: CPU cache, device slots, background loads.
        self.loras: LoRAManager | None = None
        # The lm_head's LoRA maps the rows whose logits are computed, not the tokens.
        self.logits_punica = None
        if config.lora_config is not None:
            if "lm_head" in self.model.lora_modules:
                self.logits_punica = self.backend.punica_wrapper(
                    self.max_num_tokens, num_slots, self.device)
            self.loras = LoRAManager(self.model, config.lora_config, self.punica,
                                     logits_punica=self.logits_punica,
                                     pin_memory=self.device.type == "cuda")

        hf = mc.hf_config
        self.num_layers = hf.num_hidden_layers
        # This rank's heads (all of them without tensor parallelism).
        num_heads = getattr(model, "num_heads", hf.num_attention_heads)
        self.num_kv_heads = getattr(model, "num_kv_heads", None) or getattr(
            hf, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(hf)
        self.block_size = config.cache_config.block_size
        self.max_blocks_per_seq = -(-mc.max_model_len // self.block_size)
        self.sampler = Sampler(self.device, mc.seed, argmax=self.backend.ops.argmax)
        # The last step's sampled ids on the device, and each request's row there.
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        # The last step's rows that wait for their masks (sample_deferred).
        self._deferred: _DeferredRows | None = None

        # A scratch KV cache of one block serves the profiling pass.
        self.ctx = ForwardContext(
            model=self.model,
            kv_caches=allocate_kv_cache(self.num_layers, 1, self.block_size, self.num_kv_heads,
                                        self.head_dim, self.dtype, self.device),
            attention=self.backend.attention,
            attn_workspace=self.backend.attention.make_workspace(
                num_heads, self.head_dim, self.device),
            punica=self.punica, logits_punica=self.logits_punica,
            argmax=self.backend.ops.argmax, tp=tp, device=self.device, dtype=self.dtype,
            block_size=self.block_size, max_blocks_per_seq=self.max_blocks_per_seq,
            lora_wrappers=self.loras.wrappers if self.loras is not None else {},
        )
        peak = self._profile() if self.device.type == "cuda" else 0
        # Every rank's cache holds the same blocks: the smallest count fits them all.
        self.num_kv_blocks = tp.min_int(self._decide_num_blocks(peak))
        self.ctx.kv_caches = allocate_kv_cache(
            self.num_layers, self.num_kv_blocks, self.block_size, self.num_kv_heads,
            self.head_dim, self.dtype, self.device,
        )
        self.graphs = None
        self.pieces: PiecewiseGraphs | None = None
        if self.backend.decode_graphs is not None and not config.enforce_eager:
            sc = config.scheduler_config
            self.graphs = self.backend.decode_graphs(
                self.ctx, min(sc.max_num_seqs, sc.max_num_batched_tokens),
                config.specialize_active_lora)
            self.graphs.capture()
            if config.cudagraph_mode == "FULL_AND_PIECEWISE":
                # One memory pool for both kinds of graph: only one runs at a time.
                self.pieces = PiecewiseGraphs(self.ctx, self.max_num_tokens)
                self.pieces.capture(pool=self.graphs.pool)
        if self.device.type == "cuda":
            self._warm_up_eager_steps()

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.ctx.kv_caches

    @torch.no_grad()
    def _warm_up_eager_steps(self) -> None:
        """Compile at start-up the LoRA kernels of the steps that no graph takes:
        a step of each launch configuration they can meet runs once here, so the
        first request to meet it does not wait for a compile. The decode graphs
        take decode steps only; the pieces, other steps up to their largest bucket."""
        covered = self.pieces.sizes[-1] if self.pieces is not None else 0
        # The LoRA kernels' configs change with the token count in steps of at least
        # 2x: sizes sqrt(2) apart meet every one of them.
        sizes = sorted({min(self.max_num_tokens, round(2 ** (i / 2)))
                        for i in range(2 * self.max_num_tokens.bit_length() + 1)})
        # The profiling pass ran the largest step already.
        seen = {self.ctx.lora_launch_configs(self.max_num_tokens)}
        start, warmed = time.perf_counter(), []
        for n in sizes:
            configs = self.ctx.lora_launch_configs(n)
            if n <= covered or configs in seen:
                continue
            seen.add(configs)
            self._forward_eager(self._dummy_step(n))
            warmed.append(n)
        if warmed:
            torch.cuda.synchronize(self.device)
            logger.info("warmed up eager steps of %s tokens in %.1f s",
                        ", ".join(map(str, warmed)), time.perf_counter() - start)

    # ---- memory ------------------------------------------------------------------

    def _dummy_step(self, n: int) -> PreparedInputs:
        """A prefill step of n tokens over as many sequences as a step may hold (none
        longer than max_model_len), writing no KV (slot -1), every token on adapter
        slot 0 if LoRA is on."""
        max_len = self.config.model_config.max_model_len
        num_seqs = min(n, max(self.config.scheduler_config.max_num_seqs, -(-n // max_len)))
        per_seq = [n // num_seqs + (1 if i < n % num_seqs else 0) for i in range(num_seqs)]
        qsl = [0]
        for count in per_seq:
            qsl.append(qsl[-1] + count)
        return PreparedInputs(
            input_ids=[0] * n, positions=[p for c in per_seq for p in range(c)],
            slot_mapping=[-1] * n, query_start_loc=qsl, seq_lens=per_seq,
            block_tables=[[0] * -(-c // self.block_size) for c in per_seq],
            token_lora_slots=[0 if self.loras else -1] * n,
            sample_indices=[q - 1 for q in qsl[1:]], is_decode=False,
        )

    @torch.no_grad()
    def _profile(self) -> int:
        """Run the largest step once (LoRA on, if enabled) and return peak bytes."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        inputs = self._dummy_step(self.max_num_tokens)
        hidden = self._forward_eager(inputs)
        num_seqs = len(inputs.seq_lens)
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

    @torch.no_grad()
    def execute(self, step: StepInput) -> StepOutput:
        """Give the step's adapters device slots, then queue its forward pass and
        sampling on the device without waiting for them. Only rank 0 samples."""
        # Rows of a step that failed, about to be run again, are not sampled.
        self._deferred = None
        slots = (self.loras.set_active(step.lora_names(), step.running_loras)
                 if self.loras is not None else {})
        inputs = self.prepare(step, slots)
        out = self._run(step, inputs)
        out.lora = self.loras.residency_if_changed() if self.loras is not None else None
        return out

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
            if seq.samples:
                inputs.sample_indices.append(inputs.query_start_loc[-1] - 1)
            plp = seq.prompt_logprobs
            if plp is not None and plp.targets:
                first = inputs.query_start_loc[-2] + plp.first
                inputs.prompt_rows.extend(range(first, first + len(plp.targets)))
                inputs.prompt_targets.extend(plp.targets)
                inputs.prompt_counts.append(len(plp.targets))
                inputs.prompt_num_top.append(plp.num_top)
            if n != 1 or not seq.samples:
                inputs.is_decode = False
        return inputs

    def _run(self, step: StepInput, inputs: PreparedInputs) -> StepOutput:
        sampling = [s for s in step.seqs if s.samples]
        # Each sampled sequence's row in this step's ids, where the next step's
        # pending token comes from (every rank tracks it; only rank 0 fills it).
        self._last_rows = {s.request_id: i for i, s in enumerate(sampling)}
        graphs = self.graphs
        out = StepOutput(None)
        if self._uses_graph(inputs):
            logits = graphs.run(inputs)
            if not self.tp.is_driver:
                return out
            rows = self._sampled_now(logits, [s.sampling for s in sampling])
            if self.sampler.argmax_suffices(rows):
                # The graph took the argmax already, into graphs.sampled.
                out.sampled = self.sampler.from_argmax(graphs.sampled[: len(rows)])
                return self._keep(out)
        else:
            hidden = self._forward(inputs)
            if not self.tp.is_driver:
                return out
            if inputs.prompt_rows:
                row_slots = [inputs.token_lora_slots[r] for r in inputs.prompt_rows]
                out.prompt_logprobs = prompt_logprobs(
                    lambda h, rows: self.compute_logits(h, row_slots[rows]),
                    hidden[self.ctx.to_device(inputs.prompt_rows)],
                    inputs.prompt_targets, inputs.prompt_counts, inputs.prompt_num_top)
            if not sampling:
                self._last_sampled = None
                return out
            logits = self.compute_logits(
                hidden[self.ctx.to_device(inputs.sample_indices)],
                [inputs.token_lora_slots[i] for i in inputs.sample_indices])
            rows = self._sampled_now(logits, [s.sampling for s in sampling])
        out.sampled = self.sampler.sample(logits, rows)
        if graphs is not None:
            # A decode graph takes the next step's pending tokens from there.
            graphs.sampled[: len(rows)].copy_(out.sampled.token_ids)
        return self._keep(out)

    def _sampled_now(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SamplingRow]:
        """The rows to sample with the step: deferred rows keep a copy of their
        logits for sample_deferred and stand in as placeholders meanwhile."""
        index = [i for i, row in enumerate(rows) if row.deferred]
        if not index:
            return rows
        saved = logits.index_select(0, self.ctx.to_device(index)).float()
        self._deferred = _DeferredRows(None, index, saved, [rows[i] for i in index])
        return [DEFERRED_PLACEHOLDER if row.deferred else row for row in rows]

    def _keep(self, out: StepOutput) -> StepOutput:
        self._last_sampled = out.sampled.token_ids
        if self._deferred is not None:
            self._deferred.batch = out.sampled
        return out

    @torch.no_grad()
    def sample_deferred(self, masks: list[TokenMask | None]) -> None:
        """Sample the last step's deferred rows, now that their masks are known (one
        per row, None: unconstrained), into its batch and where the next step takes
        its pending tokens from. Before the next step runs; rank 0 only."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        for row, mask in zip(deferred.rows, masks, strict=True):
            row.token_mask = mask
        late = self.sampler.sample(deferred.logits, deferred.rows)
        index = self.ctx.to_device(deferred.index)
        deferred.batch.token_ids.index_copy_(0, index, late.token_ids)
        if self.graphs is not None:
            self.graphs.sampled.index_copy_(0, index, late.token_ids)
        deferred.batch.patches.append((deferred.index, late))

    def _uses_graph(self, inputs: PreparedInputs) -> bool:
        # A sequence reading prompt logits has a chunk without sampling or longer
        # than one token: such a step is never a decode step, so never a graph.
        return (self.graphs is not None and inputs.is_decode
                and self.graphs.fits(len(inputs.seq_lens)))

    def compute_logits(self, hidden: torch.Tensor, row_slots: list[int]) -> torch.Tensor:
        """Logits of these rows of the hidden states; ``row_slots`` are their adapters'
        slots, for the lm_head's LoRA."""
        if self.logits_punica is not None:
            if self.loras.slots_use("lm_head"):
                self.logits_punica.update_mapping(row_slots)
            else:
                # No adapter in a slot adapts the lm_head: skip its mapping and op.
                self.logits_punica.clear_mapping()
        return self.model.compute_logits(hidden)

    def _pending(self, inputs: PreparedInputs) -> PendingTokens:
        return PendingTokens(self._last_sampled, inputs.pending_dst, inputs.pending_src)

    def _forward(self, inputs: PreparedInputs) -> torch.Tensor:
        """The hidden states of a step that no decode graph takes: replayed in
        pieces where a token bucket fits it, else eager. Every rank decides alike,
        so their collectives match."""
        if self.pieces is not None and self.pieces.fits(len(inputs.input_ids)):
            return self.pieces.run(inputs, self._pending(inputs))
        return self._forward_eager(inputs)

    def _forward_eager(self, inputs: PreparedInputs) -> torch.Tensor:
        ctx = self.ctx
        self.punica.update_mapping(inputs.token_lora_slots)
        attn = ctx.attention_for(inputs)
        input_ids = ctx.to_device(inputs.input_ids)
        self._pending(inputs).fill(input_ids, ctx)
        return self.model(input_ids, ctx.to_device(inputs.positions), ctx.kv_caches, attn)

    # ---- adapters --------------------------------------------------------------------
    # What the engine asks of the worker's adapters; each answers with what is resident.

    def _lora_manager(self) -> LoRAManager:
        if self.loras is None:
            raise ValueError("LoRA is not enabled; start with enable_lora (--enable-lora)")
        return self.loras

    def add_lora(self, lora_request: LoRARequest, pinned: bool = False,
                 protected: Iterable[str] = ()) -> LoRAResidency:
        """Read the adapter now (raises LoRAError) and cache it, with a device slot
        if one is free or held by an adapter that is not `protected`."""
        manager = self._lora_manager()
        manager.add(lora_request, pinned, protected)
        return manager.residency()

    def start_lora_loads(self, lora_requests: list[LoRARequest]) -> None:
        self._lora_manager().start_loads(lora_requests)

    def finished_lora_loads(self) -> list[tuple[str, LoRAError | None]]:
        return self._lora_manager().finished_loads()

    def commit_lora_loads(self, names: list[str], failed: list[str], pinned: list[str],
                          activate: list[str], protected: list[str]) -> LoRAResidency:
        manager = self._lora_manager()
        manager.commit_loads(names, failed, pinned, activate, protected)
        return manager.residency()

    def remove_lora(self, name: str, request_ids: list[int]
                    ) -> tuple[bool, frozenset[int], LoRAResidency]:
        manager = self._lora_manager()
        found, retired = manager.remove(name, request_ids)
        return found, retired, manager.residency()

    def pin_lora(self, name: str) -> LoRAResidency:
        manager = self._lora_manager()
        manager.pin(name)
        return manager.residency()

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA config this worker runs, max_loras decided (--max-loras auto)."""
        return self.config.lora_config

    def lora_residency(self) -> LoRAResidency:
        return self.loras.residency() if self.loras is not None else LoRAResidency()

    def lora_memory_usage(self) -> dict[str, int]:
        return self.loras.memory_usage() if self.loras is not None else {}

    def shutdown(self) -> None:
        if self.loras is not None:
            self.loras.shutdown()
