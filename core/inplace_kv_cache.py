"""InplaceKVCache: the KV cache whose tokens get their physical residency when they are written.

Four regions (DESIGN.md section 2):
    cpu_compute   host shared memory, head-major blocks, one shard per NUMA node; the CPU attends it
    cpu_transfer  host shared memory (pinned where CUDA is present), block-major; streamed to the
                  device each step and attended there
    gpu_pingpong  two fixed buffers on the device, refilled per layer from cpu_transfer
    gpu_window    the newest window_tokens of each sequence, on the device

Prefill writes each layer's full blocks straight into their final region and the rest into the
window; decode appends to the window; a full window is flushed as sealed blocks to cpu_compute or
cpu_transfer, as the policy decides at that moment. Nothing moves after placement, and the
device memory of the cache does not depend on sequence length.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from writescope.block_allocator import BlockAllocator, CapacityError
from writescope.kv_format import KVFormat
from writescope.kv_regions import HostRegion
from writescope.ops import KVSource
from writescope.policies import Policy, Region


@dataclass(frozen=True)
class CacheConfig:
    format: KVFormat
    compute_blocks_per_shard: int
    transfer_blocks: int
    max_seqs: int
    pingpong_blocks: int
    num_shards: int = 1
    window_tokens: int = 256
    device: str = "cpu"

    def __post_init__(self):
        for name in ("compute_blocks_per_shard", "transfer_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"CacheConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_seqs", "pingpong_blocks", "num_shards", "window_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"CacheConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.window_tokens % self.format.block_size:
            raise ValueError(f"window_tokens ({self.window_tokens}) must be a multiple of block_size "
                             f"({self.format.block_size}): a full window flushes as whole blocks")


@dataclass(frozen=True)
class Placement:
    region: Region
    shard: int  # NUMA shard of cpu_compute; 0 for cpu_transfer
    block: int


@dataclass
class SequenceState:
    slot: int  # row of the gpu_window
    prompt_len: int
    max_tokens: int  # prompt + max new tokens: what admission reserved for
    num_tokens: int  # committed tokens
    blocks: list[Placement] = field(default_factory=list)  # logical order
    # the same blocks by (region, shard), in logical order: what block tables are built from
    region_blocks: dict[tuple[Region, int], list[int]] = field(default_factory=dict)
    window_len: int = 0
    prefilled_layers: set[int] = field(default_factory=set)
    reserved_blocks: int = 0  # reserved at admission, not yet placed


class InplaceKVCache:
    """Owns the four regions, the block allocators and each live sequence's placement.

    Authoritative state: the host regions' bytes (shared memory, outliving any worker that
    attaches them) and the placement tables here. The device regions hold the window and
    transient ping-pong copies.
    """

    def __init__(self, config: CacheConfig, policy: Policy, *, region_handles=None):
        """region_handles: ([cpu_compute handle bytes per shard], cpu_transfer handle bytes) of regions a
        long-lived owner created: attached (and checked against config), not created, and left in
        place by close(). None: this cache creates and owns its regions."""
        self.config = config
        self.policy = policy
        fmt = config.format
        if region_handles is None:
            self.compute = [HostRegion.create("cpu_compute", fmt, config.compute_blocks_per_shard, shard=s)
                            for s in range(config.num_shards)]
            self.transfer = HostRegion.create("cpu_transfer", fmt, config.transfer_blocks)
        else:
            self.compute, self.transfer = _attach_regions(config, *region_handles)
        self.compute_alloc = [BlockAllocator(config.compute_blocks_per_shard) for _ in range(config.num_shards)]
        self.transfer_alloc = BlockAllocator(config.transfer_blocks)
        device = torch.device(config.device)
        window_shapes = [fmt.shape("gpu_window", config.max_seqs, d, window_tokens=config.window_tokens)
                         for d in fmt.stored_dims]
        self.window = [torch.zeros(s, dtype=fmt.torch_dtype, device=device) for s in window_shapes]
        self.pingpong = [torch.zeros(fmt.shape("gpu_pingpong", config.pingpong_blocks, d), dtype=fmt.torch_dtype,
                                     device=device) for d in fmt.stored_dims]
        self.seqs: dict[object, SequenceState] = {}
        self._free_slots = list(range(config.max_seqs - 1, -1, -1))
        self.last_transfer_s = 0.0
        self.last_transfer_tokens = 0
        self._pending: dict[int, tuple | None] = {}  # ping-pong buffer -> a started first chunk
        self._copy_stream = None

    # ---------------------------------------------------------------- capacity and lifecycle
    @property
    def block_size(self) -> int:
        return self.config.format.block_size

    def free_blocks(self) -> int:
        reserved = sum(s.reserved_blocks for s in self.seqs.values())
        return sum(a.num_free for a in self.compute_alloc) + self.transfer_alloc.num_free - reserved

    def blocks_needed(self, max_tokens: int) -> int:
        """Blocks a sequence of max_tokens can ever seal: all but the tokens still in its window."""
        return max_tokens // self.block_size

    def admit(self, seq_id, prompt_len: int, max_new_tokens: int) -> None:
        """Reserves capacity for prompt_len + max_new_tokens and routes the prompt's full blocks;
        raises CapacityError (nothing written, nothing reserved) when it cannot fit."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already admitted")
        if prompt_len < 1 or max_new_tokens < 0:
            raise ValueError(f"prompt_len must be >= 1 and max_new_tokens >= 0, got {prompt_len}, {max_new_tokens}")
        max_tokens = prompt_len + max_new_tokens
        needed = self.blocks_needed(max_tokens)
        if not self._free_slots:
            raise CapacityError(f"all {self.config.max_seqs} sequence slots are in use")
        if needed > self.free_blocks():
            raise CapacityError(f"sequence {seq_id!r} needs {needed} blocks for {max_tokens} tokens; "
                                f"{self.free_blocks()} are free (block_size {self.block_size})")
        state = SequenceState(slot=self._free_slots.pop(), prompt_len=prompt_len, max_tokens=max_tokens,
                              num_tokens=prompt_len, reserved_blocks=needed)
        self.seqs[seq_id] = state
        full_blocks = prompt_len // self.block_size
        self._place(seq_id, full_blocks)
        state.window_len = prompt_len - full_blocks * self.block_size

    def finish(self, seq_id) -> None:
        state = self._state(seq_id)
        for shard, alloc in enumerate(self.compute_alloc):
            alloc.free([p.block for p in state.blocks if p.region is Region.CPU_COMPUTE and p.shard == shard])
        self.transfer_alloc.free([p.block for p in state.blocks if p.region is Region.CPU_TRANSFER])
        self._free_slots.append(state.slot)
        del self.seqs[seq_id]

    def close(self) -> None:
        self._pending.clear()
        for region in [*self.compute, self.transfer]:
            region.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- writes
    def write_prefill(self, seq_id, layer: int, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """k [num_kv_heads, prompt_len, head_dim_k], v [num_kv_heads, prompt_len, head_dim_v] (None when V
        is inside K): the full blocks go straight to their placed regions, the rest to the window."""
        state = self._state(seq_id)
        self._check_layer(layer)
        if layer in state.prefilled_layers:
            raise ValueError(f"layer {layer} of sequence {seq_id!r} is already prefilled")
        arrays = self._stored(k, v, state.prompt_len)
        bs = self.block_size
        for index, placement in enumerate(state.blocks):
            block_rows = [a[:, index * bs:(index + 1) * bs] for a in arrays]
            self._write_block(placement, layer, block_rows)
        start = len(state.blocks) * bs
        for window, array in zip(self.window, arrays, strict=True):
            window[layer, state.slot, :, : state.window_len] = array[:, start:].to(window.device)
        state.prefilled_layers.add(layer)

    def append(self, seq_id, layer: int, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """k [num_kv_heads, head_dim_k], v [num_kv_heads, head_dim_v]: the new token of one layer, into
        the window. `commit` advances the sequence once every layer has its token."""
        state = self._state(seq_id)
        self._check_layer(layer)
        if len(state.prefilled_layers) != self.config.format.num_layers:
            raise ValueError(f"sequence {seq_id!r} must be prefilled in every layer before decoding")
        if state.num_tokens >= state.max_tokens:
            raise CapacityError(f"sequence {seq_id!r} reached its admitted {state.max_tokens} tokens")
        arrays = self._stored(k[:, None], None if v is None else v[:, None], 1)
        for window, array in zip(self.window, arrays, strict=True):
            window[layer, state.slot, :, state.window_len] = array[:, 0].to(window.device)

    def append_batch(self, seq_ids, layer: int, stored: list[torch.Tensor]) -> None:
        """One layer's new token of every sequence in one write per stored array: stored holds
        k [batch, num_kv_heads, head_dim_k] (and v [batch, num_kv_heads, head_dim_v] unless V is in K)."""
        self._check_layer(layer)
        fmt = self.config.format
        states = [self._state(s) for s in seq_ids]
        for seq_id, state in zip(seq_ids, states, strict=True):
            if len(state.prefilled_layers) != fmt.num_layers:
                raise ValueError(f"sequence {seq_id!r} must be prefilled in every layer before decoding")
            if state.num_tokens >= state.max_tokens:
                raise CapacityError(f"sequence {seq_id!r} reached its admitted {state.max_tokens} tokens")
        if len(stored) != len(fmt.stored_dims):
            raise ValueError(f"expected {len(fmt.stored_dims)} stored arrays (K{'' if fmt.v_in_k else ', V'})")
        for array, dim in zip(stored, fmt.stored_dims, strict=True):
            if tuple(array.shape) != (len(seq_ids), fmt.num_kv_heads, dim) or array.dtype != fmt.torch_dtype:
                raise ValueError(f"stored arrays must be [batch, num_kv_heads, head_dim] = "
                                 f"{[len(seq_ids), fmt.num_kv_heads, dim]} of {fmt.dtype}, got "
                                 f"{list(array.shape)} of {array.dtype}")
        device = self.window[0].device
        slots = torch.tensor([s.slot for s in states], device=device)
        positions = torch.tensor([s.window_len for s in states], device=device)
        for window, array in zip(self.window, stored, strict=True):
            window[layer, slots, :, positions] = array.to(device)

    def commit(self, seq_ids) -> None:
        """Each sequence gained one token in every layer; full windows flush to the host."""
        for seq_id in seq_ids:
            state = self._state(seq_id)
            state.num_tokens += 1
            state.window_len += 1
            if state.window_len == self.config.window_tokens:
                self._flush_window(seq_id)

    def _flush_window(self, seq_id) -> None:
        state = self._state(seq_id)
        count = self.config.window_tokens // self.block_size
        first = len(state.blocks)
        self._place(seq_id, count)
        bs = self.block_size
        for layer in range(self.config.format.num_layers):
            for i, placement in enumerate(state.blocks[first:]):
                rows = [w[layer, state.slot, :, i * bs:(i + 1) * bs] for w in self.window]
                self._write_block(placement, layer, rows)  # D2H of sealed blocks, one copy
        state.window_len = 0

    def _place(self, seq_id, count: int) -> None:
        """Chooses and allocates the regions of a sequence's next `count` sealed blocks."""
        if count == 0:
            return
        state = self._state(seq_id)
        bs = self.block_size
        cpu_tokens = sum(bs for p in state.blocks if p.region is Region.CPU_COMPUTE)
        regions = self.policy.route_blocks(cpu_tokens, len(state.blocks) * bs, [bs] * count, self.spilled_tokens())
        for region in regions:
            placement = self._allocate(region)
            state.blocks.append(placement)
            state.region_blocks.setdefault((placement.region, placement.shard), []).append(placement.block)
        state.reserved_blocks -= count

    def _allocate(self, preferred: Region) -> Placement:
        # The policy's region is a preference: when it is full, the other region takes the block
        # (admission reserved the total, so one of them has room).
        shard = max(range(len(self.compute_alloc)), key=lambda s: self.compute_alloc[s].num_free)
        order = [preferred, Region.CPU_TRANSFER if preferred is Region.CPU_COMPUTE else Region.CPU_COMPUTE]
        for region in order:
            alloc = self.compute_alloc[shard] if region is Region.CPU_COMPUTE else self.transfer_alloc
            if alloc.can_allocate(1):
                return Placement(region, shard if region is Region.CPU_COMPUTE else 0, alloc.allocate(1)[0])
        raise AssertionError("admission reserved a block that no region has")

    def _write_block(self, placement: Placement, layer: int, rows: list[torch.Tensor]) -> None:
        # rows: one [num_kv_heads, n <= block_size, dim] per stored array
        region = self.compute[placement.shard] if placement.region is Region.CPU_COMPUTE else self.transfer
        for array, row in zip(region.arrays, rows, strict=True):
            if placement.region is Region.CPU_COMPUTE:
                array[layer, :, placement.block, : row.shape[1]] = row
            else:
                array[layer, placement.block, :, : row.shape[1]] = row

    # ---------------------------------------------------------------- reads
    def spilled_tokens(self) -> int:
        """Tokens of all live sequences outside the window: the L of the perf model."""
        return sum(len(s.blocks) * self.block_size for s in self.seqs.values())

    def placed_share(self, seq_id) -> float:
        state = self._state(seq_id)
        if not state.blocks:
            return 0.0
        return sum(p.region is Region.CPU_COMPUTE for p in state.blocks) / len(state.blocks)

    def compute_source(self, layer: int, seq_ids, shard: int = 0) -> KVSource:
        """The tokens of seq_ids in one cpu_compute shard, as a paged source for the CPU kernel (views)."""
        region = self.compute[shard]
        k = region.k[layer].permute(1, 0, 2, 3)  # [num_blocks, num_kv_heads, block_size, head_dim_k]
        v = region.v[layer].permute(1, 0, 2, 3)
        lists = [self._state(s).region_blocks.get((Region.CPU_COMPUTE, shard), []) for s in seq_ids]
        return KVSource(k, v, *self._table(lists, k.device))

    def window_source(self, layer: int, seq_ids, pending_tokens: int = 0) -> KVSource:
        """The window tokens of seq_ids: each sequence's slot is one block of window_tokens.
        pending_tokens counts tokens appended in this step but not committed yet."""
        k = self.window[0][layer]  # [max_seqs, num_kv_heads, window_tokens, head_dim_k]
        v = k[..., : self.config.format.head_dim_v] if self.config.format.v_in_k else self.window[1][layer]
        slots = torch.tensor([[self._state(s).slot] for s in seq_ids], dtype=torch.int32, device=k.device)
        lens = torch.tensor([self._state(s).window_len + pending_tokens for s in seq_ids], dtype=torch.int32,
                            device=k.device)
        return KVSource(k, v, slots.reshape(len(seq_ids), 1), lens)

    def start_transfer(self, layer: int, seq_ids) -> None:
        """Starts copying the first ping-pong chunk of `layer` into buffer layer % 2: on CUDA on a side
        stream, returning at once, so layer l + 1's copy runs while layer l computes; on a CPU-only
        host inline. `transfer_chunks(layer, seq_ids)` then begins with it. The buffer must be free:
        the chunks of layer - 2 are consumed."""
        plan = self._transfer_plan(seq_ids)
        previous = self._pending.pop(layer % 2, None)
        if previous is not None:  # never two copies into one buffer at once
            self._wait(previous[3])
        if not plan:
            return
        if self.pingpong[0].is_cuda:
            stream = self._copy_stream or torch.cuda.Stream(device=self.pingpong[0].device)
            self._copy_stream = stream
            stream.wait_stream(torch.cuda.current_stream())
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record()
                self._copy_chunk(layer, plan[0])
                done.record()
            handle = (start, done)
        else:  # no device to overlap with: copy now, inline (a copy thread only competed for the cores)
            handle = self._timed_copy(layer, plan[0])
        self._pending[layer % 2] = (layer, tuple(seq_ids), plan[0], handle)

    def transfer_chunks(self, layer: int, seq_ids) -> Iterator[KVSource]:
        """Streams the cpu_transfer blocks of seq_ids for one layer into ping-pong buffer layer % 2, at
        most pingpong_blocks at a time, one DMA per span of consecutive blocks; yields each chunk as
        a paged source on the device, valid until the next chunk refills the buffer. A chunk started
        by `start_transfer` is waited for, not copied again. Records the copy time (the B of the
        perf model)."""
        pending = self._pending.pop(layer % 2, None)
        pending_s = self._wait(pending[3]) if pending is not None else 0.0  # the buffer is ours only after this
        self.last_transfer_s, self.last_transfer_tokens = 0.0, 0
        for index, chunk in enumerate(self._transfer_plan(seq_ids)):
            if index == 0 and pending is not None and pending[:3] == (layer, tuple(seq_ids), chunk):
                self.last_transfer_s += pending_s
            else:
                self.last_transfer_s += self._timed_copy(layer, chunk)
            self.last_transfer_tokens += len(chunk) * self.block_size
            lists = [[] for _ in seq_ids]
            for slot, (seq_index, _) in enumerate(chunk):
                lists[seq_index].append(slot)
            buffer = layer % 2
            k = self.pingpong[0][buffer]
            v = k[..., : self.config.format.head_dim_v] if self.config.format.v_in_k else self.pingpong[1][buffer]
            yield KVSource(k, v, *self._table(lists, k.device))

    def _transfer_plan(self, seq_ids) -> list[list[tuple[int, int]]]:
        """Chunks of (sequence index, cpu_transfer block), at most pingpong_blocks each."""
        blocks = [(i, block) for i, s in enumerate(seq_ids)
                  for block in self._state(s).region_blocks.get((Region.CPU_TRANSFER, 0), [])]
        capacity = self.config.pingpong_blocks
        return [blocks[start:start + capacity] for start in range(0, len(blocks), capacity)]

    def _copy_chunk(self, layer: int, chunk) -> None:
        buffer = layer % 2
        for dst, src, n in _spans([block for _, block in chunk]):
            for buf, array in zip(self.pingpong, self.transfer.arrays, strict=True):
                buf[buffer, dst:dst + n].copy_(array[layer, src:src + n], non_blocking=True)

    def _timed_copy(self, layer: int, chunk) -> float:
        began = time.perf_counter()
        self._copy_chunk(layer, chunk)
        if self.pingpong[0].is_cuda:  # the copies are asynchronous: time them to completion
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - began

    @staticmethod
    def _wait(handle) -> float:
        if isinstance(handle, tuple):  # CUDA events on the copy stream
            start, done = handle
            torch.cuda.current_stream().wait_event(done)
            done.synchronize()
            return start.elapsed_time(done) / 1e3
        return handle  # a host copy, already done: its seconds

    def shipped_compute_source(self, layer: int, seq_ids, shard: int = 0) -> KVSource:
        """The monolithic baseline: the cpu_compute blocks of seq_ids copied whole to the device from
        unpinned memory (one gather and one pageable copy per step), as a paged source there."""
        source = self.compute_source(layer, seq_ids, shard)
        per_seq = [self._state(s).region_blocks.get((Region.CPU_COMPUTE, shard), []) for s in seq_ids]
        index = torch.tensor([b for blocks in per_seq for b in blocks], dtype=torch.long)  # disjoint per sequence
        device = self.window[0].device
        k = source.k_cache.index_select(0, index).to(device)
        v = k[..., : self.config.format.head_dim_v] if self.config.format.v_in_k else \
            source.v_cache.index_select(0, index).to(device)
        lists, start = [], 0
        for blocks in per_seq:  # each sequence's blocks are consecutive in the shipped copy
            lists.append(list(range(start, start + len(blocks))))
            start += len(blocks)
        return KVSource(k, v, *self._table(lists, device))

    def sequence_kv(self, seq_id, layer: int) -> list[torch.Tensor]:
        """A copy of a sequence's stored arrays of one layer in logical token order: [num_kv_heads,
        num_tokens, dim] each. For checks and debugging, not the hot path."""
        state = self._state(seq_id)
        parts = [[] for _ in self.config.format.stored_dims]
        for p in state.blocks:
            region = self.compute[p.shard] if p.region is Region.CPU_COMPUTE else self.transfer
            for out, array in zip(parts, region.arrays, strict=True):
                out.append(array[layer, :, p.block] if p.region is Region.CPU_COMPUTE else array[layer, p.block])
        for out, window in zip(parts, self.window, strict=True):
            out.append(window[layer, state.slot, :, : state.window_len].cpu())
        return [torch.cat(out, dim=1) for out in parts]

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.window, *self.pingpong])

    # ---------------------------------------------------------------- invariants
    def check_integrity(self) -> None:
        """Every token of every live sequence is in exactly one region; allocators add up."""
        owned = {}
        for seq_id, state in self.seqs.items():
            placed = len(state.blocks) * self.block_size
            assert placed + state.window_len == state.num_tokens, f"{seq_id!r}: tokens do not add up"
            assert 0 <= state.window_len < self.config.window_tokens or state.num_tokens == state.max_tokens
            assert state.reserved_blocks >= 0, f"{seq_id!r}: negative reservation"
            assert len(state.blocks) + state.reserved_blocks == self.blocks_needed(state.max_tokens)
            by_region = {}
            for p in state.blocks:
                by_region.setdefault((p.region, p.shard), []).append(p.block)
            assert by_region == {k: v for k, v in state.region_blocks.items() if v}, f"{seq_id!r}: block lists differ"
            for p in state.blocks:
                key = (p.region, p.shard, p.block)
                assert key not in owned, f"block {key} is owned by {owned[key]!r} and {seq_id!r}"
                owned[key] = seq_id
        for shard, alloc in enumerate(self.compute_alloc):
            alloc.check_integrity()
            mine = {b for (r, s, b) in owned if r is Region.CPU_COMPUTE and s == shard}
            assert alloc.allocated == mine, f"cpu_compute shard {shard}: allocator and placements differ"
        self.transfer_alloc.check_integrity()
        assert self.transfer_alloc.allocated == {b for (r, _, b) in owned if r is Region.CPU_TRANSFER}
        slots = [s.slot for s in self.seqs.values()]
        assert len(set(slots)) == len(slots) and not set(slots) & set(self._free_slots)
        assert self.free_blocks() >= 0

    # ---------------------------------------------------------------- helpers
    def _state(self, seq_id) -> SequenceState:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id!r}") from None

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.config.format.num_layers:
            raise ValueError(f"layer {layer} is outside [0, {self.config.format.num_layers})")

    def _stored(self, k, v, num_tokens) -> list[torch.Tensor]:
        fmt = self.config.format
        arrays = [k] if fmt.v_in_k else [k, v]
        if not fmt.v_in_k and v is None:
            raise ValueError("v is required: this format stores V apart from K")
        for name, array, dim in zip(("k", "v"), arrays, fmt.stored_dims, strict=False):
            expected = (fmt.num_kv_heads, num_tokens, dim)
            if tuple(array.shape) != expected:
                raise ValueError(f"{name} must be [num_kv_heads, tokens, head_dim] = {list(expected)}, "
                                 f"got {list(array.shape)}")
            if array.dtype != fmt.torch_dtype:
                raise ValueError(f"{name} has dtype {array.dtype}, the cache stores {fmt.dtype}")
        return arrays

    def _table(self, lists, device) -> tuple[torch.Tensor, torch.Tensor]:
        width = max([len(blocks) for blocks in lists] + [1])
        table = torch.zeros((len(lists), width), dtype=torch.int32)
        for row, blocks in enumerate(lists):
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        lens = torch.tensor([len(blocks) * self.block_size for blocks in lists], dtype=torch.int32)
        return table.to(device), lens.to(device)


def _attach_regions(config: CacheConfig, compute_handles, transfer_handle):
    """Attaches an owner's regions, refusing any whose kind, format or size differs from config."""
    if len(compute_handles) != config.num_shards:
        raise ValueError(f"{len(compute_handles)} cpu_compute handles for {config.num_shards} shards")
    expected = [("cpu_compute", shard, config.compute_blocks_per_shard) for shard in range(config.num_shards)]
    expected.append(("cpu_transfer", 0, config.transfer_blocks))
    regions = []
    try:
        for payload, (kind, shard, num_blocks) in zip([*compute_handles, transfer_handle], expected, strict=True):
            region = HostRegion.attach(payload)
            regions.append(region)
            got = region.handle
            if (got.kind, got.shard, got.num_blocks, got.format) != (kind, shard, num_blocks, config.format):
                raise ValueError(f"region {got.shm_name!r} is {got.kind} shard {got.shard} of {got.num_blocks} "
                                 f"blocks; this cache needs {kind} shard {shard} of {num_blocks} blocks in "
                                 f"{config.format}")
    except BaseException:
        for region in regions:
            region.close()
        raise
    return regions[:-1], regions[-1]


def _spans(blocks: list[int]) -> Iterator[tuple[int, int, int]]:
    """(destination slot, first source block, count) of each run of consecutive source blocks."""
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            yield start, blocks[start], i - start
            start = i
