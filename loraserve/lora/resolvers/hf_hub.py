"""Resolve adapter names to Hugging Face Hub repos from an allow-list.

LORASERVE_LORA_RESOLVER_HF_REPO_LIST is a comma-separated list of repo ids. The
name ``<repo>`` is the adapter at the root of an allowed repo, and
``<repo>/<folder>`` the adapter in one folder of it. Nothing outside the list is
ever downloaded.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from loraserve import envs
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolver
from loraserve.lora.resolvers.filesystem import adapter_request

logger = logging.getLogger(__name__)

ENV_REPO_LIST = envs.LORA_RESOLVER_HF_REPO_LIST.name


def _download(repo_id: str, subfolder: str) -> str:
    from huggingface_hub import snapshot_download

    patterns = [f"{subfolder}/*"] if subfolder else None
    return snapshot_download(repo_id=repo_id, allow_patterns=patterns)


class HFHubResolver(LoRAResolver):
    def __init__(self, repos: list[str]) -> None:
        self.repos = repos

    def _split(self, lora_name: str) -> tuple[str, str] | None:
        # The longest allowed repo id that prefixes the name wins.
        for repo in sorted(self.repos, key=len, reverse=True):
            if lora_name == repo:
                return repo, ""
            if lora_name.startswith(repo + "/"):
                subfolder = lora_name[len(repo) + 1 :].strip("/")
                if ".." in subfolder.split("/"):
                    return None
                return repo, subfolder
        return None

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        split = self._split(lora_name)
        if split is None:
            return None
        repo, subfolder = split
        try:
            local = await asyncio.to_thread(_download, repo, subfolder)
        except Exception as exc:  # noqa: BLE001 - an unreachable hub means "not found"
            logger.warning("could not download LoRA adapter %r from %r: %s", lora_name, repo, exc)
            return None
        path = Path(local) / subfolder if subfolder else Path(local)
        return adapter_request(lora_name, path, base_model_name)


def create_resolver() -> HFHubResolver | None:
    """Entry point: active only when the allow-list is set."""
    repos = [r.strip() for r in envs.LORA_RESOLVER_HF_REPO_LIST.get().split(",") if r.strip()]
    return HFHubResolver(repos) if repos else None
