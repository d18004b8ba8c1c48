"""Builders for MoE tests: tiny random Mixtral / Qwen3-MoE / Qwen2-MoE models and
their PEFT adapters (attention modules plus ``target_parameters`` on the fused
experts), and the same adapter rewritten in the per-expert module layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from utils import make_tokenizer

MOE_ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe")
EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")
NUM_EXPERTS = {"mixtral": 4, "qwen3_moe": 8, "qwen2_moe": 8}


def make_tiny_moe_model(out_dir: str | Path, arch: str, seed: int = 0) -> str:
    """hidden 64, top-2 routing, 2 layers; Qwen3-MoE renormalises its top-k and has a
    dense second layer, Qwen2-MoE does not renormalise and has a shared expert."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out_dir)
    common = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, rms_norm_eps=1e-5, num_experts_per_tok=2,
    )
    experts = NUM_EXPERTS[arch]
    if arch == "mixtral":
        config = MixtralConfig(**common, num_local_experts=experts)
    elif arch == "qwen3_moe":
        # Layer 1 stays dense (mlp_only_layers), as some Qwen-MoE configs have it.
        config = Qwen3MoeConfig(**common, num_experts=experts, moe_intermediate_size=32,
                                head_dim=16, norm_topk_prob=True, mlp_only_layers=[1])
    elif arch == "qwen2_moe":
        config = Qwen2MoeConfig(**common, num_experts=experts, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, norm_topk_prob=False)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger weights than the init: decisive, varied greedy paths and routers
    # that spread tokens over the experts.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" in name or "lm_head" in name:
                p.normal_(0.0, 0.3)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.5 if name.endswith("gate.weight") else 0.12)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return str(out_dir)


def make_moe_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    r: int = 4,
    alpha: float = 8,
    target_modules: list[str] | None = ("q_proj", "v_proj", "o_proj"),
    target_parameters: list[str] | None = EXPERT_PARAMS,
    seed: int = 0,
    scale: float = 0.3,
    rank_pattern: dict | None = None,
    alpha_pattern: dict | None = None,
) -> str:
    """A PEFT adapter with random A and B, saved by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cfg = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, bias="none",
        target_modules=list(target_modules) if target_modules else None,
        target_parameters=list(target_parameters) if target_parameters else None,
        rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {},
    )
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def fused_to_per_expert(
    fused_dir: str | Path, out_dir: str | Path, arch: str, hidden: int, inter: int,
) -> str:
    """Rewrite a rank-2r ``target_parameters`` adapter (experts only) whose gate/up
    update is block-diagonal as per-expert gate, up and down adapters of rank r:
    the update transformers 4's per-expert modules would have had. The fused
    adapter's B is zeroed off the blocks first, and saved back, so that both
    describe the same update."""
    fused_dir, out_dir = Path(fused_dir), Path(out_dir)
    config = json.loads((fused_dir / "adapter_config.json").read_text())
    tensors = load_file(str(fused_dir / "adapter_model.safetensors"))
    num_experts, two_r = NUM_EXPERTS[arch], config["r"]
    r = two_r // 2
    gate, up, down = ("w1", "w3", "w2") if arch == "mixtral" else (
        "gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    per_expert: dict[str, torch.Tensor] = {}
    for key in list(tensors):
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0]
        a = tensors[key]
        b_key = key.replace(".lora_A.", ".lora_B.")
        b = tensors[b_key]
        a_e = a.reshape(num_experts, two_r, a.shape[1])
        b_e = b.reshape(b.shape[0], two_r, num_experts).permute(2, 0, 1).clone()
        prefix = module.split(".mlp.experts")[0] + f".{block}.experts"
        if a.shape[1] == hidden:  # gate_up_proj
            b_e[:, :inter, r:] = 0
            b_e[:, inter:, :r] = 0
            for e in range(num_experts):
                for name, rows, cols in ((gate, slice(0, r), slice(0, inter)),
                                         (up, slice(r, two_r), slice(inter, 2 * inter))):
                    per_expert[f"{prefix}.{e}.{name}.lora_A.weight"] = a_e[e, rows].clone()
                    per_expert[f"{prefix}.{e}.{name}.lora_B.weight"] = b_e[e, cols, rows].clone()
        else:  # down_proj, kept at rank 2r
            for e in range(num_experts):
                per_expert[f"{prefix}.{e}.{down}.lora_A.weight"] = a_e[e].clone()
                per_expert[f"{prefix}.{e}.{down}.lora_B.weight"] = b_e[e].clone()
        tensors[b_key] = b_e.permute(1, 2, 0).reshape(b.shape).contiguous()
    save_file(tensors, str(fused_dir / "adapter_model.safetensors"))
    out_dir.mkdir(parents=True, exist_ok=True)
    # Per-expert ranks: r for gate and up, 2r for down, each scaled as the fused
    # adapter's alpha / 2r.
    scale = config["lora_alpha"] / two_r
    per_config = dict(config, r=r, lora_alpha=scale * r, target_parameters=None,
                      target_modules=[gate, up, down],
                      rank_pattern={down: two_r}, alpha_pattern={down: scale * two_r})
    (out_dir / "adapter_config.json").write_text(json.dumps(per_config))
    save_file(per_expert, str(out_dir / "adapter_model.safetensors"))
    return str(out_dir)
