"""The per-request description of a LoRA adapter."""

from __future__ import annotations

import re

import msgspec

# Adapter names the server answers to (--lora-modules, /v1/load_lora_adapter, the
# names resolvers are asked about): they become metric labels and log lines, so
# their size is bounded, and the characters are those of Hub repo ids and paths
# ("org/adapter-v1.2") plus `:@+` for tags and versions.
MAX_LORA_NAME_LEN = 255
_LORA_NAME_RE = re.compile(r"[A-Za-z0-9._\-/:@+]+")
LORA_NAME_RULE = (f"up to {MAX_LORA_NAME_LEN} characters, each an ASCII letter, a digit or one "
                  "of . _ - / : @ +")


def lora_name_error(name: str) -> str | None:
    """Why `name` cannot be an adapter's name, or None when it can."""
    if len(name) > MAX_LORA_NAME_LEN:
        return f"adapter names are {LORA_NAME_RULE}; this one has {len(name)} characters"
    if not _LORA_NAME_RE.fullmatch(name):
        return f"adapter names are {LORA_NAME_RULE}; {name!r} is not"
    return None


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
