"""Each bad adapter gives a clear error naming it and the reason, and the engine
keeps serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from utils import make_peft_adapter

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.lora.errors import LoRAError

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16)


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _corrupt_shapes(path: Path) -> None:
    tensors = load_file(path / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 3)
    save_file(tensors, path / "adapter_model.safetensors")


def _rename_target(path: Path) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "c_attn"]
    (path / "adapter_config.json").write_text(json.dumps(config))


def _pickle_only(path: Path) -> None:
    tensors = load_file(path / "adapter_model.safetensors")
    torch.save(tensors, path / "adapter_model.bin")
    (path / "adapter_model.safetensors").unlink()


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (path / "adapter_config.json").write_text(json.dumps(config))


def _poison(path: Path, value: float, which: str = "lora_B") -> str:
    """Put `value` into one element of one tensor; returns that tensor's name."""
    tensors = load_file(path / "adapter_model.safetensors")
    key = sorted(k for k in tensors if which in k)[3]
    tensors[key][0, 0] = value
    save_file(tensors, path / "adapter_model.safetensors")
    return key


def _bad_layer(path: Path) -> None:
    tensors = load_file(path / "adapter_model.safetensors")
    key = next(k for k in tensors if "layers.0." in k)
    tensors[key.replace("layers.0.", "layers.9.")] = tensors[key].clone()
    save_file(tensors, path / "adapter_model.safetensors")


@pytest.mark.parametrize(
    "case,breaker,message",
    [
        ("shape", _corrupt_shapes, "has shape"),
        ("target", _rename_target, "c_attn"),
        ("pickle", _pickle_only, "pickle"),
        ("no_config", lambda p: (p / "adapter_config.json").unlink(), "adapter_config.json"),
        ("no_weights", lambda p: (p / "adapter_model.safetensors").unlink(),
         "adapter_model.safetensors is missing"),
        ("missing_layer", _bad_layer, "layers.9"),
        ("array_config", lambda p: (p / "adapter_config.json").write_text('[{"r": 8}]'),
         "adapter_config.json must hold a JSON object (PEFT's config), not an array"),
        ("null_config", lambda p: (p / "adapter_config.json").write_text("null"),
         "must hold a JSON object (PEFT's config), not null"),
        ("huge_alpha", lambda p: _edit_config(p, lora_alpha=1e38),
         "scaled by lora_alpha / r, overflow torch.float32 (the lora dtype) in use"),
        ("no_alpha", lambda p: _edit_config(p, lora_alpha=None), "has no 'lora_alpha'"),
        ("text_alpha", lambda p: _edit_config(p, lora_alpha="16"), "'lora_alpha' must be"),
        ("zero_r", lambda p: _edit_config(p, r=0), "'r' must be a positive integer"),
        ("big_pattern", lambda p: _edit_config(p, rank_pattern={"q_proj": 64}),
         "rank 64 is greater than max_lora_rank 16"),
    ],
)
def test_bad_adapter_is_refused_and_engine_serves(llm, llama_adapters, prompts, tmp_path,
                                                  case, breaker, message):
    path = _copy(llama_adapters["r8"], tmp_path / case)
    breaker(path)
    bad = LoRARequest(f"bad-{case}", 50, str(path))
    with pytest.raises(LoRAError) as err:
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, bad)
    assert f"bad-{case}" in str(err.value) and message in str(err.value)
    _assert_still_serves(llm, llama_adapters, prompts)


def test_rank_above_max_is_refused(llm, llama_dir, prompts, llama_adapters, tmp_path):
    path = make_peft_adapter(llama_dir, tmp_path / "r32", r=32, alpha=32)
    with pytest.raises(LoRAError, match="rank 32 is greater than max_lora_rank 16"):
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, LoRARequest("big", 60, path))
    _assert_still_serves(llm, llama_adapters, prompts)


def test_config_rank_above_max_is_refused_even_with_small_tensors(llm, llama_adapters,
                                                                 prompts, tmp_path):
    path = _copy(llama_adapters["r8"], tmp_path / "claims_r32")
    _edit_config(path, r=32)
    with pytest.raises(LoRAError, match="rank 32 is greater than max_lora_rank 16"):
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY,
                     LoRARequest("claims-r32", 61, str(path)))
    _assert_still_serves(llm, llama_adapters, prompts)


@pytest.mark.parametrize("value,which", [(float("nan"), "lora_A"), (float("inf"), "lora_B"),
                                         (float("-inf"), "lora_A")])
def test_non_finite_weights_are_refused_naming_the_tensor(llm, llama_adapters, prompts,
                                                          tmp_path, value, which):
    path = _copy(llama_adapters["r8"], tmp_path / "poisoned")
    key = _poison(path, value, which)
    with pytest.raises(LoRAError) as err:
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY,
                     LoRARequest("poisoned", 62, str(path)))
    assert "poisoned" in str(err.value) and key in str(err.value)
    assert "NaN or infinite" in str(err.value)
    assert "poisoned" not in llm.engine.executor.driver.loras.cpu_names()
    _assert_still_serves(llm, llama_adapters, prompts)


def test_weights_that_overflow_the_lora_dtype_are_refused(llm, llama_adapters, tmp_path):
    """Finite in the file, infinite once cast to float16 and scaled by alpha / r."""
    from loraserve.lora.peft_adapter import load_lora_model

    path = _copy(llama_adapters["r8"], tmp_path / "huge")
    key = _poison(path, 60000.0, "lora_B")  # float16 tops out at 65504; alpha / r = 2
    info = llm.engine.executor.driver.loras.info
    with pytest.raises(LoRAError, match="overflows torch.float16") as err:
        load_lora_model(LoRARequest("huge", 63, str(path)), info, 16, torch.float16)
    assert key in str(err.value)
    # The same file is fine in float32.
    assert load_lora_model(LoRARequest("huge", 63, str(path)), info, 16, torch.float32).modules


def test_missing_directory_and_offline_hub(llm, llama_adapters, prompts, monkeypatch):
    with pytest.raises(LoRAError, match="does not exist"):
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY,
                     LoRARequest("gone", 70, "/nonexistent/adapter"))
    # Anything that is not a local directory is a Hub repo id; offline mode must
    # fail fast with a clear error and never reach the network.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(LoRAError, match="could not be fetched from the Hugging Face Hub"):
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY,
                     LoRARequest("hub", 71, "someone/some-adapter"))
    _assert_still_serves(llm, llama_adapters, prompts)


def test_background_load_failure_fails_only_its_requests(llm, llama_adapters, prompts,
                                                         tmp_path):
    """Through the engine core (as the server uses it): a request whose adapter is
    bad ends with an error, others in the same steps complete."""
    from loraserve.engine.protocol import EngineCoreRequest, FinishReason

    engine = llm.engine
    bad = _copy(llama_adapters["r8"], tmp_path / "bad")
    _corrupt_shapes(bad)
    good = LoRARequest("r8", 1, llama_adapters["r8"])
    engine.add_request(EngineCoreRequest("ok", prompts[0], GREEDY, None, good))
    engine.add_request(EngineCoreRequest("bad", prompts[1], GREEDY, None,
                                         LoRARequest("bad-bg", 80, str(bad))))
    finished = {}
    for _ in range(200):
        for out in engine.step().outputs:
            if out.finished:
                finished[out.request_id] = out
        if len(finished) == 2:
            break
    assert finished["bad"].finish_reason == FinishReason.ERROR
    assert "bad-bg" in finished["bad"].error and "has shape" in finished["bad"].error
    assert finished["ok"].finish_reason == FinishReason.LENGTH


def _assert_still_serves(llm, llama_adapters, prompts):
    outs = llm.generate(
        [{"prompt_token_ids": prompts[1]}] * 2, GREEDY,
        [None, LoRARequest("r8", 1, llama_adapters["r8"])],
    )
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
