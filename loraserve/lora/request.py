"""The per-request description of a LoRA adapter."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, omit_defaults=True, array_like=True):
    """Selects one adapter for a request.

    ``lora_int_id`` must be > 0 and unique per adapter. Two requests are the same
    adapter when their names match: equality and hash use the name only, so the
    same adapter sent twice with different ids is deduplicated by name.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
