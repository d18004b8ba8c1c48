"""The errors a bad adapter raises: they name the adapter and the reason."""

from loraserve.config import SUPPORTED_LORA_RANKS


class LoRAError(ValueError):
    def __init__(self, lora_name: str, reason: str) -> None:
        super().__init__(f"LoRA adapter {lora_name!r}: {reason}")
        self.lora_name = lora_name
        self.reason = reason


class LoRANotFoundError(LoRAError):
    """Nothing that could be an adapter at the path given: no such directory, no
    adapter_config.json in it, no such Hugging Face Hub repo. The API answers it
    with 404, as vLLM does, and every other LoRAError with 400."""

    def __init__(self, lora_name: str, lora_path: str, detail: str) -> None:
        super().__init__(lora_name, f"No adapter found for {lora_path}: {detail}")
        # vLLM's wording, which clients match on.
        self.args = (f"Loading lora {lora_name} failed: No adapter found for {lora_path} "
                     f"({detail})",)
        self.lora_path = lora_path


def rank_too_large(lora_name: str, rank: int, max_lora_rank: int, where: str = "") -> LoRAError:
    """The error for an adapter whose rank (from `where`, if given) exceeds the slots'
    width, with the --max-lora-rank that would serve it."""
    fits = next((r for r in SUPPORTED_LORA_RANKS if r >= rank), rank)
    return LoRAError(lora_name, f"LoRA rank {rank} is greater than max_lora_rank "
                     f"{max_lora_rank}{f' ({where})' if where else ''}; start the server with "
                     f"--max-lora-rank {fits} or more")
