"""Model loading: sharded checkpoints, dummy weights, unsupported architectures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from utils import hf_greedy

from loraserve import LLM, SamplingParams
from loraserve.model.registry import SUPPORTED_ARCHITECTURES, UnsupportedModelError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_sharded_checkpoint_loads(tmp_path, llama_dir, prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="40KB")
    AutoTokenizer.from_pretrained(llama_dir).save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").exists()
    (out,) = LLM(str(sharded)).generate([{"prompt_token_ids": prompts[0]}], GREEDY)
    assert out.outputs[0].token_ids == hf_greedy(llama_dir, None, prompts[0], 8)


def test_dummy_weights_run_without_a_checkpoint(tmp_path, llama_dir, prompts):
    empty = tmp_path / "config_only"
    empty.mkdir()
    for f in Path(llama_dir).glob("*.json"):
        if f.name != "model.safetensors.index.json":
            (empty / f.name).write_bytes(f.read_bytes())
    llm = LLM(str(empty), load_format="dummy")
    (out,) = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)
    assert len(out.outputs[0].token_ids) == 8


def test_unsupported_architecture_names_the_supported_ones(tmp_path, llama_dir):
    bad = tmp_path / "gpt2ish"
    bad.mkdir()
    config = json.loads((Path(llama_dir) / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as err:
        LLM(str(bad))
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)
    assert "GPT2LMHeadModel" in str(err.value)


def test_invalid_config_combinations_fail_at_once(llama_dir):
    with pytest.raises(ValueError, match="max_lora_rank 12"):
        LLM(llama_dir, enable_lora=True, max_lora_rank=12)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(llama_dir, enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(llama_dir, max_model_len=100000)
    with pytest.raises(ValueError, match="without enable_lora"):
        LLM(llama_dir, max_cpu_loras=3)


def test_prompt_too_long_is_refused_and_engine_serves(llama_dir, prompts):
    llm = LLM(llama_dir, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len 16"):
        llm.generate([{"prompt_token_ids": [5] * 16}], GREEDY)
    (out,) = llm.generate([{"prompt_token_ids": prompts[0]}],
                          SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    # Generation stops at max_model_len.
    assert len(prompts[0]) + len(out.outputs[0].token_ids) == 16
    assert out.outputs[0].finish_reason == "length"


def test_checkpoint_missing_one_slice_of_a_merged_projection(tmp_path, llama_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "no_k"
    shutil.copytree(llama_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks tensors.*layers\.1\.self_attn\.qkv_proj"):
        LLM(str(broken))
