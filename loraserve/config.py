"""Engine configuration: one object, validated once, passed down to every part."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from loraserve.options import (
    OptionError,
    is_set,
    lora_only,
    option,
    positive_int,
    positive_int_or_auto,
)

# The orders the scheduler can start waiting requests in (engine/scheduler.py).
SCHEDULING_POLICIES = ("fcfs", "priority")
# How new adapters get device slots when adapters outnumber them
# (engine/lora_admission.py).
LORA_SCHEDULING_POLICIES = ("fcfs", "slot-aware")
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
    # fcfs or priority (see engine/scheduler.py).
    policy: str = "fcfs"


@dataclass
class LoRAConfig:
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1  # 0: as many as max_loras, once auto has decided it
    # --max-loras auto: the worker sizes the slots from device memory at start-up
    # (loraserve/lora/slot_memory.py) and max_loras is its decision from then on.
    auto_max_loras: bool = False
    lora_dtype: torch.dtype = torch.float32
    target_modules: list[str] | None = None
    # Under tensor parallelism, also split A of column-parallel layers and B of
    # row-parallel ones (see loraserve/lora/parallel_layers.py).
    fully_sharded_loras: bool = False
    # Which new adapters take free device slots (engine/lora_admission.py).
    scheduling: str = "slot-aware"
    max_wait_steps: int = 32


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1


# Structured-output backends: "auto" is vLLM's default and means xgrammar here, the
# one backend loraserve has.
STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar")


@dataclass
class StructuredOutputsConfig:
    """vLLM's structured-outputs config (--structured-outputs-config): the backend
    and the defaults every request's grammar gets."""

    backend: str = "auto"
    # No whitespace between JSON tokens, for every request.
    disable_any_whitespace: bool = False
    # Accepted for vLLM's configs: xgrammar never falls back to another backend, and
    # already allows no property that a schema does not name.
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    # vLLM's reasoning-parser settings; loraserve has no reasoning parsers, so the
    # grammar applies from the first generated token.
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise OptionError(
                "{structured_outputs_config}: backend {value!r} is not supported; loraserve's "
                "structured outputs use xgrammar (backend 'xgrammar', or 'auto' for it)",
                value=self.backend)
        if self.reasoning_parser:
            raise OptionError(
                "{structured_outputs_config}: reasoning_parser {value!r} is not supported; "
                "loraserve has no reasoning parsers", value=self.reasoning_parser)


def structured_outputs_config(value: str | dict | StructuredOutputsConfig | None,
                              backend: str | None = None) -> StructuredOutputsConfig:
    """The config from vLLM's forms: JSON text or a dict (--structured-outputs-config),
    or only a backend name (the older --guided-decoding-backend)."""
    if isinstance(value, StructuredOutputsConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise OptionError("{structured_outputs_config} must be a JSON object: {error}",
                              error=exc) from exc
    if value is not None and not isinstance(value, dict):
        raise OptionError("{structured_outputs_config} must be a JSON object, got {value!r}",
                          value=value)
    value = dict(value or {})
    if backend is not None:
        value.update(_backend_flag(backend))
    kinds = {f.name: type(f.default) for f in fields(StructuredOutputsConfig)}
    unknown = sorted(set(value) - set(kinds))
    if unknown:
        raise OptionError("{structured_outputs_config} has unknown keys {value}; known: "
                          "{known}", value=unknown, known=sorted(kinds))
    for key, item in value.items():
        if not isinstance(item, kinds[key]):
            raise OptionError("{structured_outputs_config}: {key} must be a {kind}, got {value!r}",
                              key=key, kind=kinds[key].__name__, value=item)
    return StructuredOutputsConfig(**value)


# The options vLLM's older flag took after the backend name ("xgrammar:no-fallback").
_BACKEND_FLAG_OPTIONS = {
    "disable-any-whitespace": "disable_any_whitespace",
    "no-fallback": "disable_fallback",
    "disable-additional-properties": "disable_additional_properties",
}


def _backend_flag(text: str) -> dict[str, Any]:
    """--guided-decoding-backend NAME[:OPTION,...] as config keys."""
    name, _, options = text.partition(":")
    if name.strip() not in STRUCTURED_OUTPUT_BACKENDS:
        raise OptionError("{guided_decoding_backend} {value!r} is not supported; loraserve's "
                          "structured outputs use xgrammar (xgrammar, or auto for it)",
                          value=name.strip())
    config: dict[str, Any] = {"backend": name.strip()}
    for word in filter(None, (o.strip() for o in options.split(","))):
        if word not in _BACKEND_FLAG_OPTIONS:
            raise OptionError("{guided_decoding_backend}: unknown option {value!r}; known: "
                              "{known}", value=word, known=sorted(_BACKEND_FLAG_OPTIONS))
        config[_BACKEND_FLAG_OPTIONS[word]] = True
    return config


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
    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    # Schedule and launch step N+1 before reading step N's tokens back, so host
    # work overlaps the device (see engine/engine_core.py).
    async_scheduling: bool = True
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build and validate a config from vLLM-style keyword arguments (EngineArgs')."""
        return EngineArgs(model, **kwargs).create_engine_config()


def _engine(default: Any = None, **meta: Any) -> Any:
    return option(default, group="Engine", **meta)


def _lora(default: Any = None, **meta: Any) -> Any:
    return option(default, group="LoRA", needs_lora=True, **meta)


@dataclass
class EngineArgs:
    """The engine's options as given: `loraserve serve`'s engine flags (generated
    from these fields) and the keyword arguments of LLM(...) and
    EngineConfig.from_kwargs. Checked here once, on creation; what needs the model's
    config (its length, its heads) is checked by create_engine_config."""

    model: str = option(help="Same as the positional MODEL.")
    tokenizer: str | None = _engine(help="Tokenizer folder (default: MODEL).")
    revision: str | None = _engine(
        help="Branch, tag or commit of a Hub repo MODEL (refused for a local folder or "
        "a built-in model).")
    tokenizer_revision: str | None = _engine(
        help="Branch, tag or commit of a Hub repo tokenizer (default: --revision).")
    download_dir: str | None = _engine(
        help="Hugging Face Hub cache folder to download a Hub repo MODEL or tokenizer "
        "into (default: the Hub's own cache).")
    trust_remote_code: bool = _engine(
        False, help="Let transformers run code that a model's config or tokenizer ships (a "
        "tokenizer that needs it then loads). The model always runs loraserve's own "
        "implementation: no model code from the repo runs.")
    dtype: str = _engine("auto", choices=["auto", "half", "float16", "bfloat16", "float",
                                           "float32"],
                         help="Weight and activation dtype.")
    max_model_len: int | None = _engine(
        type=positive_int, help="Context length (prompt + output); default: the model's.")
    max_num_seqs: int | None = _engine(
        type=positive_int,
        help="Most sequences per step (default: 256 on a GPU, 32 on the CPU).")
    max_num_batched_tokens: int | None = _engine(
        type=positive_int, help="Token budget per step; a longer prefill is chunked over "
        "several steps (default: 8192 on a GPU, 2048 on the CPU).")
    scheduling_policy: str = _engine(
        "fcfs", choices=list(SCHEDULING_POLICIES),
        help="The order waiting requests start in: fcfs (first come, first served) or "
        "priority (by each request's priority field, lower first, ties by arrival; when "
        "KV blocks run out, the running request of the highest priority value is "
        "preempted). With fcfs a request whose priority is not 0 is refused.")
    block_size: int = _engine(16, type=positive_int, help="KV block size.")
    gpu_memory_utilization: float = _engine(
        0.9, help="Fraction of GPU memory for weights, activations and the KV cache.")
    device: str = _engine("auto", choices=["auto", "cuda", "cpu"],
                          help="Where to run the model (auto: cuda when available).")
    enforce_eager: bool = _engine(False, help="Never use CUDA graphs.")
    cudagraph_mode: str = _engine(
        "FULL_AND_PIECEWISE", type=str.upper, choices=list(CUDAGRAPH_MODES),
        help="Which steps replay CUDA graphs: FULL_AND_PIECEWISE (default) captures decode "
        "steps whole and the other steps (prefill chunks, prefill beside decodes) per "
        "token-count bucket in pieces, with attention run eagerly between them; "
        "FULL_DECODE_ONLY captures decode steps only (a faster start, slower prefill); "
        "NONE is --enforce-eager.")
    specialize_active_lora: bool = _engine(
        False, help="Also capture CUDA graphs without the LoRA ops, for steps that use no "
        "adapter (by default one graph set serves both).")
    async_scheduling: bool = _engine(
        True, help="Schedule and launch each step before the previous step's tokens are back "
        "on the host, so scheduling overlaps the GPU (default: on). Steps with requests that "
        "use repetition, frequency or presence penalties, or bad words of more than one "
        "token, wait for them as before.")
    enable_prefix_caching: bool = _engine(
        True, help="Reuse the KV cache blocks of a prompt prefix that an earlier request "
        "(with the same adapter, or none) computed (default: on).")
    tensor_parallel_size: int = _engine(
        1, aliases=("-tp",), type=positive_int,
        help="Split the model over this many GPUs (or CPU processes), one process each: "
        "attention heads and MLP columns are sharded, the embedding and lm_head "
        "replicated (default: 1).")
    seed: int = _engine(0, help="Random seed (default: 0).")
    load_format: str = _engine(
        "auto", choices=["auto", "dummy"],
        help="dummy: random weights from the model's config, for benchmarks.")
    structured_outputs_config: str | dict | StructuredOutputsConfig | None = _engine(
        metavar="JSON", exclusive="structured_outputs",
        help="Structured outputs (response_format, structured_outputs, guided_*), as vLLM's "
        'JSON: {"backend": "xgrammar", "disable_any_whitespace": false}. The backend is '
        "xgrammar ('auto' means xgrammar; others are refused).")
    guided_decoding_backend: str | None = _engine(
        metavar="NAME", exclusive="structured_outputs",
        help="vLLM's older flag for the structured-output backend: xgrammar or auto.")

    enable_lora: bool = option(False, group="LoRA", help="Serve LoRA adapters.")
    max_loras: int | str = _lora(
        1, type=positive_int_or_auto,
        help="Most distinct adapters in one step: the device slots (default: 1). auto: as "
        "many as a tenth of the GPU memory that the weights leave holds at "
        "--max-lora-rank (at most 512 and --max-num-seqs; 8 on the CPU), logged at "
        "start-up.")
    max_lora_rank: int = _lora(16, choices=SUPPORTED_LORA_RANKS,
                               help="Largest adapter rank served (default: 16).")
    max_cpu_loras: int | None = _lora(
        type=positive_int, help="Adapters kept in CPU memory (default: --max-loras).")
    lora_dtype: str = _lora("auto", choices=["auto", "float16", "bfloat16", "float32"],
                            help="dtype of the adapter weights (default: auto, the model's).")
    lora_target_modules: list[str] | None = _lora(
        nargs="+", help="Only these modules get LoRA (default: every supported module).")
    fully_sharded_loras: bool = _lora(
        False, help="With --tensor-parallel-size > 1, also shard A of column-parallel layers "
        "and B of row-parallel ones, gathering the small rank dimension instead "
        "(default: A replicated for column-parallel layers, B for row-parallel ones).")
    lora_scheduling: str = _lora(
        "slot-aware", choices=list(LORA_SCHEDULING_POLICIES),
        help="Which waiting requests' adapters take the device slots that come free when "
        "adapters outnumber --max-loras: fcfs (vLLM's rule: in queue order, and an adapter "
        "keeps its slot while any of its requests runs) or slot-aware (default: adapters "
        "already in a slot first, and once a request has waited --max-lora-wait-steps "
        "steps for a slot, a running adapter stops taking new requests so that its slot "
        "comes free for it).")
    max_lora_wait_steps: int = _lora(
        32, type=positive_int,
        help="slot-aware: steps a request may be passed over for lack of a device slot "
        "before a running adapter is drained for it (default: 32).")

    # Not flags: for tests and benchmarks.
    num_kv_blocks: int | None = None  # None: sized from memory at start-up
    kv_cache_memory_bytes: int | None = None
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise OptionError(f"{{{name}}} must be >= 1, got {{value}}", value=value)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise OptionError("{gpu_memory_utilization} must be in (0, 1], got {value}",
                              value=self.gpu_memory_utilization)
        self.cudagraph_mode = self.cudagraph_mode.upper()
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise OptionError("{cudagraph_mode} must be one of {modes}, not {value!r}",
                              modes=", ".join(CUDAGRAPH_MODES), value=self.cudagraph_mode)
        if self.cudagraph_mode == "NONE":
            self.enforce_eager = True
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise OptionError("{scheduling_policy} must be one of {policies}, not {value!r}",
                              policies=", ".join(SCHEDULING_POLICIES),
                              value=self.scheduling_policy)
        if self.load_format not in ("auto", "dummy", "safetensors"):
            raise OptionError("{load_format} must be auto, safetensors or dummy, not {value!r}",
                              value=self.load_format)
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise OptionError("{tensor_parallel_size} must be a positive integer, got {value!r}",
                              value=size)
        if self.guided_decoding_backend is not None and self.structured_outputs_config is not None:
            raise OptionError("{guided_decoding_backend} and {structured_outputs_config} both "
                              "set the backend: give one")
        # Folded into one config, which the engine and the API server both read.
        self.structured_outputs_config = structured_outputs_config(
            self.structured_outputs_config, self.guided_decoding_backend)
        self.guided_decoding_backend = None
        self._check_lora()

    def _check_lora(self) -> None:
        if not self.enable_lora:
            # The LoRA options with a default of their own (max_loras, ...) are
            # ignored without LoRA, as in vLLM; the others would be silently lost.
            given = [f.name for f in lora_only(EngineArgs)
                     if not is_set(f.default) and is_set(getattr(self, f.name))]
            if given:
                names = ", ".join(f"{{{name}}}" for name in given)
                raise OptionError(f"{names} {'was' if len(given) == 1 else 'were'} given "
                                  "without {enable_lora}")
            return
        if self.max_lora_rank not in SUPPORTED_LORA_RANKS:
            raise OptionError("{max_lora_rank} {value} is not supported; use one of {ranks}",
                              value=self.max_lora_rank, ranks=list(SUPPORTED_LORA_RANKS))
        if self.max_loras != "auto" and (not isinstance(self.max_loras, int)
                                         or self.max_loras < 1):
            raise OptionError("{max_loras} must be auto or >= 1, got {value}",
                              value=self.max_loras)
        if self.lora_scheduling not in LORA_SCHEDULING_POLICIES:
            raise OptionError("{lora_scheduling} must be one of {policies}, not {value!r}",
                              policies=", ".join(LORA_SCHEDULING_POLICIES),
                              value=self.lora_scheduling)
        if (self.max_cpu_loras is not None and self.max_loras != "auto"
                and self.max_cpu_loras < self.max_loras):
            raise OptionError("{max_cpu_loras} ({value}) must be at least {max_loras} ({limit})",
                              value=self.max_cpu_loras, limit=self.max_loras)
        if self.fully_sharded_loras and self.max_lora_rank % self.tensor_parallel_size:
            raise OptionError(
                "{fully_sharded_loras} splits the LoRA rank over the ranks: {max_lora_rank} "
                "{rank} is not a multiple of {tensor_parallel_size} {size}",
                rank=self.max_lora_rank, size=self.tensor_parallel_size)

    def create_engine_config(self) -> EngineConfig:
        """The engine's config: the model, the tokenizer and the device resolved, and
        the rest checked against the model's config."""
        from transformers import AutoConfig

        from loraserve.model.registry import check_architecture

        model_path, tokenizer_path = self._resolve_paths()
        hf_config = AutoConfig.from_pretrained(model_path,
                                               trust_remote_code=self.trust_remote_code)
        check_architecture(hf_config)
        device = resolve_device(self.device)
        model_dtype = resolve_model_dtype(self.dtype, hf_config, device)
        max_pos = getattr(hf_config, "max_position_embeddings", None) or 2048
        max_model_len = max_pos if self.max_model_len is None else self.max_model_len
        if max_model_len > max_pos:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {max_pos}")
        _check_tensor_parallel(self.tensor_parallel_size, hf_config, device)
        on_gpu = device.type == "cuda"
        return EngineConfig(
            model_config=ModelConfig(
                model=model_path, tokenizer=tokenizer_path, hf_config=hf_config,
                dtype=model_dtype, max_model_len=max_model_len, seed=self.seed,
                load_format=self.load_format,
                served_model_name=self.served_model_name or self.model,
                trust_remote_code=self.trust_remote_code,
            ),
            cache_config=CacheConfig(
                block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs or (256 if on_gpu else 32),
                max_num_batched_tokens=self.max_num_batched_tokens or (8192 if on_gpu else 2048),
                max_model_len=max_model_len,
                policy=self.scheduling_policy,
            ),
            lora_config=self._lora_config(model_dtype),
            device=device,
            enforce_eager=self.enforce_eager,
            specialize_active_lora=self.specialize_active_lora,
            cudagraph_mode=self.cudagraph_mode,
            async_scheduling=self.async_scheduling,
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            structured_outputs_config=self.structured_outputs_config,
        )

    def _resolve_paths(self) -> tuple[str, str]:
        """The local folders of the model and of its tokenizer."""
        model_path = resolve_model_path(self.model, self.revision, self.download_dir, "revision")
        if self.tokenizer:
            return model_path, resolve_model_path(self.tokenizer, self.tokenizer_revision,
                                                  self.download_dir, "tokenizer_revision")
        if self.tokenizer_revision is not None and self.tokenizer_revision != self.revision:
            # The tokenizer is the model's files: another revision of them is a download.
            return model_path, resolve_model_path(self.model, self.tokenizer_revision,
                                                  self.download_dir, "tokenizer_revision")
        return model_path, model_path

    def _lora_config(self, model_dtype: torch.dtype) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        auto = self.max_loras == "auto"
        return LoRAConfig(
            max_loras=1 if auto else self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras or (0 if auto else self.max_loras),
            auto_max_loras=auto,
            lora_dtype=model_dtype if self.lora_dtype == "auto" else parse_dtype(self.lora_dtype),
            target_modules=list(self.lora_target_modules) if self.lora_target_modules else None,
            fully_sharded_loras=self.fully_sharded_loras,
            scheduling=self.lora_scheduling,
            max_wait_steps=self.max_lora_wait_steps,
        )


def _check_tensor_parallel(size: int, hf_config: Any, device: torch.device) -> None:
    from loraserve.model.llama import check_tensor_parallel

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
