"""Model surgery: every layer that takes LoRA is replaced, in place, by the wrapper
class that says it can replace it, and what adapters may target is recorded."""

from __future__ import annotations

from torch import nn

from loraserve.config import LoRAConfig
from loraserve.lora.layers import EmbeddingWithLoRA, LinearWithLoRA
from loraserve.lora.moe_layers import ExpertsWithLoRA
from loraserve.lora.parallel_layers import ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA
from loraserve.lora.peft_adapter import ModelLoRAInfo
from loraserve.lora.punica import PunicaWrapper
from loraserve.lora.slot_stacks import SlotSpec

LoRAWrapper = LinearWithLoRA | EmbeddingWithLoRA | ExpertsWithLoRA
# Each class's can_replace_layer excludes the others' layers, so the order is free.
WRAPPER_CLASSES: tuple[type[LoRAWrapper], ...] = (
    LinearWithLoRA, ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA,
    EmbeddingWithLoRA, ExpertsWithLoRA,
)


def wrap_model(
    model: nn.Module,
    lora_config: LoRAConfig,
    punica: PunicaWrapper,
    logits_punica: PunicaWrapper | None = None,
) -> tuple[dict[str, LoRAWrapper], ModelLoRAInfo]:
    """Replace every LoRA-capable layer with its wrapper. The lm_head's wrapper maps
    the rows whose logits are computed (``logits_punica``), every other layer the
    step's tokens (``punica``)."""
    spec = SlotSpec(lora_config.max_loras, lora_config.max_lora_rank, lora_config.lora_dtype,
                    punica, logits_punica, lora_config.fully_sharded_loras)
    info = ModelLoRAInfo(modules={}, by_source={}, projection_names=set())
    for sources in model.lora_modules.values():
        info.projection_names.update(sources)
    wrappers: dict[str, LoRAWrapper] = {}
    for path, layer in list(model.named_modules()):
        matches = [c for c in WRAPPER_CLASSES if c.can_replace_layer(layer, path, model)]
        if not matches:
            continue
        if len(matches) > 1:
            raise TypeError(f"{path}: {[c.__name__ for c in matches]} all claim the layer")
        wrapper = matches[0].from_layer(layer, path, model, spec)
        parent_path, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, attr, wrapper)
        wrapper.describe(path, model, info)
        wrappers[path] = wrapper
    if getattr(model, "tie_word_embeddings", False) and "lm_head" in info.base_weights:
        embedding = next(iter(info.embeddings), None)
        if embedding is not None:
            info.tied = (embedding, "lm_head")
    return wrappers, info
