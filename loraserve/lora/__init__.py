"""LoRA: requests, PEFT parsing, adapter tensors, caches and layer wrappers."""
