"""Adapters of one model: wrapping its layers, the CPU cache (max_cpu_loras), the
device slots (max_loras), and background loading from disk.

Both caches are LRU. An adapter enters the CPU cache when loaded; it takes a
device slot when a step needs it (or at once when added through the API). A
module the adapter does not target has its slot zeroed. Pinned adapters are
never evicted.

Each load is timed from the start of its disk read to the adapter being in the CPU
cache, and the engine reports the totals (load_times) with its stats.

Unloading is for good: the (name, id) pairs of an unloaded adapter are retired,
so that a request which still carries one (it chose the adapter just before the
unload) is refused rather than load it from disk again. Only an explicit add
brings a retired pair back.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from loraserve.config import LoRAConfig
from loraserve.engine.protocol import LORA_LOAD_TIME_BUCKETS_S, lora_load_time_bucket
from loraserve.lora.errors import LoRAError
from loraserve.lora.layers import EmbeddingWithLoRA, LinearWithLoRA
from loraserve.lora.lru import LRUCache
from loraserve.lora.moe_adapter import ExpertsInfo
from loraserve.lora.moe_layers import ExpertsWithLoRA
from loraserve.lora.parallel_layers import ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA
from loraserve.lora.peft_adapter import LoRAModel, ModelLoRAInfo, load_lora_model
from loraserve.lora.punica import PunicaWrapper
from loraserve.lora.request import LoRARequest
from loraserve.model.linear import ColumnParallelLinear, RowParallelLinear
from loraserve.model.moe import Experts

logger = logging.getLogger(__name__)

LoRAWrapper = LinearWithLoRA | EmbeddingWithLoRA


def wrap_model(
    model: nn.Module,
    lora_config: LoRAConfig,
    punica: PunicaWrapper,
    logits_punica: PunicaWrapper | None = None,
) -> tuple[dict[str, LoRAWrapper], ModelLoRAInfo]:
    """Replace every LoRA-capable layer with a wrapper, in place. The lm_head's
    wrapper maps the rows whose logits are computed (``logits_punica``), every other
    layer the step's tokens (``punica``)."""
    wrappers: dict[str, LoRAWrapper] = {}
    info = ModelLoRAInfo(modules={}, by_source={}, projection_names=set())
    for _merged_name, sources in model.lora_modules.items():
        info.projection_names.update(sources)
    slots, rank, dtype = lora_config.max_loras, lora_config.max_lora_rank, lora_config.lora_dtype
    for path, module in list(model.named_modules()):
        leaf = path.rsplit(".", 1)[-1]
        if isinstance(module, Experts):
            wrappers[path] = _wrap_experts(model, path, module, lora_config, punica, info)
            continue
        if leaf not in model.lora_modules:
            continue
        sources = model.lora_modules[leaf]
        slice_sizes = model.slice_sizes(leaf)
        if isinstance(module, nn.Embedding):
            wrapper: LoRAWrapper = EmbeddingWithLoRA(module, slots, rank, dtype, punica)
            in_features = module.num_embeddings
            info.embeddings.add(path)
            info.base_weights[path] = module.weight
        elif isinstance(module, ColumnParallelLinear | RowParallelLinear):
            cls = (ColumnParallelLinearWithLoRA if isinstance(module, ColumnParallelLinear)
                   else RowParallelLinearWithLoRA)
            wrapper = cls(module, slice_sizes, slots, rank, dtype, punica,
                          lora_config.fully_sharded_loras)
            # Adapters hold the whole model's shapes; each rank keeps its shard.
            in_features = getattr(module, "full_in_features", module.in_features)
            slice_sizes = model.full_slice_sizes(leaf)
        elif isinstance(module, nn.Linear):
            is_lm_head = path == "lm_head"
            wrapper = LinearWithLoRA(
                module, slice_sizes, slots, rank, dtype,
                logits_punica if is_lm_head and logits_punica is not None else punica,
            )
            in_features = module.in_features
            if is_lm_head:
                info.base_weights[path] = module.weight
        else:
            continue
        parent_path, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, attr, wrapper)
        wrappers[path] = wrapper
        info.modules[path] = (tuple(sources), in_features, slice_sizes)
        for i, source in enumerate(sources):
            info.by_source[f"{parent_path}.{source}" if parent_path else source] = (path, i)
    if getattr(model, "tie_word_embeddings", False) and "lm_head" in info.base_weights:
        embedding = next(iter(info.embeddings), None)
        if embedding is not None:
            info.tied = (embedding, "lm_head")
    return wrappers, info


def _wrap_experts(model: nn.Module, path: str, module: Experts, lora_config: LoRAConfig,
                  punica: PunicaWrapper, info: ModelLoRAInfo) -> ExpertsWithLoRA:
    """A MoE block's experts take LoRA on their projections (not the router)."""
    wrapper = ExpertsWithLoRA(module, lora_config.max_loras, lora_config.max_lora_rank,
                              lora_config.lora_dtype, punica)
    parent_path, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_path), attr, wrapper)
    info.experts[path] = ExpertsInfo(module.num_experts, module.hidden_size,
                                     module.intermediate_size, model.expert_projections)
    info.projection_names.update(model.expert_projections)
    return wrapper


class _ReadStarts:
    """When the disk read behind each loaded LoRAModel began.

    Kept beside the model rather than in it: a model read on another thread (a
    runtime add) reaches insert only later, and one that is never inserted (its add
    was dropped, its adapter unloaded) must not be kept alive here, so its entry
    goes when the model does. LoRAModel compares by value, hence the id key.
    """

    def __init__(self) -> None:
        self._started: dict[int, tuple[weakref.ref, float]] = {}

    def mark(self, lora: LoRAModel, started: float) -> None:
        key, table = id(lora), self._started
        table[key] = (weakref.ref(lora, lambda _ref: table.pop(key, None)), started)

    def pop(self, lora: LoRAModel) -> float | None:
        entry = self._started.pop(id(lora), None)
        return entry[1] if entry is not None and entry[0]() is lora else None


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        lora_config: LoRAConfig,
        punica: PunicaWrapper,
        num_load_threads: int = 2,
        logits_punica: PunicaWrapper | None = None,
    ) -> None:
        self.config = lora_config
        self.punica = punica
        self.wrappers, self.info = wrap_model(model, lora_config, punica, logits_punica)
        self.cpu_cache: LRUCache[LoRAModel] = LRUCache(lora_config.max_cpu_loras)
        # Device slots: name -> slot index. Free slots are the ones not in the map.
        self.slots: LRUCache[int] = LRUCache(lora_config.max_loras)
        self._loader = ThreadPoolExecutor(num_load_threads, thread_name_prefix="lora-load")
        self._loading: dict[str, tuple[LoRARequest, Future]] = {}
        # The id each adapter was last loaded under; kept when the CPU cache evicts
        # it, so that unloading an evicted adapter still retires its id.
        self._ids: dict[str, int] = {}
        self._retired: set[tuple[str, int]] = set()
        self._read_starts = _ReadStarts()
        self._load_time_counts = [0] * (len(LORA_LOAD_TIME_BUCKETS_S) + 1)
        self._load_time_sum_s = 0.0
        # Tensor parallelism, rank 0: every slot written, as (slot, (name, id, path)
        # or None), for the other ranks to write their shards of the same adapter.
        self.slot_log: list[tuple[int, tuple[str, int, str] | None]] | None = None
        # Per device slot, the wrapper paths its adapter has weights for.
        self._slot_modules: dict[int, frozenset[str]] = {}

    # ---- loading -------------------------------------------------------------------

    def load(self, lora_request: LoRARequest) -> LoRAModel:
        """Read an adapter from disk (or the Hub) into CPU tensors; raises LoRAError.
        Thread-safe: background and runtime loads call it on their own threads."""
        started = time.monotonic()
        try:
            lora = load_lora_model(
                lora_request, self.info, self.config.max_lora_rank, self.config.lora_dtype,
                self.config.target_modules,
            )
        except LoRAError:
            raise
        except Exception as e:  # corrupt files and the like: still the adapter's fault
            raise LoRAError(lora_request.lora_name, f"{type(e).__name__}: {e}") from e
        self._read_starts.mark(lora, started)
        return lora

    def add(self, lora_request: LoRARequest, pinned: bool = False,
            loaded: LoRAModel | None = None) -> LoRAModel:
        """Load (unless `loaded` was read elsewhere already) before evicting anything,
        then put into the CPU cache."""
        lora = loaded if loaded is not None else self.load(lora_request)
        self._retired.discard((lora_request.lora_name, lora_request.lora_int_id))
        self.insert(lora)
        if pinned:
            self.cpu_cache.pin(lora.name)
        return lora

    def insert(self, lora: LoRAModel) -> None:
        # Strict LRU: an evicted adapter that a running request uses keeps its device
        # slot (set_active protects those), so nothing in flight loses its weights.
        if lora.name in self.slots:
            # load_inplace: the slot must show the new weights.
            self._write_slot(self.slots.peek(lora.name), lora)
        self._ids[lora.name] = lora.int_id
        for name, _ in self.cpu_cache.put(lora.name, lora):
            logger.info("LoRA %s evicted from the CPU cache", name)
        started = self._read_starts.pop(lora)
        if started is not None:  # None: this read was inserted (and counted) before
            seconds = time.monotonic() - started
            self._load_time_counts[lora_load_time_bucket(seconds)] += 1
            self._load_time_sum_s += seconds

    def start_background_load(self, lora_request: LoRARequest) -> None:
        name = lora_request.lora_name
        if name not in self._loading:
            self._loading[name] = (lora_request, self._loader.submit(self.load, lora_request))

    def poll_loads(self) -> list[tuple[str, LoRAError | None]]:
        """Move finished background loads into the CPU cache; report failures."""
        done = []
        for name, (req, future) in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[name]
            if self.is_retired(req):
                continue  # unloaded while it loaded: nothing of it may stay
            try:
                self.insert(future.result())
                done.append((name, None))
            except LoRAError as e:
                done.append((name, e))
            except Exception as e:  # noqa: BLE001 - still only this adapter's failure
                done.append((name, LoRAError(name, f"{type(e).__name__}: {e}")))
        return done

    # ---- residency ---------------------------------------------------------------

    def is_ready(self, name: str) -> bool:
        """Usable this step without touching the disk."""
        return name in self.cpu_cache or name in self.slots

    def is_retired(self, lora_request: LoRARequest) -> bool:
        """Whether this adapter, under this id, was unloaded (and not added since)."""
        return (lora_request.lora_name, lora_request.lora_int_id) in self._retired

    def pin(self, name: str) -> None:
        self.cpu_cache.pin(name)
        if name in self.slots:
            self.slots.pin(name)

    def remove(self, name: str, request_ids: Iterable[int] = ()) -> bool:
        """Forget an adapter: its CPU tensors and its device slot are freed, a load
        in progress is dropped, and its ids (plus `request_ids`, those of requests
        that named it) are retired. Returns whether anything of it was held."""
        ids = set(request_ids)
        lora = self.cpu_cache.pop(name)
        found = lora is not None
        if lora is not None:
            ids.add(lora.int_id)
        slot = self.slots.pop(name)
        if slot is not None:
            self._write_slot(slot, None)
            found = True
        pending = self._loading.pop(name, None)
        if pending is not None:
            pending[1].cancel()
            ids.add(pending[0].lora_int_id)
            found = True
        known = self._ids.pop(name, None)
        if known is not None:
            ids.add(known)
        self._retired.update((name, i) for i in ids)
        return found

    def activate(self, name: str, protected: Iterable[str] = ()) -> int:
        """Give an adapter a device slot, evicting the least recently used one that
        this step does not need. Returns the slot."""
        slot = self.slots.get(name)
        if slot is not None:
            self.cpu_cache.touch(name)
            return slot
        lora = self.cpu_cache.get(name)
        if lora is None:
            raise RuntimeError(f"LoRA {name!r} is neither in a device slot nor in the CPU cache")
        used = set(self.slots.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if not free:
            victim = self.slots.oldest_evictable(set(protected) | {name})
            if victim is None:
                raise RuntimeError(
                    f"no free LoRA slot for {name!r}: all {self.config.max_loras} are in use"
                )
            free = [self.slots.pop(victim)]
            logger.debug("LoRA %s leaves slot %d", victim, free[0])
        slot = free[0]
        self._write_slot(slot, lora)
        self.slots.put(name, slot)
        if self.cpu_cache.is_pinned(name):
            self.slots.pin(name)
        return slot

    def set_active(self, names: set[str], running: Iterable[str] = ()) -> dict[str, int]:
        """Slots for every adapter of this step (at most max_loras of them). Adapters
        of running requests keep their slots even when not scheduled this step."""
        if len(names) > self.config.max_loras:
            raise RuntimeError(
                f"{len(names)} adapters in one step exceed max_loras={self.config.max_loras}"
            )
        protected = set(names) | set(running)
        return {name: self.activate(name, protected=protected) for name in names}

    def write_shared_slot(self, slot: int, adapter: tuple[str, int, str] | None) -> None:
        """Another rank: write the slot that rank 0 wrote, reading the adapter from
        its folder (rank 0 checked it already)."""
        lora = self.load(LoRARequest(*adapter)) if adapter is not None else None
        self._write_slot(slot, lora)

    def _write_slot(self, slot: int, lora: LoRAModel | None) -> None:
        if self.slot_log is not None:
            self.slot_log.append(
                (slot, (lora.name, lora.int_id, lora.path) if lora is not None else None))
        with torch.no_grad():
            for path, wrapper in self.wrappers.items():
                wrapper.set_slot(slot, lora.modules.get(path) if lora is not None else None)
        self._slot_modules[slot] = frozenset(lora.modules) if lora is not None else frozenset()

    def slots_use(self, path: str) -> bool:
        """Whether an adapter in a device slot has weights for the wrapper at `path`."""
        return any(path in modules for modules in self._slot_modules.values())

    def memory_usage(self) -> dict[str, int]:
        """Bytes of adapter weights in the CPU cache, per adapter. Device slots are
        fixed buffers; an unloaded adapter's slot is zeroed and reused."""
        return {name: self.cpu_cache.peek(name).nbytes() for name in self.cpu_cache.keys()}

    def cpu_names(self) -> list[str]:
        return self.cpu_cache.keys()

    def slot_names(self) -> list[str]:
        return self.slots.keys()

    def pinned_slot_names(self) -> set[str]:
        """Pinned adapters holding a device slot: nothing evicts them from it."""
        return {name for name in self.slots.keys() if self.slots.is_pinned(name)}

    def pinned_names(self) -> list[str]:
        return [name for name in self.cpu_cache.keys() if self.cpu_cache.is_pinned(name)]

    def load_times(self) -> tuple[list[int], float]:
        """Every load so far: the count per bucket of LORA_LOAD_TIME_BUCKETS_S (plus
        one for longer loads) and their total seconds."""
        return list(self._load_time_counts), self._load_time_sum_s

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
