"""Loads the model (and its LoRA wrappers), owns the KV cache tensors, and runs
one step: inputs -> forward -> logits -> sampled tokens."""

from __future__ import annotations

import logging
import time

import torch

from loraserve.config import EngineConfig
from loraserve.lora.manager import LoRAManager
from loraserve.lora.punica import PunicaWrapper
from loraserve.model.registry import build_model
from loraserve.model.rope import head_dim_of
from loraserve.model.weight_loader import init_dummy_weights, load_weights
from loraserve.worker.attention import (
    AttentionMetadata,
    TorchPagedAttention,
    allocate_kv_cache,
    kv_block_bytes,
)
from loraserve.worker.input_batch import StepInput
from loraserve.worker.sampler import Sampler, SamplerOutput

logger = logging.getLogger(__name__)

# CPU has no memory profile to size against: cap the KV cache at this much.
_CPU_KV_CACHE_BYTES = 2 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        self.device = config.device
        self.dtype = mc.dtype
        torch.manual_seed(mc.seed)
        start = time.perf_counter()
        model = build_model(mc.hf_config, self.dtype, self.device, mc.max_model_len)
        if mc.load_format == "dummy":
            init_dummy_weights(model, mc.seed)
        else:
            load_weights(model, mc.model)
        self.model = model.eval()
        logger.info("model loaded in %.1f s", time.perf_counter() - start)

        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        num_slots = config.lora_config.max_loras if config.lora_config else 1
        self.punica = PunicaWrapper(self.max_num_tokens, num_slots, self.device)
        self.lora_manager: LoRAManager | None = None
        if config.lora_config is not None:
            self.lora_manager = LoRAManager(self.model, config.lora_config, self.punica)

        hf = mc.hf_config
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = head_dim_of(hf)
        self.block_size = config.cache_config.block_size
        self.num_kv_blocks = self._decide_num_blocks()
        self.kv_caches = allocate_kv_cache(
            self.num_layers, self.num_kv_blocks, self.block_size, self.num_kv_heads,
            self.head_dim, self.dtype, self.device,
        )
        self.sampler = Sampler(self.device, mc.seed)

    def _decide_num_blocks(self) -> int:
        cc = self.config.cache_config
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        per_block = kv_block_bytes(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )
        sc = self.config.scheduler_config
        # Enough for every sequence at full length, but no more than the budget.
        wanted = sc.max_num_seqs * -(-sc.max_model_len // self.block_size)
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cc.gpu_memory_utilization) - used
            return max(1, budget // per_block)
        else:
            budget = _CPU_KV_CACHE_BYTES
        return max(1, min(wanted, budget // per_block))

    @torch.no_grad()
    def execute(self, step: StepInput, lora_slots: dict[str, int]) -> SamplerOutput:
        token_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        token_lora_slots: list[int] = []
        sample_indices: list[int] = []
        bs = self.block_size
        for seq in step.seqs:
            n = len(seq.token_ids)
            token_ids.extend(seq.token_ids)
            pos = range(seq.start_pos, seq.start_pos + n)
            positions.extend(pos)
            slot_mapping.extend(seq.block_ids[p // bs] * bs + p % bs for p in pos)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(seq.start_pos + n)
            block_tables.append(seq.block_ids)
            slot = lora_slots.get(seq.lora_name, -1) if seq.lora_name is not None else -1
            token_lora_slots.extend([slot] * n)
            if seq.sampling is not None:
                sample_indices.append(query_start_loc[-1] - 1)

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            block_size=bs,
        )
        self.punica.update_mapping(token_lora_slots)
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            TorchPagedAttention(meta),
        )
        if not sample_indices:
            return SamplerOutput([], [])
        logits = self.model.compute_logits(hidden[torch.tensor(sample_indices, device=dev)])
        rows = [s.sampling for s in step.seqs if s.sampling is not None]
        return self.sampler(logits, rows)
