"""MoE models (Mixtral, Qwen3-MoE, Qwen2-MoE) and LoRA on their experts: greedy
outputs equal transformers+PEFT token for token (fp32, CPU), with several
adapters and the base model in one batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from moe_utils import MOE_ARCHS, fused_to_per_expert, make_moe_adapter, make_tiny_moe_model
from safetensors.torch import load_file, save_file
from utils import hf_greedy

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.lora.errors import LoRAError

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe(request, tmp_path_factory):
    """A tiny model of one family and three adapters: attention + experts (rank 4),
    experts only (rank 8, down_proj alone), attention + the experts' gate/up (rank 2)
    + the dense MLP projections where the family has them (Qwen3-MoE's dense layer,
    Qwen2-MoE's shared expert)."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    model_dir = make_tiny_moe_model(root / "model", arch, seed=3)
    adapters = {
        "attn_experts": make_moe_adapter(model_dir, root / "a1", r=4, alpha=8, seed=1),
        "down_only": make_moe_adapter(model_dir, root / "a2", r=8, alpha=4, target_modules=None,
                                      target_parameters=["experts.down_proj"], seed=2),
        "gate_up": make_moe_adapter(model_dir, root / "a3", r=2, alpha=2,
                                    target_modules=["k_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"],
                                    target_parameters=["experts.gate_up_proj"], seed=3),
    }
    return arch, model_dir, adapters


def _prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(t).input_ids for t in ("The quick brown fox", "What is the capital of France?")]


def _generate(llm: LLM, prompts, loras) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, loras)
    return [o.outputs[0].token_ids for o in outs]


def test_mixed_adapters_match_peft(moe):
    arch, model_dir, adapters = moe
    llm = LLM(model_dir, enable_lora=True, max_loras=3, max_lora_rank=8)
    loras = [None] + [LoRARequest(n, i + 1, adapters[n]) for i, n in enumerate(adapters)]
    prompts = _prompts(model_dir)
    batch = [(p, lora) for p in prompts for lora in loras]
    outs = _generate(llm, [p for p, _ in batch], [lr for _, lr in batch])
    by_lora: dict[str | None, list[list[int]]] = {}
    for (p, lora), got in zip(batch, outs, strict=True):
        want = hf_greedy(model_dir, lora.lora_path if lora else None, p, MAX_TOKENS)
        assert got == want, (arch, lora)
        by_lora.setdefault(lora.lora_name if lora else None, []).append(got)
    for name in adapters:  # every adapter really changes the output
        assert by_lora[name] != by_lora[None], name


def test_per_expert_adapter_layout_matches_peft(tmp_path, moe):
    """An adapter of per-expert modules (experts.<e>.w1 ..., transformers 4's layout)
    gives the tokens that PEFT gives for the same update as fused parameters."""
    arch, model_dir, _ = moe
    config = json.loads((Path(model_dir) / "config.json").read_text())
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    fused = make_moe_adapter(model_dir, tmp_path / "fused", r=8, alpha=12, target_modules=None,
                             seed=7, scale=0.3)
    per_expert = fused_to_per_expert(fused, tmp_path / "per_expert", arch,
                                     config["hidden_size"], inter)
    llm = LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompt = _prompts(model_dir)[1]
    base, got = _generate(llm, [prompt, prompt], [None, LoRARequest("pe", 1, per_expert)])
    assert got == hf_greedy(model_dir, fused, prompt, MAX_TOKENS)
    assert got != base


def test_expert_rank_and_alpha_patterns_match_peft(tmp_path, moe):
    """PEFT keys a fused parameter's patterns by its name (``experts.down_proj``)."""
    arch, model_dir, _ = moe
    adapter = make_moe_adapter(model_dir, tmp_path / "pat", r=8, alpha=8, seed=5,
                               rank_pattern={"gate_up_proj": 2, "q_proj": 1},
                               alpha_pattern={"experts.down_proj": 20})
    llm = LLM(model_dir, enable_lora=True, max_lora_rank=8)
    prompt = _prompts(model_dir)[0]
    (got,) = _generate(llm, [prompt], [LoRARequest("pat", 1, adapter)])
    assert got == hf_greedy(model_dir, adapter, prompt, MAX_TOKENS)


def test_fused_expert_checkpoint_loads(tmp_path, moe):
    """A checkpoint holding the fused expert tensors (experts.gate_up_proj ...) loads
    as well as the per-expert one transformers writes."""
    arch, model_dir, _ = moe
    fused_dir = tmp_path / "fused_ckpt"
    fused_dir.mkdir()
    for f in Path(model_dir).iterdir():
        if f.suffix != ".safetensors":
            (fused_dir / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    fused = {k: v for k, v in hf.state_dict().items() if ".experts." not in k}
    fused.update({k: v for k, v in hf.state_dict().items() if k.endswith(
        ("experts.gate_up_proj", "experts.down_proj"))})
    assert any(".experts.0." in k for k in tensors)  # transformers wrote per-expert names
    if hf.config.tie_word_embeddings:
        fused.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in fused.items()}, str(fused_dir / "model.safetensors"))
    prompt = _prompts(model_dir)[0]
    (got,) = _generate(LLM(str(fused_dir)), [prompt], None)
    assert got == hf_greedy(model_dir, None, prompt, MAX_TOKENS)


def test_bad_expert_adapters_are_refused(tmp_path, moe):
    arch, model_dir, adapters = moe
    small = LLM(model_dir, enable_lora=True, max_loras=1, max_lora_rank=1)
    with pytest.raises(LoRAError, match="max_lora_rank"):
        small.engine.executor.driver.loras.load(LoRARequest("big", 1, adapters["down_only"]))
    llm = LLM(model_dir, enable_lora=True, max_loras=1, max_lora_rank=8)
    bad = tmp_path / "bad"
    bad.mkdir()
    src = Path(adapters["gate_up"])
    (bad / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    tensors = load_file(str(src / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("experts.lora_B.weight"))
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="fit neither"):
        llm.engine.executor.driver.loras.load(LoRARequest("bad", 2, str(bad)))


def test_lora_target_modules_restrict_expert_updates(moe):
    """--lora-target-modules keeps the experts' updates only when it names them."""
    arch, model_dir, adapters = moe
    prompt = _prompts(model_dir)[0]
    down_only = LoRARequest("down_only", 1, adapters["down_only"])
    kept = LLM(model_dir, enable_lora=True, max_lora_rank=8, lora_target_modules=["experts"])
    (got,) = _generate(kept, [prompt], [down_only])
    assert got == hf_greedy(model_dir, adapters["down_only"], prompt, MAX_TOKENS)
    dropped = LLM(model_dir, enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj"])
    with pytest.raises(LoRAError, match="no LoRA weights"):
        dropped.engine.executor.driver.loras.load(down_only)
