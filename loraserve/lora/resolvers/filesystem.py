"""Resolve adapter names to folders under LORASERVE_LORA_RESOLVER_CACHE_DIR (or vLLM's
VLLM_LORA_RESOLVER_CACHE_DIR).

The name ``sql`` is ``<cache_dir>/sql``, and a Hub-style name ``org/sql`` is
``<cache_dir>/org/sql``, so a cache laid out by repo id serves requests that name
the repo.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from loraserve import envs
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolver

ENV_CACHE_DIR = envs.LORA_RESOLVER_CACHE_DIR.name


def is_lora_dir(path: Path) -> bool:
    """True when path holds a PEFT LoRA adapter (adapter_config.json says LORA)."""
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        return False
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("peft_type", "LORA") == "LORA"


def adapter_request(lora_name: str, path: Path, base_model_name: str) -> LoRARequest | None:
    """The request for the adapter in path, or None when path holds no LoRA adapter."""
    if not is_lora_dir(path):
        return None
    return LoRARequest(
        lora_name=lora_name,
        lora_int_id=1,
        lora_path=str(path),
        base_model_name=base_model_name,
    )


class FilesystemResolver(LoRAResolver):
    """``<cache_dir>/<lora_name>/`` is the adapter called lora_name."""

    def __init__(self, cache_dir: str | os.PathLike) -> None:
        self.cache_dir = Path(cache_dir).resolve()

    def adapter_dir(self, lora_name: str) -> Path | None:
        """The folder the name stands for, or None for a name that is not a plain
        relative path inside the cache folder."""
        parts = lora_name.split("/")
        # "..", "." and empty parts would give one folder several names, or reach
        # outside the cache ("../x", "/etc").
        if any(part in ("", ".", "..") for part in parts):
            return None
        candidate = self.cache_dir.joinpath(*parts).resolve()
        # A symlink inside the cache may still point out of it.
        if not candidate.is_relative_to(self.cache_dir) or candidate == self.cache_dir:
            return None
        return candidate

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        candidate = self.adapter_dir(lora_name)
        if candidate is None:
            return None
        return adapter_request(lora_name, candidate, base_model_name)


def create_resolver() -> FilesystemResolver | None:
    """Entry point: active only when the cache folder is configured and exists."""
    cache_dir = envs.LORA_RESOLVER_CACHE_DIR.get()
    if not cache_dir:
        return None
    if not Path(cache_dir).is_dir():
        raise ValueError(f"{envs.LORA_RESOLVER_CACHE_DIR.source()}={cache_dir!r} is not a "
                         "directory")
    return FilesystemResolver(cache_dir)
