"""Model and adapter files made without a download: a Llama-3-8B-shaped model
directory (config.json and a tokenizer; weights come from `--load-format
dummy`) and random PEFT LoRA adapters over the projections (all seven, or some) of a
Llama-style config.

Two made-up tokenizers, both of the config's vocabulary size and both decoding any
id: "words" (one word a token, w0 .. wN) and "bytes" (byte-level, as Llama 3's:
the 256 bytes, JSON punctuation and numbers, and made-up words with and without a
leading space, some with a quote, comma, period or line break). Only "bytes" can
write JSON: structured outputs need it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection, from a Llama-style config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    q = config["num_attention_heads"] * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


TOKENIZERS = ("words", "bytes")


def write_model(out: Path, num_layers: int, tokenizer: str = "words") -> Path:
    """out/llama3-8b-shape: the Llama-3-8B config with num_layers layers, and a
    tokenizer of the kind named (TOKENIZERS)."""
    model_dir = out / "llama3-8b-shape"
    model_dir.mkdir(parents=True, exist_ok=True)
    config = dict(LLAMA3_8B, num_hidden_layers=num_layers)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer == "bytes":
        write_byte_tokenizer(model_dir, config["vocab_size"], config["bos_token_id"],
                             config["eos_token_id"])
    else:
        write_tokenizer(model_dir, config["vocab_size"])
    return model_dir


def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one made-up word per id, so any id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w128000",
                                   eos_token="w128001", unk_token="w0")
    fast.save_pretrained(str(model_dir))


# The byte-level tokenizer's tokens after the 256 bytes: JSON's punctuation and
# literals, two-digit numbers, then made-up words in these forms, in turn.
_JSON_PIECES = ['{"', '":', '": ', '",', '", "', '"}', '["', '"]', '},', '[]', '{}',
                "true", "false", "null", *(f"{k:02d}" for k in range(100))]
_WORD_FORMS = [" w{}", " w{}", " w{}", " w{}", " w{}", " w{}", "w{}", "w{}", "w{}", "w{}",
               "{}", 'w{}"', ", w{}", "w{}.", "\nw{}", '"w{}']


def write_byte_tokenizer(model_dir: Path, vocab_size: int, bos_id: int, eos_id: int) -> None:
    """A byte-level BPE tokenizer (no merges: text encodes byte by byte, and every
    id decodes) with bos and eos special tokens at the config's ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Byte-level tokens spell a space as "Ġ" and a line break as "Ċ"; the other
    # characters used here are printable ASCII, which spell themselves.
    def spelled(text: str) -> str:
        return text.replace(" ", "\u0120").replace("\n", "\u010a")

    specials = {bos_id: "<|begin_of_text|>", eos_id: "<|end_of_text|>"}
    vocab: dict[str, int] = {}
    for token in [*sorted(pre_tokenizers.ByteLevel.alphabet()), *map(spelled, _JSON_PIECES)]:
        vocab.setdefault(token, len(vocab))
    while len(vocab) < vocab_size:
        n = len(vocab)
        vocab[specials.get(n) or spelled(_WORD_FORMS[n % len(_WORD_FORMS)].format(n))] = n
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(text, special=True) for text in specials.values()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[bos_id],
                                   eos_token=specials[eos_id])
    fast.save_pretrained(str(model_dir))


def write_adapter(path: Path, config: dict, rank: int, seed: int, base_model: str,
                  dtype: torch.dtype = torch.float32, device: str = "cpu",
                  targets: tuple[str, ...] | None = None) -> None:
    """The files PEFT writes for a random LoRA over the `targets` projections (all
    seven by default) of config's layers, drawn on `device` and saved as `dtype`."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device).manual_seed(seed)
    shapes = projection_shapes(config)
    if targets is not None:
        shapes = {name: shape for name, shape in shapes.items() if name in targets}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (k, n) in shapes.items():
            part = "self_attn" if name in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            a = torch.randn(rank, k, generator=gen, device=device) / k**0.5
            b = torch.randn(n, rank, generator=gen, device=device) * 0.01
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype).cpu()
            tensors[f"{prefix}.lora_B.weight"] = b.to(dtype).cpu()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "target_modules": list(shapes),
        "base_model_name_or_path": base_model,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
