"""adapter_config.json: PEFT's description of a LoRA adapter, read and checked
(rank, alpha and their per-module patterns, the features loraserve refuses)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from loraserve.lora.errors import LoRAError, LoRANotFoundError, rank_too_large

CONFIG_FILE = "adapter_config.json"


@dataclass
class PeftConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: list[str] | str | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    # PEFT then ties the lm_head LoRA of a tied-embedding model to the embedding's.
    ensure_weight_tying: bool = False

    def alpha_for(self, module_key: str) -> float:
        key = _pattern_key(self.alpha_pattern, module_key)
        return float(self.alpha_pattern[key]) if key is not None else float(self.lora_alpha)

    def rank_for(self, module_key: str) -> int:
        key = _pattern_key(self.rank_pattern, module_key)
        return int(self.rank_pattern[key]) if key is not None else int(self.r)

    def scaling(self, module_key: str, rank: int) -> float:
        alpha = self.alpha_for(module_key)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _pattern_key(patterns: dict, module_key: str) -> str | None:
    # PEFT matches a pattern against the module's full name or any dotted suffix.
    for pattern in patterns:
        if pattern == module_key or re.fullmatch(rf"(.*\.)?(?:{pattern})", module_key):
            return pattern
    return None


def read_peft_config(lora_name: str, adapter_dir: str) -> PeftConfig:
    config_path = Path(adapter_dir) / CONFIG_FILE
    if not config_path.exists():
        raise LoRANotFoundError(lora_name, adapter_dir, f"{CONFIG_FILE} is missing in it")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise LoRAError(lora_name, f"{CONFIG_FILE} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise LoRAError(lora_name, f"{CONFIG_FILE} must hold a JSON object (PEFT's config), "
                        f"not {_json_kind(raw)}")
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(lora_name, f"peft_type {peft_type!r} is not a LoRA adapter")
    if raw.get("use_dora"):
        raise LoRAError(lora_name, "loraserve does not yet support DoRA (use_dora)")
    if raw.get("modules_to_save"):
        raise LoRAError(
            lora_name, "loraserve only supports modules_to_save being None; the adapter has "
            f"{raw['modules_to_save']} (full layer copies)"
        )
    if raw.get("bias", "none") != "none":
        # Trained biases would change the base model's layers, not add a LoRA delta.
        raise LoRAError(
            lora_name, f"Adapter bias cannot be used (bias={raw['bias']!r} in {CONFIG_FILE}); "
            "loraserve supports bias 'none' only"
        )
    if raw.get("trainable_token_indices"):
        raise LoRAError(
            lora_name, "loraserve does not support trainable_token_indices (trained rows of "
            "the embedding)"
        )
    for key in ("r", "lora_alpha"):
        # PEFT always writes both; guessing a missing alpha would scale the adapter
        # by a factor nobody chose.
        if key not in raw:
            raise LoRAError(lora_name, f"{CONFIG_FILE} has no {key!r}")
    alpha = raw["lora_alpha"]
    if not _is_number(alpha) or not math.isfinite(alpha):
        raise LoRAError(lora_name, f"{CONFIG_FILE}: 'lora_alpha' must be a number, got {alpha!r}")
    return PeftConfig(
        r=_positive_int(lora_name, "'r'", raw["r"]),
        lora_alpha=float(alpha),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=raw.get("target_modules"),
        rank_pattern={
            pattern: _positive_int(lora_name, f"rank_pattern[{pattern!r}]", rank)
            for pattern, rank in dict(raw.get("rank_pattern") or {}).items()
        },
        alpha_pattern=dict(raw.get("alpha_pattern") or {}),
        ensure_weight_tying=bool(raw.get("ensure_weight_tying", False)),
    )


def _json_kind(value: object) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return "a number"


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive_int(lora_name: str, what: str, value: object) -> int:
    if _is_number(value) and float(value).is_integer() and value >= 1:
        return int(value)
    raise LoRAError(lora_name, f"{CONFIG_FILE}: {what} must be a positive integer, got {value!r}")


def check_config_rank(name: str, config: PeftConfig, max_lora_rank: int) -> None:
    """The ranks the config declares must fit, not only the tensors' ranks: an `r`
    above the limit with smaller tensors is an adapter that does not match its
    own config."""
    ranks = {"r": config.r}
    for pattern, rank in config.rank_pattern.items():
        ranks[f"rank_pattern[{pattern!r}]"] = rank
    for field_name, rank in ranks.items():
        if rank > max_lora_rank:
            raise rank_too_large(name, rank, max_lora_rank, f"{field_name} in {CONFIG_FILE}")
