"""Engine configuration: one object, validated once, passed down to every part."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use auto or one of {sorted(_DTYPES)}") from None


# NONE: every step eager (as --enforce-eager). FULL_DECODE_ONLY: decode steps replay
# whole-step graphs, the others run eagerly. FULL_AND_PIECEWISE: the others replay
# piecewise graphs, attention eager between the pieces.
CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


@dataclass
class ModelConfig:
    model: str  # local directory with config.json and weights
    tokenizer: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    load_format: str = "auto"
    served_model_name: str = ""
    # Passed to transformers' AutoConfig and AutoTokenizer (a tokenizer may ship its
    # own code); the model itself always runs loraserve's implementation.
    trust_remote_code: bool = False


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory at start-up
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    # Reuse the KV blocks of a prompt prefix that an earlier request computed.
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass
class LoRAConfig:
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    lora_dtype: torch.dtype = torch.float32
    target_modules: list[str] | None = None
    # Under tensor parallelism, also split A of column-parallel layers and B of
    # row-parallel ones (see loraserve/lora/parallel_layers.py).
    fully_sharded_loras: bool = False


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    lora_config: LoRAConfig | None
    device: torch.device
    enforce_eager: bool = False
    # CUDA graphs: also capture a no-LoRA set (see worker/cuda_graphs.py).
    specialize_active_lora: bool = False
    # Which steps replay CUDA graphs: decode steps only, or also the others
    # through piecewise graphs (see worker/piecewise_graphs.py).
    cudagraph_mode: str = "FULL_DECODE_ONLY"
    # Schedule and launch step N+1 before reading step N's tokens back, so host
    # work overlaps the device (see engine/engine_core.py).
    async_scheduling: bool = True
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_kwargs(
        cls,
        model: str,
        tokenizer: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = False,
        load_format: str = "auto",
        served_model_name: str | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        lora_dtype: str = "auto",
        lora_target_modules: list[str] | None = None,
        specialize_active_lora: bool = False,
        cudagraph_mode: str = "FULL_DECODE_ONLY",
        async_scheduling: bool = True,
        trust_remote_code: bool = False,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        download_dir: str | None = None,
        enable_prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        fully_sharded_loras: bool = False,
    ) -> EngineConfig:
        """Build and validate a config from vLLM-style keyword arguments."""
        from transformers import AutoConfig

        from loraserve.model.registry import check_architecture

        model_path = resolve_model_path(model, revision, download_dir, "revision")
        tokenizer_path = model_path
        if tokenizer:
            tokenizer_path = resolve_model_path(tokenizer, tokenizer_revision, download_dir,
                                                "tokenizer_revision")
        elif tokenizer_revision is not None and tokenizer_revision != revision:
            # The tokenizer is the model's files: another revision of them is a download.
            tokenizer_path = resolve_model_path(model, tokenizer_revision, download_dir,
                                                "tokenizer_revision")
        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        check_architecture(hf_config)

        dev = resolve_device(device)
        model_dtype = resolve_model_dtype(dtype, hf_config, dev)

        max_pos = getattr(hf_config, "max_position_embeddings", None) or 2048
        if max_model_len is None:
            max_model_len = max_pos
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if max_model_len > max_pos:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's "
                f"max_position_embeddings {max_pos}"
            )
        if max_num_seqs is None:
            max_num_seqs = 256 if dev.type == "cuda" else 32
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 8192 if dev.type == "cuda" else 2048
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        cudagraph_mode = cudagraph_mode.upper()
        if cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, "
                             f"not {cudagraph_mode!r}")
        if cudagraph_mode == "NONE":
            enforce_eager = True
        if load_format not in ("auto", "dummy", "safetensors"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, not {load_format!r}")

        _check_tensor_parallel(tensor_parallel_size, hf_config, dev)
        if fully_sharded_loras and not enable_lora:
            raise ValueError("fully_sharded_loras was given without enable_lora")
        if fully_sharded_loras and max_lora_rank % tensor_parallel_size:
            raise ValueError(
                f"fully_sharded_loras splits the LoRA rank over the ranks: max_lora_rank "
                f"{max_lora_rank} is not a multiple of tensor_parallel_size "
                f"{tensor_parallel_size}"
            )
        lora_config = None
        if enable_lora:
            if max_lora_rank not in SUPPORTED_LORA_RANKS:
                raise ValueError(
                    f"max_lora_rank {max_lora_rank} is not supported; use one of "
                    f"{list(SUPPORTED_LORA_RANKS)}"
                )
            if max_loras < 1:
                raise ValueError(f"max_loras must be >= 1, got {max_loras}")
            if max_cpu_loras is None:
                max_cpu_loras = max_loras
            if max_cpu_loras < max_loras:
                raise ValueError(
                    f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})"
                )
            lora_config = LoRAConfig(
                max_loras=max_loras,
                max_lora_rank=max_lora_rank,
                max_cpu_loras=max_cpu_loras,
                lora_dtype=model_dtype if lora_dtype == "auto" else parse_dtype(lora_dtype),
                target_modules=list(lora_target_modules) if lora_target_modules else None,
                fully_sharded_loras=fully_sharded_loras,
            )
        elif max_cpu_loras is not None or lora_target_modules:
            raise ValueError("LoRA options were given without enable_lora")

        return cls(
            model_config=ModelConfig(
                model=model_path,
                tokenizer=tokenizer_path,
                hf_config=hf_config,
                dtype=model_dtype,
                max_model_len=max_model_len,
                seed=seed,
                load_format=load_format,
                served_model_name=served_model_name or model,
                trust_remote_code=trust_remote_code,
            ),
            cache_config=CacheConfig(
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
            lora_config=lora_config,
            device=dev,
            enforce_eager=enforce_eager,
            specialize_active_lora=specialize_active_lora,
            cudagraph_mode=cudagraph_mode,
            async_scheduling=async_scheduling,
            parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        )


def _check_tensor_parallel(size: int, hf_config: Any, device: torch.device) -> None:
    from loraserve.model.llama import check_tensor_parallel

    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if size == 1:
        return
    from loraserve.model.registry import MOE_ARCHITECTURES, check_architecture

    arch = check_architecture(hf_config)
    if arch in MOE_ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size {size}: tensor parallelism is not supported "
                         f"for MoE models ({arch})")
    check_tensor_parallel(hf_config, size)
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ValueError("with tensor parallelism the ranks use cuda:0 .. cuda:N-1; "
                             f"give device cuda, not {device}")
        if torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; torch sees "
                             f"{torch.cuda.device_count()}")


def resolve_model_path(
    model: str,
    revision: str | None = None,
    download_dir: str | None = None,
    revision_name: str = "revision",
) -> str:
    """A local directory, a built-in model name, or a Hugging Face Hub repo id.

    `revision` (a branch, tag or commit) and `download_dir` (the Hub cache to use)
    apply to a Hub repo only. A revision for a local folder or a built-in model
    would be ignored, so it is refused rather than let the user think it applies."""
    from loraserve.model.builtin import builtin_model, resolve_builtin_model

    is_dir = os.path.isdir(model)
    if revision is not None and (is_dir or builtin_model(model) is not None):
        kind = "a local folder" if is_dir else "a built-in model"
        raise ValueError(
            f"{revision_name} {revision!r} applies to Hugging Face Hub repo ids only; "
            f"{model!r} is {kind}"
        )
    local = model if is_dir else resolve_builtin_model(model)
    if local is not None:
        return local
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 allow_patterns=["*.json", "*.safetensors", "*.model",
                                                 "*.txt", "*.jinja", "*.py"])
    except Exception as e:
        at = f" at revision {revision!r}" if revision is not None else ""
        raise ValueError(
            f"model {model!r} is neither a local directory nor a built-in model, and "
            f"fetching it{at} from the Hugging Face Hub failed: {e}"
        ) from e


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be auto, cuda or cpu, not {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but torch sees no CUDA device")
    return torch.device(device)


def resolve_model_dtype(dtype: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return parse_dtype(dtype)
    if device.type == "cpu":
        # Half precision matmuls are slow on most CPUs and fp32 is our reference.
        return torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    config_dtype = parse_dtype(config_dtype) if isinstance(config_dtype, str) else config_dtype
    if config_dtype in (None, torch.float32):
        return torch.bfloat16
    return config_dtype
