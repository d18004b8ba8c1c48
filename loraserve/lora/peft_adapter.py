"""Read a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) into
tensors laid out for our merged modules, with the scaling folded into B."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from loraserve.lora.errors import LoRAError, LoRANotFoundError, rank_too_large
from loraserve.lora.moe_adapter import ExpertsInfo, experts_path_of, load_expert_loras
from loraserve.lora.peft_config import (
    CONFIG_FILE,
    PeftConfig,
    check_config_rank,
    read_peft_config,
)
from loraserve.lora.request import LoRARequest

WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
# An embedding's LoRA: lora_embedding_A [r, vocab] and lora_embedding_B [hidden, r].
_EMBEDDING_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_embedding_(?P<ab>[AB])(?:\.[^.]+)?$"
)
# PEFT saves a copy of the base embedding / lm_head weight beside their LoRA
# (save_embedding_layers); it must equal the base model's.
_BASE_COPY_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.base_layer\.weight$")
# Added tokens (vLLM's extra vocabulary) come in this file.
_NEW_EMBEDDINGS_FILE = "new_embeddings.safetensors"


@dataclass
class ModuleLoRA:
    """One of our merged modules: per slice, A [r, K] and scaled B [N, r] (or None)."""

    lora_a: list[torch.Tensor | None]
    lora_b: list[torch.Tensor | None]

    @property
    def rank(self) -> int:
        return max((a.shape[0] for a in self.lora_a if a is not None), default=0)


@dataclass
class LoRAModel:
    name: str
    int_id: int
    path: str
    rank: int
    modules: dict[str, ModuleLoRA] = field(default_factory=dict)

    def nbytes(self) -> int:
        total = 0
        for m in self.modules.values():
            for t in (*m.lora_a, *m.lora_b):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    def pin_memory(self) -> None:
        """Page-lock the tensors: a copy from them into a device slot then runs
        without holding up the host (from pageable memory it waits for the copy)."""
        for m in self.modules.values():
            m.lora_a = [t.pin_memory() if t is not None else None for t in m.lora_a]
            m.lora_b = [t.pin_memory() if t is not None else None for t in m.lora_b]


@dataclass
class ModelLoRAInfo:
    """What the base model offers to adapters: per merged module path, its slices'
    checkpoint names, input width and output widths."""

    # e.g. "model.layers.0.self_attn.qkv_proj" -> (("q_proj","k_proj","v_proj"), K, [N...])
    modules: dict[str, tuple[tuple[str, ...], int, list[int]]]
    # checkpoint path of a projection -> (merged module path, slice index)
    by_source: dict[str, tuple[str, int]]
    projection_names: set[str]
    # MoE models: experts layer path -> its shape (loraserve.lora.moe_adapter)
    experts: dict[str, ExpertsInfo] = field(default_factory=dict)
    # Source paths of embedding layers (their LoRA is lora_embedding_A/B).
    embeddings: set[str] = field(default_factory=set)
    # Source path -> the base weight, for the layers whose copy PEFT may save.
    base_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    # (embedding, lm_head) source paths of a model whose lm_head reuses the
    # embedding matrix; None when they are separate.
    tied: tuple[str, str] | None = None

    def add_module(self, path: str, sources: tuple[str, ...] | list[str], in_features: int,
                   slice_sizes: list[int]) -> None:
        """A wrapped module adapters may target: its slices' checkpoint names, and
        the whole model's input and output widths (the shapes adapters hold)."""
        self.modules[path] = (tuple(sources), in_features, list(slice_sizes))
        parent = path.rpartition(".")[0]
        for i, source in enumerate(sources):
            self.by_source[f"{parent}.{source}" if parent else source] = (path, i)


def resolve_adapter_path(lora_request: LoRARequest) -> str:
    """A local directory is used as is; anything else is a Hugging Face Hub repo id."""
    path = lora_request.lora_path
    if not path:
        raise LoRAError(lora_request.lora_name, "no lora_path given")
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        return expanded
    if os.path.exists(expanded):
        raise LoRANotFoundError(lora_request.lora_name, path,
                                f"{path} is a file; give the adapter's directory")
    if expanded.startswith(("/", "./", "../")):
        raise LoRANotFoundError(lora_request.lora_name, path, f"directory {path} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id=path)
    except Exception as e:  # offline mode, unknown repo, network: all the same to the user
        raise LoRANotFoundError(
            lora_request.lora_name, path,
            f"{path} is not a local directory and could not be fetched from the Hugging "
            f"Face Hub ({type(e).__name__}: {e})",
        ) from e


def load_lora_model(
    lora_request: LoRARequest,
    info: ModelLoRAInfo,
    max_lora_rank: int,
    dtype: torch.dtype,
    target_modules: list[str] | None = None,
) -> LoRAModel:
    """Load, validate and scale an adapter into CPU tensors. Raises LoRAError."""
    name = lora_request.lora_name
    adapter_dir = resolve_adapter_path(lora_request)
    config = read_peft_config(name, adapter_dir)
    check_config_rank(name, config, max_lora_rank)
    _check_target_modules(name, config, info)
    weights_path = Path(adapter_dir) / WEIGHTS_FILE
    if not weights_path.exists():
        pickles = [f for f in _PICKLE_FILES if (Path(adapter_dir) / f).exists()]
        if pickles:
            raise LoRAError(
                name, f"{pickles[0]} is a pickle file, which loraserve refuses to load (it can "
                "run code); save the adapter as safetensors (PEFT's default)"
            )
        raise LoRAError(name, f"{WEIGHTS_FILE} is missing in {adapter_dir}")
    if not weights_path.is_file():
        # safe_open holds the GIL while it opens the file: on a FIFO or a device that
        # open would block, and with it every thread of the engine.
        raise LoRAError(name, f"{WEIGHTS_FILE} in {adapter_dir} is not a regular file")
    if (Path(adapter_dir) / _NEW_EMBEDDINGS_FILE).exists():
        raise LoRAError(name, f"the adapter adds tokens ({_NEW_EMBEDDINGS_FILE}); loraserve "
                        "serves adapters over the base model's vocabulary only")

    pairs, keys = _read_lora_tensors(name, weights_path, info)
    _tie_lm_head(config, info, pairs, keys)

    expert_pairs = {s: ab for s, ab in pairs.items() if experts_path_of(s, info.experts)}
    modules: dict[str, ModuleLoRA] = load_expert_loras(
        name, config, expert_pairs, info.experts, max_lora_rank, dtype, target_modules)
    max_rank = max((m.rank for m in modules.values()), default=0)
    for source, ab in sorted(pairs.items()):
        if source in expert_pairs:
            continue
        if source not in info.by_source:
            proj = source.rsplit(".", 1)[-1]
            raise LoRAError(
                name, f"target module {source!r} does not exist in the model or does not take "
                f"LoRA (supported: {', '.join(sorted(info.projection_names))})"
                if proj not in info.projection_names else
                f"target module {source!r} does not exist in the model",
            )
        if set(ab) != {"A", "B"}:
            raise LoRAError(name, f"module {source!r} lacks its lora_{'AB'[('A' in ab)]} tensor")
        merged, slice_idx = info.by_source[source]
        if target_modules is not None and source.rsplit(".", 1)[-1] not in target_modules:
            continue  # the server restricts LoRA to some modules (--lora-target-modules)
        _, in_features, out_sizes = info.modules[merged]
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2:
            raise LoRAError(name, f"module {source!r}: LoRA tensors must be 2-D")
        rank = a.shape[0]
        if rank > max_lora_rank:
            raise rank_too_large(name, rank, max_lora_rank)
        if a.shape[1] != in_features or b.shape != (out_sizes[slice_idx], rank):
            raise LoRAError(
                name, f"module {source!r}: lora_A has shape {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; the model wants ({rank}, {in_features}) and "
                f"({out_sizes[slice_idx]}, {rank})",
            )
        scale = config.scaling(source, rank)
        entry = modules.setdefault(
            merged, ModuleLoRA([None] * len(out_sizes), [None] * len(out_sizes))
        )
        a = a.to(dtype).contiguous()
        # Fold alpha / r into B so every kernel uses scale 1.0.
        b = (b.float() * scale).to(dtype).contiguous()
        for ab, tensor, how in (("A", a, ""), ("B", b, f" once scaled by {scale:g}")):
            if not _finite(tensor):
                raise LoRAError(
                    name, f"tensor {keys[source, ab]!r} overflows {dtype} (the lora dtype){how}"
                )
        entry.lora_a[slice_idx] = a
        entry.lora_b[slice_idx] = b
        max_rank = max(max_rank, rank)
    if not modules:
        raise LoRAError(name, "the adapter has no LoRA weights for any module of the model")
    _check_scaled_gain(name, modules, dtype)
    return LoRAModel(name=name, int_id=lora_request.lora_int_id, path=adapter_dir,
                     rank=max_rank, modules=modules)


def _read_lora_tensors(
    name: str, weights_path: Path, info: ModelLoRAInfo
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[tuple[str, str], str]]:
    """{module: {"A": tensor, "B": tensor}} and the tensors' names by (module, A/B).
    Linear layers' LoRA is lora_A/lora_B, embeddings' lora_embedding_A/B (same
    [r, K] / [N, r] shapes, with K the vocabulary); saved copies of base weights
    are checked against the model and dropped."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    keys: dict[tuple[str, str], str] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():
                base_copy = _BASE_COPY_RE.match(key)
                if base_copy is not None and base_copy["module"] in info.base_weights:
                    _check_base_copy(name, key, f.get_tensor(key),
                                     info.base_weights[base_copy["module"]])
                    continue
                match = _KEY_RE.match(key)
                embedding = _EMBEDDING_KEY_RE.match(key) if match is None else None
                if embedding is not None and embedding["module"] in info.embeddings:
                    match = embedding
                elif match is None or match["module"] in info.embeddings:
                    raise LoRAError(name, f"tensor {key!r} is not a LoRA A/B weight we support")
                tensor = f.get_tensor(key)
                if not _finite(tensor):
                    raise LoRAError(name, f"tensor {key!r} holds NaN or infinite values")
                pairs.setdefault(match["module"], {})[match["ab"]] = tensor
                keys[match["module"], match["ab"]] = key
    except SafetensorError as e:
        raise LoRAError(name, f"{WEIGHTS_FILE} is not a valid safetensors file: {e}") from e
    return pairs, keys


def _check_base_copy(name: str, key: str, saved: torch.Tensor, base: torch.Tensor) -> None:
    """PEFT loads such a copy over the base layer: only an unchanged one keeps the
    base model (and every other request) as it is."""
    if saved.shape != base.shape:
        raise LoRAError(
            name, f"tensor {key!r} has shape {tuple(saved.shape)} where the model has "
            f"{tuple(base.shape)}: the adapter resizes the vocabulary (added tokens), which "
            "loraserve does not support"
        )
    if not torch.equal(saved.to(base.device, base.dtype), base):
        raise LoRAError(
            name, f"tensor {key!r} differs from the base model's weight: adapters that "
            "retrain the embedding or lm_head matrix are not supported"
        )


def _tie_lm_head(config: PeftConfig, info: ModelLoRAInfo,
                 pairs: dict[str, dict[str, torch.Tensor]],
                 keys: dict[tuple[str, str], str]) -> None:
    """With ensure_weight_tying on a tied model, PEFT runs lm_head with the
    embedding's LoRA transposed (A = embedding B.T, B = embedding A.T)."""
    if not (config.ensure_weight_tying and info.tied):
        return
    embedding, lm_head = info.tied
    emb = pairs.get(embedding)
    if emb is None or set(emb) != {"A", "B"}:
        return
    pairs[lm_head] = {"A": emb["B"].T, "B": emb["A"].T}
    keys[lm_head, "A"], keys[lm_head, "B"] = keys[embedding, "B"], keys[embedding, "A"]


def _check_scaled_gain(name: str, modules: dict, dtype: torch.dtype) -> None:
    """Refuse scaled weights that are finite but overflow in use (a lora_alpha of
    1e38 does that in float32). One output of `x @ A.T @ B.T` changes by at most
    max_n |B[n]| * |A|_F per unit of |x| (Cauchy-Schwarz, then the Frobenius norm
    bounding A's); the next RMSNorm and attention scores square what a layer
    outputs, so past sqrt(max) of the lora dtype the forward pass gives inf and
    NaN. Trained adapters stay many orders of magnitude below (about 1)."""
    limit = torch.finfo(dtype).max ** 0.5
    for path, module in modules.items():
        for a, b in zip(module.lora_a, module.lora_b, strict=True):
            if a is None or b is None:
                continue
            # A [..., r, K] and B [..., N, r]; experts layers have one per expert.
            gain = (b.double().norm(dim=-1).amax(dim=-1)
                    * a.double().flatten(-2).norm(dim=-1)).max().item()
            if not gain <= limit:
                raise LoRAError(
                    name, f"the LoRA weights of {path!r}, scaled by lora_alpha / r, overflow "
                    f"{dtype} (the lora dtype) in use: they change an output by up to "
                    f"{gain:.3g} per unit of input, above the {limit:.3g} that stays finite "
                    f"once squared; check lora_alpha in {CONFIG_FILE}"
                )


def _finite(tensor: torch.Tensor) -> bool:
    return bool(torch.isfinite(tensor).all())


def _check_target_modules(name: str, config: PeftConfig, info: ModelLoRAInfo) -> None:
    targets = config.target_modules
    if targets is None or isinstance(targets, str):
        return  # a regex: the tensors themselves are checked
    known = info.projection_names | {"all-linear"}
    missing = [t for t in targets if t.rsplit(".", 1)[-1] not in known]
    if missing:
        raise LoRAError(
            name, f"target modules {missing} do not exist in the model or do not take LoRA "
            f"(supported: {', '.join(sorted(info.projection_names))})"
        )
