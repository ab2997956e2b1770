"""Block tables kept as tensors and grown as blocks are sealed, so a decode step reads them without
building anything from Python lists.

One table per host region (each cpu_compute shard, cpu_transfer): row = a sequence's slot (the row
of the GPU window), holding its blocks in that region in logical order, and a count per row. A
sealed block is one element written; a step's tables for its batch are one gather per region
(`batch`), the same tensors for every layer: the block ids are per sequence, the layout per layer.
Transfer spans (runs of consecutive cpu_transfer blocks, one DMA each) are kept per sequence the
same way, extended as blocks are sealed.
"""

from __future__ import annotations

import torch

MAX_CACHED_BATCHES = 64


class BlockTables:
    def __init__(self, keys, max_seqs: int, max_blocks_per_seq: int, block_size: int):
        """keys: the regions, e.g. (Region.CPU_COMPUTE, shard) and (Region.CPU_TRANSFER, 0)."""
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.tables = {key: torch.zeros((max_seqs, max_blocks_per_seq), dtype=torch.int32) for key in keys}
        self.counts = {key: torch.zeros(max_seqs, dtype=torch.int32) for key in keys}
        self.spans: dict[int, list[list[int]]] = {}  # slot -> [[first cpu_transfer block, count], ...]
        # (key, slots) -> batch()'s result, until a row of that region changes: a batch's tables change
        # only when one of its blocks is sealed (every block_size tokens a sequence at most), and a
        # decode step's gather costs about 60 us (measured on a 2-vCPU Zen 3)
        self._batches: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def append(self, key, slot: int, blocks: list[int]) -> None:
        """blocks (allocated in this region, in logical order) join the end of the slot's row."""
        start = int(self.counts[key][slot])
        end = start + len(blocks)
        assert end <= self.max_blocks_per_seq, f"slot {slot} outgrew its {self.max_blocks_per_seq} blocks in {key}"
        self.tables[key][slot, start:end] = torch.tensor(blocks, dtype=torch.int32)
        self.counts[key][slot] = end
        self._forget_batches(key)

    def extend_spans(self, slot: int, blocks: list[int]) -> None:
        spans = self.spans.setdefault(slot, [])
        for block in blocks:
            if spans and spans[-1][0] + spans[-1][1] == block:
                spans[-1][1] += 1
            else:
                spans.append([block, 1])

    def clear(self, slot: int) -> None:
        for counts in self.counts.values():
            counts[slot] = 0
        self.spans.pop(slot, None)
        self._batches.clear()

    def _forget_batches(self, key) -> None:
        for cached in [k for k in self._batches if k[0] == key]:
            del self._batches[cached]

    def row(self, key, slot: int) -> list[int]:
        """The slot's blocks in one region (for checks, not the hot path)."""
        return self.tables[key][slot, : int(self.counts[key][slot])].tolist()

    def batch(self, key, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """slots [batch] int64 -> (block_table [batch, width] int32, seq_lens [batch] int32 in tokens,
        the batch's tokens in this region); width is the longest row (at least 1). The tensors are the
        same from step to step until the region's rows change: read them, never write them."""
        cache_key = (key, tuple(slots.tolist()))
        cached = self._batches.get(cache_key)
        if cached is None:
            if len(self._batches) >= MAX_CACHED_BATCHES:  # batches that came and went
                self._batches.clear()
            cached = self._batches[cache_key] = self._gather(key, slots)
        return cached

    def _gather(self, key, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        counts = self.counts[key].index_select(0, slots)
        width = max(int(counts.max()) if len(counts) else 0, 1)
        table = self.tables[key].index_select(0, slots)[:, :width].contiguous()
        lens = counts * self.block_size
        return table, lens, int(lens.sum())
