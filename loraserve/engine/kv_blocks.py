"""Paged KV cache bookkeeping: a pool of fixed-size blocks and a block table per
sequence, and automatic prefix caching. The tensors themselves live in the worker.

Prefix caching: a full block is known by a hash of the hash of the block before
it, its token ids and the request's LoRA adapter, so equal hashes mean the same
tokens at the same positions after the same prefix, computed with the same
weights. Blocks are reference counted; a block no request holds goes back to
the free pool but keeps its content and its hash until it is handed out again,
least recently freed first, and a new request starts with the blocks of the
longest run of its full blocks found in the cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from loraserve.engine.request import Request
from loraserve.lora.request import LoRARequest

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: list[int],
               lora: LoRARequest | None) -> BlockHash:
    """A cryptographic hash: with Python's hash() a prompt could be made to collide
    with another user's prefix and be served with their cached KV. The adapter is
    its name and path: a name given again with another path has other weights."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    if lora is not None:
        h.update(msgspec.msgpack.encode((lora.lora_name, lora.lora_path)))
    return h.digest()


@dataclass
class PrefixCacheStats:
    """Totals since start-up: prompt tokens looked up, and found in the cache."""

    queries: int = 0
    hits: int = 0


class BlockPool:
    """Blocks 1..num_blocks with reference counts. Free blocks are kept in eviction
    order: those without a hash first, then cached ones, least recently freed first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        # Block 0 of the cache holds zeros and belongs to no sequence
        # (worker/attention.py: allocate_kv_cache).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks + 1))
        self._ref = [0] * (num_blocks + 1)
        self._hash: list[BlockHash | None] = [None] * (num_blocks + 1)
        self.cached: dict[BlockHash, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._uncache(block)
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, block: int) -> None:
        """One more holder of a cached block (taken back from the free pool if free)."""
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def free(self, blocks: list[int]) -> None:
        # The last blocks of a sequence first: they are the least likely to be shared,
        # so they are evicted before the prefix they extend.
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
                if self._hash[block] is None:
                    self._free.move_to_end(block, last=False)

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """Make a computed full block findable. When another block already holds the
        same content, that one stays the cached copy."""
        if block_hash not in self.cached and self._hash[block] is None:
            self.cached[block_hash] = block
            self._hash[block] = block_hash

    def _uncache(self, block: int) -> None:
        block_hash = self._hash[block]
        if block_hash is not None:
            self._hash[block] = None
            if self.cached.get(block_hash) == block:
                del self.cached[block_hash]

    def reset_cache(self) -> None:
        """Forget every cached block (adapter weights changed); blocks in use stay."""
        for block in self.cached.values():
            self._hash[block] = None
            if self._ref[block] == 0:
                self._free.move_to_end(block, last=False)
        self.cached.clear()


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make req's block table cover its computed tokens plus num_new_tokens."""
        needed = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        extra = needed - len(req.block_ids)
        if extra <= 0:
            return True
        blocks = self.pool.allocate(extra)
        if blocks is None:
            return False
        req.block_ids.extend(blocks)
        return True

    def free(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0

    # ---- prefix caching ------------------------------------------------------------

    def take_cached_prefix(self, req: Request) -> int:
        """Give a request that holds no blocks the cached blocks of its longest cached
        prefix of full blocks and count them as computed; returns how many tokens.
        The last token is always left to compute: the step that computes it samples."""
        if not self.enable_prefix_caching or req.block_ids:
            return 0
        if getattr(req.sampling_params, "prompt_logprobs", None) is not None:
            return 0  # the logprobs of the cached prompt tokens would be missing
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(req, max_blocks)
        blocks = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            self.pool.touch(block)
        req.block_ids = blocks
        req.num_cached_blocks = len(blocks)
        req.num_computed_tokens = len(blocks) * self.block_size
        return req.num_computed_tokens

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup whose request was admitted (one that had to wait is looked
        up again, and counted then)."""
        if self.enable_prefix_caching:
            self.prefix_cache_stats.queries += num_tokens
            self.prefix_cache_stats.hits += num_hit_tokens

    def cache_computed_blocks(self, req: Request) -> None:
        """Make the request's newly computed full blocks findable. Called once their
        step is launched: a later step reads them after this one wrote them."""
        if not self.enable_prefix_caching:
            return
        # A token still in flight is unknown on the host: its block waits.
        known = min(req.num_computed_tokens,
                    len(req.prompt_token_ids) + len(req.output_token_ids))
        num_full = min(known // self.block_size, len(req.block_ids))
        if num_full <= req.num_cached_blocks:
            return
        hashes = self._block_hashes(req, num_full)
        for i in range(req.num_cached_blocks, num_full):
            self.pool.cache(req.block_ids[i], hashes[i])
        req.num_cached_blocks = num_full

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()

    def _block_hashes(self, req: Request, num_blocks: int) -> list[BlockHash]:
        """The hashes of the request's first num_blocks full blocks, each computed once
        (they stay with the request through preemption)."""
        hashes = req.block_hashes
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = hash_block(parent, req.token_ids(i * bs, (i + 1) * bs), req.lora_request)
            hashes.append(parent)
        return hashes
