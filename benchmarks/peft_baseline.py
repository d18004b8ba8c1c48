"""The offline workload of offline.py through transformers+PEFT: `generate` with
`adapter_names` per row, base vs LoRA, for a side-by-side speed-up.

    python -m benchmarks.peft_baseline --model /tmp/bench/llama3-8b-shape \
        --adapters /tmp/bench/adapters --num-adapters 32 --num-requests 256 \
        --input-len 512 --output-len 128 --batch-size 64 --json peft.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.results import command, finish_report, machine
from benchmarks.workload import adapter_names, make_prompts


def generate(model, prompts, output_len: int, batch_size: int, adapter_names=None) -> dict:
    device = next(model.parameters()).device
    total = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        ids = torch.tensor([p["prompt_token_ids"] for p in batch], device=device)
        kwargs = {}
        if adapter_names is not None:
            kwargs["adapter_names"] = adapter_names[i:i + batch_size]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False, pad_token_id=0, **kwargs)
        total += (out.shape[1] - ids.shape[1]) * out.shape[0]
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": total, "output_tok_per_s": total / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--adapters", type=Path, help="folder of PEFT adapter folders")
    p.add_argument("--num-adapters", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--no-lora", action="store_true", help="run the base model only")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if not args.no_lora and args.adapters is None:
        p.error("--adapters is required unless --no-lora")

    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = AutoConfig.from_pretrained(args.model)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    vocab = config.vocab_size
    prompts = make_prompts(args.num_requests, args.input_len, vocab)
    generate(model, prompts[:2], 4, 2)  # warm-up
    results = {"command": command(), "machine": machine(),
               "base": generate(model, prompts, args.output_len, args.batch_size)}
    if args.no_lora:
        finish_report(results, args.json)
        return

    names = adapter_names(args.adapters, args.num_adapters)
    model = PeftModel.from_pretrained(model, str(args.adapters / names[0]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(args.adapters / name), adapter_name=name)
    model.to(dtype)
    per_prompt = [names[i % len(names)] for i in range(len(prompts))]
    generate(model, prompts[:2], 4, 2, per_prompt[:2])
    results["lora"] = generate(model, prompts, args.output_len, args.batch_size, per_prompt)
    finish_report(results, args.json)


if __name__ == "__main__":
    main()
