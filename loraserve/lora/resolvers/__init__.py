"""The LoRA resolvers that ship with loraserve (filesystem and Hugging Face Hub)."""
