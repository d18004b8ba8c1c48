"""Adapters in CPU memory: the LRU cache of max_cpu_loras, the background loader
that reads them from disk, retirement of unloaded ones, and load timings.

Each load is timed from the start of its disk read to the adapter being in the CPU
cache; the engine reports the totals (load_times) with its stats.

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

from loraserve.config import LoRAConfig
from loraserve.lora.errors import LoRAError
from loraserve.lora.load_times import LORA_LOAD_TIME_BUCKETS_S, lora_load_time_bucket
from loraserve.lora.lru import LRUCache
from loraserve.lora.peft_adapter import LoRAModel, ModelLoRAInfo, load_lora_model
from loraserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


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


class AdapterStore:
    def __init__(self, lora_config: LoRAConfig, info: ModelLoRAInfo,
                 num_load_threads: int = 2, pin_memory: bool = False) -> None:
        """pin_memory: keep the adapters in page-locked memory (for a CUDA device)."""
        self.config = lora_config
        self.info = info
        self.pin_memory = pin_memory
        self.cache: LRUCache[LoRAModel] = LRUCache(lora_config.max_cpu_loras)
        self._loader = ThreadPoolExecutor(num_load_threads, thread_name_prefix="lora-load")
        self._loading: dict[str, tuple[LoRARequest, Future]] = {}
        # The id each adapter was last loaded under; kept when the cache evicts it,
        # so that unloading an evicted adapter still retires its id.
        self._ids: dict[str, int] = {}
        self._retired: set[tuple[str, int]] = set()
        self._read_starts = _ReadStarts()
        self._load_time_counts = [0] * (len(LORA_LOAD_TIME_BUCKETS_S) + 1)
        self._load_time_sum_s = 0.0
        # Bumped whenever what the store reports changes (see LoRAManager.residency).
        self.changes = 0

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
            raise _as_lora_error(lora_request.lora_name, e) from e
        if self.pin_memory:
            lora.pin_memory()
        self._read_starts.mark(lora, started)
        return lora

    def insert(self, lora: LoRAModel, pinned: bool = False) -> None:
        """Put a loaded adapter in the cache (most recent), evicting the oldest
        unpinned ones over capacity; its name and id are no longer retired."""
        self.changes += 1
        self._retired.discard((lora.name, lora.int_id))
        self._ids[lora.name] = lora.int_id
        for name, _ in self.cache.put(lora.name, lora):
            logger.info("LoRA %s evicted from the CPU cache", name)
        if pinned:
            self.cache.pin(lora.name)
        started = self._read_starts.pop(lora)
        if started is not None:  # None: this read was inserted (and counted) before
            seconds = time.monotonic() - started
            self._load_time_counts[lora_load_time_bucket(seconds)] += 1
            self._load_time_sum_s += seconds

    def start_background_load(self, lora_request: LoRARequest) -> None:
        """Read the adapter on a loader thread, unless a read of it is under way
        (a load_inplace request always starts a new read: it brings new weights)."""
        name = lora_request.lora_name
        pending = self._loading.get(name)
        if pending is not None:
            if not lora_request.load_inplace:
                return
            pending[1].cancel()
        self._loading[name] = (lora_request, self._loader.submit(self.load, lora_request))
        self.changes += 1

    def finished_loads(self) -> list[tuple[str, LoRAError | None]]:
        """The background reads that are done, as (name, None) or (name, the error),
        oldest first; they stay until take_load. A read of an adapter that
        was unloaded meanwhile is dropped here: nothing of it may stay."""
        done = []
        for name, (req, future) in list(self._loading.items()):
            if not future.done():
                continue
            if self.is_retired(req):
                del self._loading[name]
                self.changes += 1
                continue
            error = None if future.cancelled() else future.exception()
            done.append((name, None if error is None else _as_lora_error(name, error)))
        return done

    def take_load(self, name: str) -> LoRAModel:
        """The adapter a background read produced, waiting for the read to end (on a
        tensor-parallel rank it may finish a moment after rank 0's); raises LoRAError."""
        _, future = self._loading.pop(name)
        self.changes += 1
        try:
            return future.result()
        except LoRAError:
            raise
        except Exception as e:  # noqa: BLE001 - only this adapter's failure
            raise _as_lora_error(name, e) from e

    def drop_load(self, name: str) -> None:
        """Forget a background read (it failed, or its result is not wanted)."""
        pending = self._loading.pop(name, None)
        if pending is not None:
            pending[1].cancel()
            self.changes += 1

    # ---- residency -----------------------------------------------------------------

    def is_retired(self, lora_request: LoRARequest) -> bool:
        """Whether this adapter, under this id, was unloaded (and not added since)."""
        return (lora_request.lora_name, lora_request.lora_int_id) in self._retired

    def pin(self, name: str) -> None:
        self.cache.pin(name)
        self.changes += 1

    def remove(self, name: str, request_ids: Iterable[int] = ()) -> tuple[bool, frozenset[int]]:
        """Forget an adapter: its tensors are freed, a load in progress is dropped,
        and its ids (plus `request_ids`, those of requests that named it) are
        retired. Returns whether anything of it was held, and the ids retired."""
        self.changes += 1
        ids = set(request_ids)
        lora = self.cache.pop(name)
        found = lora is not None
        if lora is not None:
            ids.add(lora.int_id)
        pending = self._loading.pop(name, None)
        if pending is not None:
            pending[1].cancel()
            ids.add(pending[0].lora_int_id)
            found = True
        known = self._ids.pop(name, None)
        if known is not None:
            ids.add(known)
        self._retired.update((name, i) for i in ids)
        return found, frozenset(ids)

    def memory_usage(self) -> dict[str, int]:
        """Bytes of adapter weights in the cache, per adapter."""
        return {name: self.cache.peek(name).nbytes() for name in self.cache.keys()}

    def pinned_names(self) -> list[str]:
        return [name for name in self.cache.keys() if self.cache.is_pinned(name)]

    def load_times(self) -> tuple[list[int], float]:
        """Every load so far: the count per bucket of LORA_LOAD_TIME_BUCKETS_S (plus
        one for longer loads) and their total seconds."""
        return list(self._load_time_counts), self._load_time_sum_s

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)


def _as_lora_error(name: str, error: BaseException) -> LoRAError:
    """A failed read is the adapter's failure, whatever raised (corrupt files too)."""
    if isinstance(error, LoRAError):
        return error
    return LoRAError(name, f"{type(error).__name__}: {error}")
