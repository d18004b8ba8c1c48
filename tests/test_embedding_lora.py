"""LoRA on embed_tokens and lm_head: greedy tokens and prompt logprobs equal
transformers+PEFT (fp32), for untied and tied embeddings, mixed in one batch with
other adapters and the base model; adapters that change the vocabulary are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from utils import ALL_TARGETS, hf_greedy, make_peft_adapter, make_tiny_model

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.lora.errors import LoRAError

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
TARGETS = {
    "embed": ("embed_tokens",),
    "lm_head": ("lm_head",),
    "all": ("embed_tokens", "lm_head", *ALL_TARGETS),
    "attn": ("q_proj", "v_proj"),
}


def _adapters(model_dir: str, root, **kwargs) -> dict[str, str]:
    return {
        name: make_peft_adapter(model_dir, root / name, r=4 + 4 * i, alpha=8, seed=20 + i,
                                target_modules=targets, scale=0.3, **kwargs)
        for i, (name, targets) in enumerate(TARGETS.items())
    }


def _check_mixed_batch(model_dir: str, adapters: dict[str, str], prompts, **engine) -> None:
    llm = LLM(model_dir, enable_lora=True, max_loras=len(adapters), max_lora_rank=16, **engine)
    loras = [None] + [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(adapters.items())]
    batch = [(p, lora) for p in prompts for lora in loras]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], GREEDY,
                        [lora for _, lora in batch])
    base = {tuple(p): hf_greedy(model_dir, None, p, MAX_TOKENS) for p in prompts}
    for (p, lora), out in zip(batch, outs, strict=True):
        got = out.outputs[0].token_ids
        if lora is None:
            assert got == base[tuple(p)]
            continue
        assert got == hf_greedy(model_dir, lora.lora_path, p, MAX_TOKENS), lora.lora_name
        assert got != base[tuple(p)], lora.lora_name  # the adapter changes the output


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tied") / "m", "qwen3",
                           tie_word_embeddings=True, seed=5)


def test_untied_mixed_batch_matches_peft(tmp_path, llama_dir, prompts):
    _check_mixed_batch(llama_dir, _adapters(llama_dir, tmp_path), prompts[:2])


def test_tied_mixed_batch_matches_peft(tmp_path, tied_dir, prompts):
    _check_mixed_batch(tied_dir, _adapters(tied_dir, tmp_path), prompts[2:])


def test_tied_with_ensure_weight_tying_matches_peft(tmp_path, tied_dir, prompts):
    """PEFT then runs the lm_head with the embedding's LoRA, transposed."""
    import peft.tuners.lora.config as lora_config

    if "ensure_weight_tying" not in lora_config.LoraConfig.__dataclass_fields__:
        pytest.skip("this PEFT has no ensure_weight_tying")
    adapters = {
        "tied_embed": make_peft_adapter(tied_dir, tmp_path / "e", r=8, alpha=8, seed=3,
                                        target_modules=("embed_tokens", "q_proj"), scale=0.3,
                                        ensure_weight_tying=True),
        "tied_all": make_peft_adapter(tied_dir, tmp_path / "a", r=4, alpha=8, seed=4,
                                      target_modules=TARGETS["all"], scale=0.3,
                                      ensure_weight_tying=True),
    }
    _check_mixed_batch(tied_dir, adapters, prompts[:2])


def test_prompt_logprobs_use_the_lm_head_lora(tmp_path, llama_dir, prompts):
    from test_prompt_logprobs import check_against, hf_prompt_logprobs

    adapter = make_peft_adapter(llama_dir, tmp_path / "lm", r=8, alpha=16, seed=8,
                                target_modules=("embed_tokens", "lm_head"), scale=0.3)
    llm = LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    prompt = prompts[3]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, params,
                        [LoRARequest("lm", 1, adapter), None])
    check_against(hf_prompt_logprobs(llama_dir, adapter, prompt), prompt,
                  outs[0].prompt_logprobs, k=3)
    check_against(hf_prompt_logprobs(llama_dir, None, prompt), prompt,
                  outs[1].prompt_logprobs, k=3)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_fp32_matches_peft(tmp_path, llama_dir, tied_dir, prompts, enforce_eager):
    """The Triton kernels, and with CUDA graphs the decode steps' replays."""
    engine = dict(device="cuda", dtype="float32", enforce_eager=enforce_eager,
                  max_num_seqs=16, kv_cache_memory_bytes=1 << 28)
    _check_mixed_batch(llama_dir, _adapters(llama_dir, tmp_path / "untied"), prompts[:2],
                       **engine)
    _check_mixed_batch(tied_dir, _adapters(tied_dir, tmp_path / "tied"), prompts[2:], **engine)


def _edit_adapter(adapter: str, edit) -> None:
    path = f"{adapter}/adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize("case", ["resized", "retrained", "new_embeddings", "token_indices"])
def test_vocabulary_changes_are_refused(tmp_path, llama_dir, case):
    adapter = make_peft_adapter(llama_dir, tmp_path / case, r=4, alpha=8,
                                target_modules=("embed_tokens", "lm_head"))
    key = "base_model.model.model.embed_tokens.base_layer.weight"
    if case == "resized":
        _edit_adapter(adapter, lambda t: t.update({key: torch.cat([t[key], t[key][:2]])}))
        want = "added tokens"
    elif case == "retrained":
        _edit_adapter(adapter, lambda t: t.update({key: t[key] + 1.0}))
        want = "differs from the base model"
    elif case == "new_embeddings":
        save_file({"input_embeddings": torch.zeros(2, 64)},
                  f"{adapter}/new_embeddings.safetensors")
        want = "adds tokens"
    else:
        config_path = tmp_path / case / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["trainable_token_indices"] = [3, 4]
        config_path.write_text(json.dumps(config))
        want = "trainable_token_indices"
    llm = LLM(llama_dir, enable_lora=True, max_lora_rank=8)
    with pytest.raises(LoRAError, match=want):
        llm.engine.executor.driver.loras.load(LoRARequest(case, 1, adapter))


def test_triton_embedding_op_matches_torch():
    """The GPU path's op (gather, then the LoRA kernels with an identity A), run
    here by the Triton interpreter, against the plain torch wrapper."""
    pytest.importorskip("triton")
    from loraserve.kernels.lora_meta import build_lora_metadata
    from loraserve.lora.punica import TorchPunicaWrapper
    from loraserve.lora.punica_triton import add_lora_embedding

    gen = torch.Generator().manual_seed(0)
    slots, vocab, hidden, rank = 3, 50, 32, 8
    a_t = torch.randn(slots, vocab, rank, generator=gen)
    b = torch.randn(slots, hidden, rank, generator=gen)
    ids = torch.randint(0, vocab, (9,), generator=gen)
    token_slots = [0, 0, -1, 2, 1, -1, 2, 2, 0]
    y0 = torch.randn(9, hidden, generator=gen)
    want = y0.clone()
    torch_punica = TorchPunicaWrapper(16, slots, torch.device("cpu"))
    torch_punica.update_mapping(token_slots)
    torch_punica.add_lora_embedding(want, ids, a_t, b)
    got = y0.clone()
    slots_t = torch.tensor(token_slots, dtype=torch.int32)
    eye = torch.eye(rank).expand(slots, rank, rank).contiguous()
    add_lora_embedding(got, ids, a_t, b, slots_t, eye, build_lora_metadata(slots_t, slots))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[[2, 5]], y0[[2, 5]])  # rows without an adapter untouched
