"""Make the benchmark setup with no download: a Llama-3-8B-shaped model directory
(config.json + a tokenizer; weights come from `--load-format dummy`) and N random
rank-R PEFT adapters over all seven projections.

    python benchmarks/make_bench_setup.py --out /tmp/bench --num-adapters 32 --rank 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

PROJECTIONS = {
    # name: (in_features, out_features) for the Llama-3-8B shape
    "self_attn.q_proj": (4096, 4096),
    "self_attn.k_proj": (4096, 1024),
    "self_attn.v_proj": (4096, 1024),
    "self_attn.o_proj": (4096, 4096),
    "mlp.gate_proj": (4096, 14336),
    "mlp.up_proj": (4096, 14336),
    "mlp.down_proj": (14336, 4096),
}

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


def write_model(out: Path, num_layers: int) -> Path:
    model_dir = out / "llama3-8b-shape"
    model_dir.mkdir(parents=True, exist_ok=True)
    config = dict(LLAMA3_8B, num_hidden_layers=num_layers)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
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


def write_adapter(path: Path, rank: int, num_layers: int, seed: int) -> None:
    """The files PEFT writes for a LoRA over all seven projections."""
    path.mkdir(parents=True, exist_ok=True)
    # Drawn on the GPU when there is one: 32 adapters of 44M numbers each.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for name, (k, n) in PROJECTIONS.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            a = torch.randn(rank, k, generator=gen, device=device) / k**0.5
            b = torch.randn(n, rank, generator=gen, device=device) * 0.01
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).cpu()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "target_modules": [n.split(".")[-1] for n in PROJECTIONS],
        "base_model_name_or_path": "llama3-8b-shape",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--num-adapters", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=32)
    args = parser.parse_args()
    model_dir = write_model(args.out, args.num_layers)
    for i in range(args.num_adapters):
        write_adapter(args.out / "adapters" / f"lora{i}", args.rank, args.num_layers, seed=i)
    print(json.dumps({"model": str(model_dir), "adapters": str(args.out / "adapters")}))


if __name__ == "__main__":
    main()
