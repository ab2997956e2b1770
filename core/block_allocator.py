"""Fixed-size block allocation for one region (or one NUMA shard of it). No torch, no I/O."""

from __future__ import annotations

import heapq
from collections.abc import Hashable

# Block ids an owner (a sequence) fills before it takes ids anywhere else: 256 blocks of 16 tokens,
# 4096 tokens. The CPU kernel reads a sequence's blocks in table order, so its consecutive ids are
# one stream for the memory and the prefetchers. Measured on a 2-vCPU Zen 4 (tools/bench_cpu_ab.py
# --run-blocks 16 256, 32K tokens, whole-array read 42-48 GB/s): runs of 256 ids against the runs of
# 16 that lowest-first ids give sequences flushing their 256-token windows in turn, MHA 1.09-1.11x,
# Mixtral 1.10x, Qwen3-MoE 1.06-1.07x.
EXTENT_BLOCKS = 256


class CapacityError(ValueError):
    """A request does not fit the KV capacity left; raised before anything is written."""


class BlockAllocator:
    """Hands out block ids in [0, num_blocks); freed ids are reused, and counts the allocated ids of
    each segment of segment_blocks ids (a region's unit of memory).

    Without an owner, ids go lowest first, so they pack into the fewest segments. With one (the
    sequence the blocks are for), the ids are consecutive within an extent of extent_blocks ids the
    owner holds: its next block is the id after its last when that is free, else the first id of the
    lowest extent that is wholly free and held by no one, else the lowest free id. Sequences that
    allocate in turn (decode steps flushing their windows, chunked prefills) then each get long runs
    of consecutive ids where lowest-first would interleave them, and a sequence that finishes leaves
    whole extents free for the next. Holding is only a preference: any free id can be allocated,
    so capacity is the same; release_owner ends it."""

    def __init__(self, num_blocks: int, segment_blocks: int | None = None, extent_blocks: int = EXTENT_BLOCKS):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if extent_blocks < 1:
            raise ValueError(f"extent_blocks must be >= 1, got {extent_blocks}")
        self.num_blocks = num_blocks
        self.segment_blocks = max(num_blocks, 1) if segment_blocks is None else segment_blocks
        if self.segment_blocks < 1:
            raise ValueError(f"segment_blocks must be >= 1, got {segment_blocks}")
        self.extent_blocks = extent_blocks
        self._free_ids = set(range(num_blocks))
        self._free = list(range(num_blocks))  # a heap of ids; an id no longer in _free_ids is stale
        self._allocated: set[int] = set()
        self._segment_use = [0] * -(-num_blocks // self.segment_blocks)
        num_extents = -(-num_blocks // extent_blocks)
        self._extent_free = [self._extent_size(e) for e in range(num_extents)]
        self._extent_holder: list[Hashable | None] = [None] * num_extents
        self._open_extents = list(range(num_extents))  # a heap; stale unless wholly free and held by no one
        self._held: dict[Hashable, set[int]] = {}  # owner -> the extents it holds
        self._next: dict[Hashable, int] = {}  # owner -> the id after its last

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

    @property
    def allocated(self) -> frozenset[int]:
        return frozenset(self._allocated)

    def can_allocate(self, count: int) -> bool:
        return 0 <= count <= len(self._free_ids)

    def allocate(self, count: int, owner: Hashable | None = None) -> list[int]:
        """`count` free ids (CapacityError, nothing taken, if fewer are free): lowest first, or for
        `owner` consecutive within the extents it holds (see the class)."""
        if not self.can_allocate(count):
            raise CapacityError(f"asked for {count} blocks, {len(self._free_ids)} of {self.num_blocks} are free")
        blocks = []
        for _ in range(count):
            blocks.append(self._lowest_free() if owner is None else self._next_for(owner))
            if owner is not None:
                self._next[owner] = blocks[-1] + 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if block not in self._allocated:
                raise ValueError(f"block {block} is not allocated")
        for block in blocks:
            self._allocated.remove(block)
            self._segment_use[block // self.segment_blocks] -= 1
            self._free_ids.add(block)
            heapq.heappush(self._free, block)
            extent = block // self.extent_blocks
            self._extent_free[extent] += 1
            if self._is_open(extent):
                heapq.heappush(self._open_extents, extent)
        self._compact()

    def release_owner(self, owner: Hashable) -> None:
        """The owner takes no more ids: the extents it holds go back to everyone (its allocated
        ids stay allocated until freed)."""
        self._next.pop(owner, None)
        for extent in self._held.pop(owner, ()):
            self._extent_holder[extent] = None
            if self._is_open(extent):
                heapq.heappush(self._open_extents, extent)
        self._compact()

    def _compact(self) -> None:
        """Both heaps drop their stale entries once they hold twice what is live: ids taken by an
        owner leave their entry in the id heap, and a heap a long-lived server pushes to on every
        free would otherwise grow without end."""
        if len(self._free) > 2 * len(self._free_ids) + 64:
            self._free = sorted(self._free_ids)
        if len(self._open_extents) > 2 * len(self._extent_free) + 64:
            self._open_extents = [e for e in range(len(self._extent_free)) if self._is_open(e)]

    def holder_of(self, block: int) -> Hashable | None:
        """The owner holding the extent of `block`, None when no one does."""
        return self._extent_holder[block // self.extent_blocks]

    def segment_of(self, block: int) -> int:
        return block // self.segment_blocks

    def segment_in_use(self, segment: int) -> bool:
        """Some block id of the segment is allocated."""
        return self._segment_use[segment] > 0

    def _extent_size(self, extent: int) -> int:
        return min(self.extent_blocks, self.num_blocks - extent * self.extent_blocks)

    def _is_open(self, extent: int) -> bool:
        return self._extent_holder[extent] is None and self._extent_free[extent] == self._extent_size(extent)

    def _next_for(self, owner: Hashable) -> int:
        """The owner's next id: the one after its last in an extent it holds, else the first of an
        open extent it now holds, else the lowest free id."""
        following = self._next.get(owner)
        if following is not None and following < self.num_blocks and following in self._free_ids:
            extent = following // self.extent_blocks
            if self._extent_holder[extent] == owner:
                return self._take(following)
            if following % self.extent_blocks == 0 and self._is_open(extent):  # the run goes on into it
                return self._take(self._hold(extent, owner))
        while self._open_extents:
            extent = heapq.heappop(self._open_extents)
            if self._is_open(extent):
                return self._take(self._hold(extent, owner))
        return self._lowest_free()

    def _hold(self, extent: int, owner: Hashable) -> int:
        """`owner` now holds `extent` (open); returns its first id."""
        self._extent_holder[extent] = owner
        self._held.setdefault(owner, set()).add(extent)
        return extent * self.extent_blocks

    def _lowest_free(self) -> int:
        while self._free[0] not in self._free_ids:
            heapq.heappop(self._free)
        return self._take(heapq.heappop(self._free))

    def _take(self, block: int) -> int:
        self._free_ids.remove(block)
        self._allocated.add(block)
        self._segment_use[block // self.segment_blocks] += 1
        self._extent_free[block // self.extent_blocks] -= 1
        return block

    def check_integrity(self) -> None:
        free = self._free_ids
        assert free <= set(self._free), "a free block is missing from the free heap"
        assert not free & self._allocated, "a block is both free and allocated"
        assert free | self._allocated == set(range(self.num_blocks)), "a block is lost or out of range"
        use = [0] * len(self._segment_use)
        for block in self._allocated:
            use[block // self.segment_blocks] += 1
        assert use == self._segment_use, "a segment's count of allocated blocks is off"
        extent_free = [0] * len(self._extent_free)
        for block in free:
            extent_free[block // self.extent_blocks] += 1
        assert extent_free == self._extent_free, "an extent's count of free blocks is off"
        for owner, extents in self._held.items():
            assert all(self._extent_holder[e] == owner for e in extents), "an extent's holder is off"
        assert sum(len(e) for e in self._held.values()) == sum(h is not None for h in self._extent_holder), \
            "an extent is held by no owner that knows it"
        assert all(e in self._open_extents for e in range(len(self._extent_free)) if self._is_open(e)), \
            "an open extent is missing from the open heap"
