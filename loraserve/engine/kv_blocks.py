"""Paged KV cache bookkeeping: a free list of fixed-size blocks and a block table
per sequence. The tensors themselves live in the worker."""

from __future__ import annotations

from collections import deque

from loraserve.engine.request import Request


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        # Block 0 of the cache holds zeros and belongs to no sequence
        # (worker/attention.py: allocate_kv_cache).
        self._free: deque[int] = deque(range(1, num_blocks + 1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        return 1.0 - self.allocator.num_free / self.allocator.num_blocks

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make req's block table cover its computed tokens plus num_new_tokens."""
        needed = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        extra = needed - len(req.block_ids)
        if extra <= 0:
            return True
        blocks = self.allocator.allocate(extra)
        if blocks is None:
            return False
        req.block_ids.extend(blocks)
        return True

    def free(self, req: Request) -> None:
        self.allocator.free(req.block_ids)
        req.block_ids = []
