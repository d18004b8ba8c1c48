"""Builders for tests: tiny random-weight models, a trained tokenizer, PEFT adapters,
and the transformers+PEFT greedy reference that our outputs must match."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! LoRA adapters let one base model serve many tasks.",
    "Paged attention keeps the key value cache in fixed size blocks.",
    "Once upon a time there was a tiny model that learned to count: 1 2 3 4 5.",
    "What is the capital of France? Paris is the capital of France.",
    "user assistant system: please answer briefly and politely.",
]


def make_tokenizer(out_dir: str | Path, vocab_size: int = 384):
    """Train a small byte-level BPE tokenizer and save it in transformers' format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    tie_word_embeddings: bool = False,
    seed: int = 0,
    num_layers: int = 2,
    rope_scaling: dict | None = None,
    num_kv_heads: int = 2,
) -> str:
    """A tiny random-weight model of `arch` (llama, mistral, qwen2, qwen3) with a tokenizer."""
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out_dir)
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rms_norm_eps=1e-5,
    )
    if arch == "llama":
        config = LlamaConfig(**common, rope_scaling=rope_scaling)
    elif arch == "mistral":
        config = MistralConfig(**common, sliding_window=None)
    elif arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=16, use_sliding_window=False)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init gives near-uniform logits; larger weights give decisive, varied
    # greedy paths so that a wrong LoRA or cache bug changes the tokens.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 if "embed" in name or "lm_head" in name else 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return str(out_dir)


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    r: int = 8,
    alpha: float = 16,
    target_modules: tuple[str, ...] | list[str] | str = ALL_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
    rank_pattern: dict | None = None,
    alpha_pattern: dict | None = None,
    scale: float = 0.1,
    ensure_weight_tying: bool = False,
) -> str:
    """Make a PEFT LoRA adapter with random A and B (B is zero at PEFT init, which
    would make every adapter a no-op) and save it the way PEFT does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(target_modules) if not isinstance(target_modules, str)
        else target_modules,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        # Passed only when set: older PEFT releases lack the field.
        **({"ensure_weight_tying": True} if ensure_weight_tying else {}),
    )
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # lora_A/lora_B of linear layers, lora_embedding_A/B of embeddings.
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def hf_greedy(
    model_dir: str | Path,
    adapter_dir: str | Path | None,
    prompt_token_ids: list[int],
    max_new_tokens: int,
    process=None,
) -> list[int]:
    """transformers(+PEFT) greedy decoding in fp32: the reference. ``process``, if
    given, turns each step's logits (1-D, fp32) and the tokens generated so far
    into the logits the argmax is taken of."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    # A plain argmax loop rather than generate(): generate's min_new_tokens would
    # mask EOS, while our ignore_eos only keeps going after it.
    ids = torch.tensor([prompt_token_ids])
    past = None
    out: list[int] = []
    with torch.no_grad():
        step_ids = ids
        for _ in range(max_new_tokens):
            res = model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1].float()
            if process is not None:
                logits = process(logits.clone(), list(out))
            token = int(logits.argmax())
            out.append(token)
            step_ids = torch.tensor([[token]])
    return out


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def bad_word_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad words, written out for the tests: each word
    without its leading spaces, and after a space where the space joins its first
    token (the same number of tokens, another first token)."""
    found = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        found.append(alone)
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            found.append(spaced)
    return found


def clean_word(tokenizer, token_ids: list[int], length: int) -> tuple[str, list[int]]:
    """A word of `length` tokens from a generated text that a bad word (or a stop
    string) can be checked against: whole characters (a random model's text is
    mostly stray bytes), and a bad word whose tokens are those `length` tokens."""
    for i in range(len(token_ids) - length + 1):
        window = token_ids[i:i + length]
        text = tokenizer.decode(window)
        if "\ufffd" not in text and text.strip() \
                and not set(window) & set(tokenizer.all_special_ids) \
                and window in bad_word_ids(tokenizer, [text]):
            return text, window
    raise AssertionError(f"no clean {length}-token word in {token_ids}")


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))
