"""Fixed-size block allocation for one region (or one NUMA shard of it). No torch, no I/O."""

from __future__ import annotations

import heapq


class CapacityError(ValueError):
    """A request does not fit the KV capacity left; raised before anything is written."""


class BlockAllocator:
    """Hands out block ids in [0, num_blocks), lowest first, so a sequence's blocks tend to be
    consecutive (one DMA span in cpu_transfer); freed ids are reused."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def allocated(self) -> frozenset[int]:
        return frozenset(self._allocated)

    def can_allocate(self, count: int) -> bool:
        return 0 <= count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        if not self.can_allocate(count):
            raise CapacityError(f"asked for {count} blocks, {len(self._free)} of {self.num_blocks} are free")
        blocks = [heapq.heappop(self._free) for _ in range(count)]
        self._allocated.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if block not in self._allocated:
                raise ValueError(f"block {block} is not allocated")
            self._allocated.remove(block)
            heapq.heappush(self._free, block)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & self._allocated, "a block is both free and allocated"
        assert free | self._allocated == set(range(self.num_blocks)), "a block is lost or out of range"
