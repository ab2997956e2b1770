"""The gpu_pingpong region: two fixed buffers on the device that cpu_transfer blocks stream into,
one layer's chunk each (layer l uses buffer l % 2, so layer l + 1's copy can run while layer l
computes), and the copy plan that fills them.

A step's plan is made once (`plan_chunks`) and serves every layer: the blocks of a sequence are
the same in every layer, only the layer index of the source changes. A chunk is a list of spans
(runs of consecutive cpu_transfer blocks: one copy each, as large as the layout allows) and the
batch's block table into the buffer. On CUDA the first chunk of a layer can be started early on a
side stream (`prefetch`); the compute stream waits for it with an event, never the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from writescope.kv_format import KVFormat
from writescope.ops import KVSource


@dataclass(frozen=True)
class TransferChunk:
    spans: tuple[tuple[int, int, int], ...]  # (first buffer block, first cpu_transfer block, count)
    block_table: torch.Tensor  # [batch, width] int32, on the device: each sequence's blocks in the buffer
    seq_lens: torch.Tensor  # [batch] int32 tokens, on the device
    tokens: int


def plan_chunks(spans_per_seq: list[list[list[int]]], capacity: int, block_size: int,
                device: torch.device) -> tuple[TransferChunk, ...]:
    """spans_per_seq: for each sequence of the batch, its [first block, count] spans in cpu_transfer.
    Fills buffers of `capacity` blocks in order; a sequence's blocks land consecutively in a buffer."""
    chunks, spans = [], []
    starts, counts = [0] * len(spans_per_seq), [0] * len(spans_per_seq)
    fill = 0

    def close():
        nonlocal spans, starts, counts, fill
        if spans:
            chunks.append(_chunk(spans, starts, counts, block_size, device))
        spans, starts, counts, fill = [], [0] * len(spans_per_seq), [0] * len(spans_per_seq), 0

    for seq, seq_spans in enumerate(spans_per_seq):
        for first, count in seq_spans:
            while count:
                if fill == capacity:
                    close()
                take = min(count, capacity - fill)
                if counts[seq] == 0:
                    starts[seq] = fill
                spans.append((fill, first, take))
                counts[seq] += take
                fill, first, count = fill + take, first + take, count - take
    close()
    return tuple(chunks)


def _chunk(spans, starts, counts, block_size: int, device) -> TransferChunk:
    width = max(max(counts), 1)
    start = torch.tensor(starts, dtype=torch.int32)
    table = start[:, None] + torch.arange(width, dtype=torch.int32)[None, :]  # consecutive per sequence
    lens = torch.tensor(counts, dtype=torch.int32) * block_size
    return TransferChunk(tuple(spans), table.to(device), lens.to(device), sum(counts) * block_size)


class PingPong:
    """The two buffers, one array per stored array: [2, capacity, num_kv_heads, block_size, dim]."""

    def __init__(self, fmt: KVFormat, capacity: int, device: torch.device):
        self.format = fmt
        self.capacity = capacity
        self.buffers = [torch.zeros(fmt.shape("gpu_pingpong", capacity, d), dtype=fmt.torch_dtype, device=device)
                        for d in fmt.stored_dims]
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._pending: dict[int, tuple] = {}  # buffer -> (layer, step key, event or None) of a started copy

    def prefetch(self, layer: int, chunk: TransferChunk, transfer_arrays, step_key) -> None:
        """Starts copying a layer's first chunk into its buffer: on CUDA on the side stream, after
        everything the compute stream has queued (the buffer's last reader, two layers back)."""
        buffer = layer % 2
        event = None
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self._copy(buffer, layer, chunk, transfer_arrays)
                event = torch.cuda.Event()
                event.record()
        else:
            self._copy(buffer, layer, chunk, transfer_arrays)
        self._pending[buffer] = (layer, step_key, event)

    def source(self, layer: int, chunk: TransferChunk, transfer_arrays, step_key, *, first: bool) -> KVSource:
        """The chunk in the layer's buffer as a paged source: the prefetched copy if it is this one
        (the compute stream waits on its event), else copied now on the compute stream."""
        buffer = layer % 2
        pending = self._pending.pop(buffer, None)
        if first and pending is not None and pending[:2] == (layer, step_key):
            if pending[2] is not None:
                torch.cuda.current_stream().wait_event(pending[2])
        else:
            if pending is not None and pending[2] is not None:  # never two copies into one buffer at once
                torch.cuda.current_stream().wait_event(pending[2])
            self._copy(buffer, layer, chunk, transfer_arrays)
        k = self.buffers[0][buffer]
        v = k[..., : self.format.head_dim_v] if self.format.v_in_k else self.buffers[1][buffer]
        return KVSource(k, v, chunk.block_table, chunk.seq_lens)

    def _copy(self, buffer: int, layer: int, chunk: TransferChunk, transfer_arrays) -> None:
        for dst, src, count in chunk.spans:  # one DMA per span of consecutive blocks
            for target, array in zip(self.buffers, transfer_arrays, strict=True):
                target[buffer, dst:dst + count].copy_(array[layer, src:src + count], non_blocking=True)

    def clear(self) -> None:
        self._pending.clear()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)
