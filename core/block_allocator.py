"""Fixed-size block allocation for one region (or one NUMA shard of it). No torch, no I/O."""

from __future__ import annotations

import heapq


class CapacityError(ValueError):
    """A request does not fit the KV capacity left; raised before anything is written."""


class BlockAllocator:
    """Hands out block ids in [0, num_blocks), lowest first, so a sequence's blocks tend to be
    consecutive (one DMA span in cpu_transfer) and the allocated ids pack into the fewest segments
    of segment_blocks ids (a region's unit of memory); freed ids are reused. Counts the allocated
    ids of each segment."""

    def __init__(self, num_blocks: int, segment_blocks: int | None = None):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.segment_blocks = max(num_blocks, 1) if segment_blocks is None else segment_blocks
        if self.segment_blocks < 1:
            raise ValueError(f"segment_blocks must be >= 1, got {segment_blocks}")
        self._free = list(range(num_blocks))  # a heap
        self._allocated: set[int] = set()
        self._segment_use = [0] * -(-num_blocks // self.segment_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

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
        for block in blocks:
            self._segment_use[block // self.segment_blocks] += 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if block not in self._allocated:
                raise ValueError(f"block {block} is not allocated")
            self._allocated.remove(block)
            self._segment_use[block // self.segment_blocks] -= 1
            heapq.heappush(self._free, block)

    def segment_of(self, block: int) -> int:
        return block // self.segment_blocks

    def segment_in_use(self, segment: int) -> bool:
        """Some block id of the segment is allocated."""
        return self._segment_use[segment] > 0

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & self._allocated, "a block is both free and allocated"
        assert free | self._allocated == set(range(self.num_blocks)), "a block is lost or out of range"
        use = [0] * len(self._segment_use)
        for block in self._allocated:
            use[block // self.segment_blocks] += 1
        assert use == self._segment_use, "a segment's count of allocated blocks is off"
