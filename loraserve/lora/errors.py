"""The error every bad adapter raises: it names the adapter and the reason."""


class LoRAError(ValueError):
    def __init__(self, lora_name: str, reason: str) -> None:
        super().__init__(f"LoRA adapter {lora_name!r}: {reason}")
        self.lora_name = lora_name
        self.reason = reason
