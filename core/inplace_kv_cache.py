"""InplaceKVCache: the KV cache whose tokens get their physical residency when they are written.

Four regions (DESIGN.md section 2):
    cpu_compute   host shared memory, head-major blocks in the CPU kernel's paired layout (kv_format),
                  one shard per NUMA node; the CPU attends it
    cpu_transfer  host shared memory (pinned where CUDA is present), block-major; streamed to the
                  device each step and attended there (attended in place when the device is the CPU)
    gpu_pingpong  two fixed buffers on the device, refilled per layer from cpu_transfer
    gpu_window    the newest window_tokens of each sequence, on the device

Prefill writes each layer's full blocks straight into their final region and the rest into the
window; decode appends to the window; a full window is flushed as sealed blocks to cpu_compute or
cpu_transfer, as the policy decides at that moment. Nothing moves after placement, and the
device memory of the cache does not depend on sequence length.

Prefix reuse (writescope.prefix_cache): a prompt's full blocks, once written in every layer, are
registered under the hash of their tokens and of every token before them; a sequence admitted with
a prompt whose first blocks are registered holds those blocks (where they were placed) instead of
new ones, and its prefill starts after them. A block is freed when no sequence holds it, unless it
is registered: it is then kept, and evicted (least recently used first) when room is needed.

A decode step reads through a `StepView` made once per step (`step_view`): the batch's block
tables and lengths of every region, gathered from tables kept as tensors (`BlockTables`) and the
step's ping-pong plan. Every layer of the step reads the same view; nothing in it loops over
blocks or tokens in Python.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from writescope import ops
from writescope.block_allocator import EXTENT_BLOCKS, BlockAllocator, CapacityError
from writescope.block_tables import BlockTables
from writescope.kv_format import PAIRED, KVFormat, from_paired, to_paired
from writescope.kv_regions import HUGE_PAGE_BYTES, PAGE_BYTES, HostMemoryError, HostRegion, check_segment_blocks
from writescope.ops import KVSource
from writescope.pingpong import PingPong, TransferChunk, plan_chunks
from writescope.policies import Policy, Region
from writescope.prefix_cache import PrefixCache, block_hashes


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
    max_blocks_per_seq: int | None = None  # None: as many as a region holds
    # None: attend cpu_transfer where it lies when the device is the CPU (a copy there buys nothing)
    transfer_in_place: bool | None = None
    segment_blocks: int | None = None  # blocks per segment of a host region (None: each region is one)
    host_kv_bytes: int | None = None  # host memory the KV may take at most (None: what the regions hold)
    host_limit_source: str = ""  # where host_kv_bytes comes from, for messages
    shard_nodes: tuple[int, ...] | None = None  # NUMA node of each cpu_compute shard's memory (None: unbound)
    huge_pages: bool = False  # host regions laid out in 2 MB pages and advised for them (HostRegion.create)
    extent_blocks: int = EXTENT_BLOCKS  # consecutive block ids a sequence fills before it takes others (BlockAllocator)

    def __post_init__(self):
        if self.max_blocks_per_seq is None:
            object.__setattr__(self, "max_blocks_per_seq", max(self.compute_blocks_per_shard, self.transfer_blocks, 1))
        if self.transfer_in_place is None:
            object.__setattr__(self, "transfer_in_place", torch.device(self.device).type == "cpu")
        for name in ("compute_blocks_per_shard", "transfer_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"CacheConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_seqs", "pingpong_blocks", "num_shards", "window_tokens", "max_blocks_per_seq",
                     "extent_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"CacheConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.window_tokens % self.format.block_size:
            raise ValueError(f"window_tokens ({self.window_tokens}) must be a multiple of block_size "
                             f"({self.format.block_size}): a full window flushes as whole blocks")
        for kind, blocks in (("cpu_compute", self.compute_blocks_per_shard), ("cpu_transfer", self.transfer_blocks)):
            check_segment_blocks(self.format, kind, blocks, self.region_segment_blocks(kind), self.page_bytes)
        if self.shard_nodes is not None and len(self.shard_nodes) != self.num_shards:
            raise ValueError(f"shard_nodes {self.shard_nodes} must name one NUMA node per shard ({self.num_shards})")

    @property
    def page_bytes(self) -> int:
        return HUGE_PAGE_BYTES if self.huge_pages else PAGE_BYTES

    def region_blocks(self, kind: str) -> int:
        return self.compute_blocks_per_shard if kind == "cpu_compute" else self.transfer_blocks

    def region_segment_blocks(self, kind: str) -> int:
        return max(self.region_blocks(kind), 1) if self.segment_blocks is None else self.segment_blocks

    @property
    def block_bytes(self) -> int:
        """Host bytes of one block: every layer and stored array (the same in both host regions)."""
        return self.format.nbytes("cpu_transfer", 1)

    def slack_blocks(self) -> int:
        """Blocks of host memory committed beyond the placed ones at most, fragmentation aside: per
        region the segment being filled and one idle segment kept for the next blocks."""
        regions = [("cpu_compute", s) for s in range(self.num_shards)] + [("cpu_transfer", 0)]
        return sum(min(2 * self.region_segment_blocks(kind), self.region_blocks(kind)) for kind, _ in regions)

    def frontier_blocks(self) -> int:
        """Blocks of host memory each further live sequence may leave committed and unplaced: the
        segment its run is filling in every region of more than one segment (a sequence fills
        extents of its own, BlockAllocator, so two sequences no longer fill one segment together)."""
        regions = [("cpu_compute", s) for s in range(self.num_shards)] + [("cpu_transfer", 0)]
        return sum(self.region_segment_blocks(kind) for kind, _ in regions
                   if self.region_blocks(kind) > self.region_segment_blocks(kind))

    def host_budget_blocks(self) -> int:
        """Blocks every live sequence together may place and reserve: what the regions hold, and
        within host_kv_bytes (less the slack) where a host limit is set."""
        held = min(self.num_shards * self.compute_blocks_per_shard + self.transfer_blocks,
                   self.max_seqs * self.max_blocks_per_seq)  # what the regions hold, what admission can reserve
        memory = self.memory_blocks()
        return held if memory is None else max(0, min(held, memory))

    def memory_blocks(self) -> int | None:
        """Blocks host_kv_bytes holds less the slack (None: no host limit)."""
        return None if self.host_kv_bytes is None else self.host_kv_bytes // self.block_bytes - self.slack_blocks()

    def with_host_limit(self, max_host_kv_bytes: int | None = None, share: float = 1.0) -> CacheConfig:
        """This config under the host limit: max_host_kv_bytes, or what the machine has available
        where that is less (a shared-memory page that cannot be had would be a SIGBUS later, not an
        error), each region's address space cut to what the limit can hold. More sequences than fit
        at once are fine (admission waits, or refuses one that cannot fit alone); ValueError, before
        anything is allocated, when the limit cannot hold even one sequence of max_blocks_per_seq.
        share: this cache's part of the limit, where an engine keeps several caches (DeepSeek-V4)."""
        available, source = host_memory_available()
        limit, source = (available, source) if max_host_kv_bytes is None or available < max_host_kv_bytes else (
            max_host_kv_bytes, "max_host_kv_gb")
        if share != 1.0:
            limit, source = int(limit * share), f"{share:.1%} of {source}"
        segment = self.region_segment_blocks("cpu_transfer")
        most = -(-(limit // self.block_bytes) // segment) * segment  # blocks the limit holds, in whole segments
        config = replace(self, compute_blocks_per_shard=min(self.compute_blocks_per_shard, most),
                         transfer_blocks=min(self.transfer_blocks, most), host_kv_bytes=limit, host_limit_source=source)
        if config.host_budget_blocks() < self.max_blocks_per_seq:
            gib, slack = 2**30, config.slack_blocks() * self.block_bytes
            sequence = self.max_blocks_per_seq * self.block_bytes
            raise ValueError(f"the host KV limit, {limit / gib:.3f} GiB ({source}), cannot hold one sequence of "
                             f"{self.max_blocks_per_seq * self.format.block_size} tokens: its KV takes "
                             f"{sequence / gib:.3f} GiB, and the regions' segments being filled or kept (two per "
                             f"region) up to {slack / gib:.3f} GiB more; lower max_seq_len"
                             f"{' or raise max_host_kv_gb' if source.endswith('max_host_kv_gb') else ''}")
        return config

    def host_tokens(self) -> int:
        """Tokens the host regions can hold for all sequences together."""
        return self.host_budget_blocks() * self.format.block_size

    def capacity_line(self) -> str:
        """What fits and what it takes: the startup line of an engine."""
        fmt, gib, mib = self.format, 2**30, 2**20
        window = fmt.nbytes("gpu_window", self.max_seqs, window_tokens=self.window_tokens)
        pingpong = 0 if self.transfer_in_place else fmt.nbytes("gpu_pingpong", self.pingpong_blocks)
        limit = "none" if self.host_kv_bytes is None else \
            f"{self.host_kv_bytes / gib:.2f} GiB, from {self.host_limit_source}"
        segment = self.region_segment_blocks("cpu_transfer")
        return (f"KV capacity: {self.max_seqs} sequences of up to {self.max_blocks_per_seq * fmt.block_size} tokens, "
                f"{self.host_tokens()} tokens of host KV in all ({self.block_bytes // fmt.block_size} bytes a token; "
                f"host limit {limit}); host regions take memory in segments of {segment * fmt.block_size} tokens "
                f"({segment * self.block_bytes / mib:.1f} MiB) as KV is placed; device {(window + pingpong) / gib:.2f} "
                f"GiB: a window of {self.window_tokens} tokens a sequence ({window / gib:.2f} GiB), ping-pong "
                f"{pingpong / gib:.2f} GiB")


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
    blocks: list[Placement] = field(default_factory=list)  # logical order (the tables hold them by region)
    window_len: int = 0
    prefilled_layers: set[int] = field(default_factory=set)
    prefill_written: dict[int, int] = field(default_factory=dict)  # layer -> prompt tokens written so far
    reserved_blocks: int = 0  # reserved at admission, not yet placed
    block_names: list[bytes] = field(default_factory=list)  # the prompt's full blocks' prefix hashes
    registered_blocks: int = 0  # the first blocks whose names are registered (shared ones included)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission (not prefilled)


@dataclass(frozen=True)
class StepView:
    """What every layer of one decode step reads, made once per step by `InplaceKVCache.step_view`.
    Tables are int32 block tables [batch, width] with seq_lens [batch] int32 in tokens."""

    seq_ids: tuple
    key: int  # distinct per step: a prefetched chunk belongs to this view only
    slots: torch.Tensor  # [batch] int64, on the host
    window_slots: torch.Tensor  # [batch] int64, on the device: each sequence's window row
    window_positions: torch.Tensor  # [batch] int64, on the device: where this step's token goes
    window_lens: torch.Tensor  # [batch] int32, on the device: window tokens with this step's
    window_table: torch.Tensor  # [batch, 1] int32, on the device: the window as a one-block table
    compute: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per cpu_compute shard, on the host
    compute_shard_tokens: tuple[int, ...]  # per cpu_compute shard: a shard with none costs no kernel call
    compute_tokens: int
    transfer: tuple[torch.Tensor, torch.Tensor]  # cpu_transfer, on the host
    transfer_tokens: int
    chunks: tuple[TransferChunk, ...]  # the ping-pong plan (empty when cpu_transfer is attended in place)
    # [batch * num_kv_heads] int64, on the device: where each (sequence, kv head) of this step's token
    # goes among the rows of one layer's window flattened to [max_seqs * num_kv_heads * window_tokens, dim]
    window_rows: torch.Tensor


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
            self.compute = [create_region(config, "cpu_compute", shard=s) for s in range(config.num_shards)]
            self.transfer = create_region(config, "cpu_transfer")
        else:
            self.compute, self.transfer = _attach_regions(config, *region_handles)
            for region in [*self.compute, self.transfer]:
                region.release_all()  # nothing in them is live: a new cache commits what it places
        self.compute_alloc = [BlockAllocator(config.compute_blocks_per_shard,
                                             config.region_segment_blocks("cpu_compute"), config.extent_blocks)
                              for _ in range(config.num_shards)]
        self.transfer_alloc = BlockAllocator(config.transfer_blocks, config.region_segment_blocks("cpu_transfer"),
                                             config.extent_blocks)
        self.device = torch.device(config.device)
        window_shapes = [fmt.shape("gpu_window", config.max_seqs, d, window_tokens=config.window_tokens)
                         for d in fmt.stored_dims]
        self.window = [torch.zeros(s, dtype=fmt.torch_dtype, device=self.device) for s in window_shapes]
        self._window_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per layer, window_source's
        self.pingpong = None if config.transfer_in_place else PingPong(fmt, config.pingpong_blocks, self.device)
        self.tables = BlockTables([*self._compute_keys(), _TRANSFER], config.max_seqs, config.max_blocks_per_seq,
                                  fmt.block_size)
        self.seqs: dict[object, SequenceState] = {}
        self._free_slots = list(range(config.max_seqs - 1, -1, -1))
        self._steps = 0
        self.prefix = PrefixCache()

    # ---------------------------------------------------------------- capacity and lifecycle
    @property
    def block_size(self) -> int:
        return self.config.format.block_size

    def free_blocks(self) -> int:
        """Blocks a new sequence may still reserve: free in the regions (or held only by the prefix
        cache, which gives them up when asked) and within the host budget, less the segments the
        live sequences' runs are filling (CacheConfig.frontier_blocks)."""
        reserved = sum(s.reserved_blocks for s in self.seqs.values())
        held = self.allocated_blocks() - self.prefix.num_evictable  # blocks live sequences hold
        in_regions = sum(a.num_free for a in self.compute_alloc) + self.transfer_alloc.num_free + \
            self.prefix.num_evictable - reserved
        free = min(in_regions, self.config.host_budget_blocks() - held - reserved)
        memory = self.config.memory_blocks()
        if memory is not None:  # the memory the live sequences' runs may leave committed
            free = min(free, memory - held - reserved - len(self.seqs) * self.config.frontier_blocks())
        return max(0, free)

    def allocated_blocks(self) -> int:
        """Blocks allocated in every region: the live sequences' (a shared one once) and the prefix cache's."""
        return sum(a.num_allocated for a in self.compute_alloc) + self.transfer_alloc.num_allocated

    def blocks_needed(self, max_tokens: int) -> int:
        """Blocks a sequence of max_tokens can ever seal: all but the tokens still in its window."""
        return max_tokens // self.block_size

    def block_names(self, prompt: list[int]) -> list[bytes]:
        """The prefix-cache names of a prompt's full blocks (what admit takes to reuse them):
        computed once per request, by its caller, not again each time its admission is tried."""
        return block_hashes(prompt, self.block_size, len(prompt) // self.block_size)

    def admit(self, seq_id, prompt_len: int, max_new_tokens: int, block_names: list[bytes] | None = None) -> int:
        """Reserves capacity for prompt_len + max_new_tokens and routes the prompt's full blocks;
        raises CapacityError (nothing written, nothing reserved) when it cannot fit. block_names:
        the prompt's (block_names(prompt)), to reuse the registered blocks of its prefix and
        register its own (None: no reuse). Returns the prompt tokens found so (whole blocks, always
        fewer than prompt_len: the prefill starts there, every layer)."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already admitted")
        if prompt_len < 0 or max_new_tokens < 0:
            raise ValueError(f"prompt_len and max_new_tokens must be >= 0, got {prompt_len}, {max_new_tokens}")
        max_tokens = prompt_len + max_new_tokens
        full_blocks = prompt_len // self.block_size
        if block_names is not None and len(block_names) != full_blocks:
            raise ValueError(f"{len(block_names)} block names for a prompt of {full_blocks} full blocks")
        names = block_names or []
        # the prompt's last token is always prefilled: its logits give the first new token
        shared = self.prefix.match(names[: (prompt_len - 1) // self.block_size])
        needed = self.blocks_needed(max_tokens) - len(shared)
        if not self._free_slots:
            raise CapacityError(f"all {self.config.max_seqs} sequence slots are in use")
        free = self.free_blocks() - self.prefix.evictable_among(shared)  # those are held again, not free
        if needed > free:
            raise CapacityError(f"sequence {seq_id!r} needs {needed} blocks for {max_tokens} tokens"
                                f"{f' ({len(shared)} more are shared)' if shared else ''}; {free} are free "
                                f"(block_size {self.block_size}) of the {self.config.host_budget_blocks()} the host "
                                f"holds")
        state = SequenceState(slot=self._free_slots.pop(), prompt_len=prompt_len, max_tokens=max_tokens,
                              num_tokens=prompt_len, reserved_blocks=needed, block_names=names,
                              registered_blocks=len(shared), cached_tokens=len(shared) * self.block_size)
        self.seqs[seq_id] = state
        self.prefix.acquire(shared)
        self._append_placements(state, shared)
        if block_names is not None:
            self.prefix.count_lookup(prompt_len, state.cached_tokens)
        try:
            self._place(seq_id, full_blocks - len(shared))
        except HostMemoryError as error:  # nothing written yet: the sequence was never admitted
            self.finish(seq_id)
            raise CapacityError(f"sequence {seq_id!r}: {error}") from None
        state.window_len = prompt_len - full_blocks * self.block_size
        state.prefill_written = dict.fromkeys(range(self.config.format.num_layers), state.cached_tokens) \
            if state.cached_tokens else {}
        if prompt_len == 0:  # nothing to prefill (a model's compressed entries before its first window closes)
            state.prefilled_layers = set(range(self.config.format.num_layers))
        return state.cached_tokens

    def finish(self, seq_id) -> None:
        state = self._state(seq_id)
        self._free([p for p in state.blocks if self.prefix.release(p)])  # registered blocks stay cached
        for _, alloc in self._regions():
            alloc.release_owner(seq_id)
        self.tables.clear(state.slot)
        self._free_slots.append(state.slot)
        del self.seqs[seq_id]

    def close(self) -> None:
        if self.pingpong is not None:
            self.pingpong.clear()
        for region in [*self.compute, self.transfer]:
            region.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- writes
    def write_prefill(self, seq_id, layer: int, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """k [num_kv_heads, prompt_len, head_dim_k], v [num_kv_heads, prompt_len, head_dim_v] (None when V
        is inside K): the whole prompt of one layer (write_prefill_chunk for a part of it)."""
        self._stored(k, v, self._state(seq_id).prompt_len)
        self.write_prefill_chunk(seq_id, layer, 0, k, v)

    def write_prefill_chunk(self, seq_id, layer: int, start: int, k: torch.Tensor,
                            v: torch.Tensor | None = None) -> None:
        """k [num_kv_heads, n, head_dim_k], v [num_kv_heads, n, head_dim_v] (None when V is inside K):
        prompt tokens [start, start + n) of one layer. Chunks of a layer come in order, each starting
        where the last ended, on a block boundary; every chunk but the last ends on one too. Tokens of
        full blocks go straight to their placed regions, the prompt's last partial block to the window."""
        state = self._state(seq_id)
        self._check_layer(layer)
        if layer in state.prefilled_layers:
            raise ValueError(f"layer {layer} of sequence {seq_id!r} is already prefilled")
        written = state.prefill_written.get(layer, 0)
        if k.dim() != 3:
            self._stored(k, v, 0)  # raises: names the shape expected
        end = start + k.shape[1]
        if start != written or end <= start or end > state.prompt_len or (
                end < state.prompt_len and end % self.block_size):
            raise ValueError(f"prefill of layer {layer} of sequence {seq_id!r} continues at token {written} with "
                             f"whole blocks of {self.block_size} (the last chunk ends at the prompt's "
                             f"{state.prompt_len}); got tokens [{start}, {end})")
        arrays = self._stored(k, v, end - start)
        placed = len(state.blocks) * self.block_size
        if min(end, placed) > start:
            first, count = start // self.block_size, (min(end, placed) - start) // self.block_size
            blocks = [a[:, : count * self.block_size].unflatten(1, (count, self.block_size)) for a in arrays]
            self._write_blocks(state.blocks[first:first + count], [layer], [b[None] for b in blocks])
        if end > placed:  # the prompt's last partial block
            begin = max(start, placed)
            for window, array in zip(self.window, arrays, strict=True):
                window[layer, state.slot, :, begin - placed: end - placed] = array[:, begin - start:].to(window.device)
        state.prefill_written[layer] = end
        if end == state.prompt_len:
            state.prefilled_layers.add(layer)
        self._register_written(state)

    def _register_written(self, state: SequenceState) -> None:
        """Registers the prompt blocks now written in every layer (a chunk's, once its last layer is in)."""
        if state.registered_blocks >= len(state.block_names):
            return
        layers = self.config.format.num_layers
        written = min(state.prefill_written.get(layer, 0) for layer in range(layers))
        upto = min(written // self.block_size, len(state.block_names))
        for index in range(state.registered_blocks, upto):
            self.prefix.register(state.blocks[index], state.block_names[index])
        state.registered_blocks = max(state.registered_blocks, upto)

    def append(self, seq_id, layer: int, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """k [num_kv_heads, head_dim_k], v [num_kv_heads, head_dim_v]: the new token of one layer, into
        the window. `commit` advances the sequence once every layer has its token."""
        state = self._state(seq_id)
        self._check_layer(layer)
        self._check_decodable(seq_id, state)
        arrays = self._stored(k[:, None], None if v is None else v[:, None], 1)
        for window, array in zip(self.window, arrays, strict=True):
            window[layer, state.slot, :, state.window_len] = array[:, 0].to(window.device)

    def append_batch(self, seq_ids, layer: int, stored: list[torch.Tensor]) -> None:
        """One layer's new token of every sequence (stored: k [batch, num_kv_heads, head_dim_k], and v
        [batch, num_kv_heads, head_dim_v] unless V is in K); outside a decode step's view."""
        self._check_layer(layer)
        self.write_window(layer, self.step_view(seq_ids), stored)

    def write_window(self, layer: int, view: StepView, stored: list[torch.Tensor]) -> None:
        """A decode step's new token of one layer, for the view's batch, one write per stored array."""
        fmt = self.config.format
        if len(stored) != len(fmt.stored_dims):
            raise ValueError(f"expected {len(fmt.stored_dims)} stored arrays (K{'' if fmt.v_in_k else ', V'})")
        for array, dim in zip(stored, fmt.stored_dims, strict=True):
            if tuple(array.shape) != (len(view.seq_ids), fmt.num_kv_heads, dim) or array.dtype != fmt.torch_dtype:
                raise ValueError(f"stored arrays must be [batch, num_kv_heads, head_dim] = "
                                 f"{[len(view.seq_ids), fmt.num_kv_heads, dim]} of {fmt.dtype}, got "
                                 f"{list(array.shape)} of {array.dtype}")
        # one row copy per stored array (an index_put over (slot, position) took about 25 us each here)
        for window, array, dim in zip(self.window, stored, fmt.stored_dims, strict=True):
            window[layer].view(-1, dim).index_copy_(0, view.window_rows, array.reshape(-1, dim).to(window.device))

    def commit(self, seq_ids) -> None:
        """Each sequence gained one token in every layer; full windows flush to the host."""
        for seq_id in seq_ids:
            state = self._state(seq_id)
            state.num_tokens += 1
            state.window_len += 1
            if state.window_len == self.config.window_tokens:
                self._flush_window(seq_id)

    def _flush_window(self, seq_id) -> None:
        """The full window's sealed blocks of every layer, written to their regions (D2H, one copy
        per region and stored array)."""
        state = self._state(seq_id)
        count = self.config.window_tokens // self.block_size
        first = len(state.blocks)
        self._place(seq_id, count)
        layers = list(range(self.config.format.num_layers))
        rows = [w[:, state.slot].unflatten(2, (count, self.block_size)) for w in self.window]  # [L, kv, n, bs, dim]
        self._write_blocks(state.blocks[first:], layers, rows)
        state.window_len = 0

    def _place(self, seq_id, count: int) -> None:
        """Chooses and allocates the regions of a sequence's next `count` sealed blocks, and appends
        them to its block tables (and its transfer spans)."""
        if count == 0:
            return
        state = self._state(seq_id)
        bs = self.block_size
        cpu_tokens = sum(bs for p in state.blocks if p.region is Region.CPU_COMPUTE)
        # r* for the spilled load once these blocks are placed: before them, a batch's first prompt
        # would be routed for a load of 0 tokens (where r* is 0, whatever the model says)
        spilled_after = self.spilled_tokens() + count * bs
        regions = self.policy.route_blocks(cpu_tokens, len(state.blocks) * bs, [bs] * count, spilled_after)
        new: list[Placement] = []
        try:
            for region in regions:
                new.append(self._allocate(region, seq_id))
        except BaseException:  # a segment that could not be committed: the blocks had so far go back
            self._free(new)
            raise
        self._append_placements(state, new)
        state.reserved_blocks -= count

    def _append_placements(self, state: SequenceState, new: list[Placement]) -> None:
        """The sequence's next blocks, at the end of its placements, tables and transfer spans."""
        state.blocks.extend(new)
        for key in [*self._compute_keys(), _TRANSFER]:
            blocks = [p.block for p in new if (p.region, p.shard) == key]
            if blocks:
                self.tables.append(key, state.slot, blocks)
        self.tables.extend_spans(state.slot, [p.block for p in new if p.region is Region.CPU_TRANSFER])

    def _free(self, placements: list[Placement]) -> None:
        """The blocks go back to their allocators, and segments left idle give back their memory."""
        for shard, alloc in enumerate(self.compute_alloc):
            alloc.free([p.block for p in placements if p.region is Region.CPU_COMPUTE and p.shard == shard])
        self.transfer_alloc.free([p.block for p in placements if p.region is Region.CPU_TRANSFER])
        for region, alloc in self._regions():
            _release_idle_segments(region, alloc)

    def _allocate(self, preferred: Region, seq_id) -> Placement:
        # The policy's region is a preference: when it is full, the other region takes the block
        # (admission reserved the total, so one of them has room, or the prefix cache gives one up).
        # The sequence owns its ids (BlockAllocator): its blocks run on in the extents it holds.
        self._evict_for(preferred)
        shard = max(range(len(self.compute_alloc)), key=lambda s: self.compute_alloc[s].num_free)
        order = [preferred, Region.CPU_TRANSFER if preferred is Region.CPU_COMPUTE else Region.CPU_COMPUTE]
        for region in order:
            alloc = self.compute_alloc[shard] if region is Region.CPU_COMPUTE else self.transfer_alloc
            if alloc.can_allocate(1):
                block = alloc.allocate(1, owner=seq_id)[0]
                host = self.compute[shard] if region is Region.CPU_COMPUTE else self.transfer
                nodes = self.config.shard_nodes
                node = nodes[shard] if nodes and region is Region.CPU_COMPUTE else None
                try:  # the block's segment takes memory with its first block
                    host.commit(alloc.segment_of(block), node)
                except BaseException:
                    alloc.free([block])
                    raise
                return Placement(region, shard if region is Region.CPU_COMPUTE else 0, block)
        raise AssertionError("admission reserved a block that no region has")

    def _evict_for(self, preferred: Region) -> None:
        """Evicts cached unused blocks, least recently used first, while no region has a free block
        or the allocated blocks reach the host budget (cached ones count there: they hold memory);
        from the preferred region first, so that the block lands where the policy wants it."""
        budget = self.config.host_budget_blocks()
        while self.prefix.num_evictable:
            full = not (self.transfer_alloc.num_free or any(a.num_free for a in self.compute_alloc))
            if not full and self.allocated_blocks() < budget:
                return
            block = self.prefix.evict(lambda p: p.region is preferred) or self.prefix.evict()
            self._free([block])

    def _write_blocks(self, placements: list[Placement], layers: list[int], rows: list[torch.Tensor]) -> None:
        """rows: one [len(layers), num_kv_heads, len(placements), block_size, dim] per stored array, the
        placements' blocks in order; each region's blocks are written in one indexed copy."""
        layer_index = torch.tensor(layers)
        for key in [*self._compute_keys(), _TRANSFER]:
            picked = [i for i, p in enumerate(placements) if (p.region, p.shard) == key]
            if not picked:
                continue
            which = torch.tensor(picked)
            blocks = torch.tensor([placements[i].block for i in picked])
            region = self.compute[key[1]] if key[0] is Region.CPU_COMPUTE else self.transfer
            for (name, _), array, row in zip(self.config.format.stored_arrays, region.arrays, rows, strict=True):
                chosen = row.index_select(2, which.to(row.device)).to("cpu")  # [L, kv, n, bs, dim]
                if key[0] is Region.CPU_COMPUTE:  # head-major [layer, kv_head, block, <block layout>]
                    if self.config.format.compute_layout == PAIRED:
                        chosen = to_paired(name, chosen)  # the kernel's layout, written once here
                    array[layer_index[:, None], :, blocks[None, :]] = chosen.movedim(2, 1)
                else:  # block-major [layer, block, kv_head, token, dim]
                    array[layer_index[:, None], blocks[None, :]] = chosen.permute(0, 2, 1, 3, 4)

    # ---------------------------------------------------------------- reads
    def occupancy(self) -> dict[str, float]:
        """The fraction of each host region's blocks in use (the shards of cpu_compute together)."""
        config = self.config
        compute_used = sum(len(a.allocated) for a in self.compute_alloc)
        return {"cpu_compute": compute_used / max(config.compute_blocks_per_shard * config.num_shards, 1),
                "cpu_transfer": len(self.transfer_alloc.allocated) / max(config.transfer_blocks, 1)}

    def placed_tokens(self) -> dict[str, int]:
        """The live sequences' tokens in each region and in the device window (a snapshot: metrics
        read this from another thread than the engine's)."""
        placed = {"cpu_compute": 0, "cpu_transfer": 0, "gpu_window": 0}
        for state in list(self.seqs.values()):
            for p in list(state.blocks):
                placed[p.region.value] += self.block_size
            placed["gpu_window"] += state.window_len
        return placed

    def spilled_tokens(self) -> int:
        """Tokens of all live sequences outside the window: the L of the perf model."""
        # a snapshot of the sequences: metrics read this from another thread than the engine's
        return sum(len(s.blocks) * self.block_size for s in list(self.seqs.values()))

    def wanted_share(self) -> float | None:
        """The CPU share the policy wants now for the live sequences' spilled KV (the tokens outside
        the window, as when it routes blocks), or None with nothing spilled. Only a preview: asking
        does not change what the policy chooses for the next blocks."""
        spilled = self.spilled_tokens()
        return self.policy.preview_share(spilled) if spilled else None

    def placed_share(self, seq_id) -> float:
        state = self._state(seq_id)
        if not state.blocks:
            return 0.0
        return sum(p.region is Region.CPU_COMPUTE for p in state.blocks) / len(state.blocks)

    def step_view(self, seq_ids, pending_tokens: int = 1) -> StepView:
        """The tables of one decode step for seq_ids, checked once here for the whole step: every
        sequence prefilled and with room for the step's token. pending_tokens: the tokens the step
        appends to the window before it is attended (1 in a decode step)."""
        states = [self._state(s) for s in seq_ids]
        for seq_id, state in zip(seq_ids, states, strict=True):
            self._check_decodable(seq_id, state, appending=pending_tokens > 0)
        self._steps += 1
        # The step's small tensors from Python lists, a few torch.tensor calls and views of them: a
        # chain of torch ops on a few elements costs 5-10 us an op on a small host.
        slot_list = [s.slot for s in states]
        position_list = [s.window_len for s in states]
        slots_and_positions = torch.tensor([slot_list, position_list], dtype=torch.int64)
        slots = slots_and_positions[0]
        compute = [self.tables.batch(key, slots) for key in self._compute_keys()]
        transfer = self.tables.batch(_TRANSFER, slots)
        chunks = () if self.pingpong is None else plan_chunks(
            [self.tables.spans.get(s.slot, []) for s in states], self.pingpong.capacity, self.block_size, self.device)
        device = self.device
        window_slots, window_positions = slots_and_positions.to(device)
        window_lens, window_slots32 = torch.tensor([[p + pending_tokens for p in position_list], slot_list],
                                                   dtype=torch.int32, device=device)
        num_kv_heads, window_tokens = self.config.format.num_kv_heads, self.config.window_tokens
        window_rows = [(slot * num_kv_heads + head) * window_tokens + position
                       for slot, position in zip(slot_list, position_list, strict=True) for head in range(num_kv_heads)]
        return StepView(tuple(seq_ids), self._steps, slots, window_slots, window_positions, window_lens,
                        window_slots32[:, None],
                        tuple((table, lens) for table, lens, _ in compute), tuple(n for _, _, n in compute),
                        sum(n for _, _, n in compute),
                        transfer[:2], transfer[2], chunks, torch.tensor(window_rows, dtype=torch.int64, device=device))

    def compute_sources(self, layer: int, view: StepView) -> list[KVSource]:
        """The view's cpu_compute tokens of one layer, one paged source per shard (views, on the host)."""
        return [compute_source(region, layer, table, lens)
                for region, (table, lens) in zip(self.compute, view.compute, strict=True)]

    def window_source(self, layer: int, view: StepView) -> KVSource:
        """The view's window tokens of one layer (this step's token included): each sequence's slot is
        one block of window_tokens."""
        kv = self._window_views.get(layer)
        if kv is None:  # made once per layer (the window never moves), as compute_source's views
            k = self.window[0][layer]  # [max_seqs, num_kv_heads, window_tokens, head_dim_k]
            v = k[..., : self.config.format.head_dim_v] if self.config.format.v_in_k else self.window[1][layer]
            kv = self._window_views[layer] = (ops.keep_numpy_view(k), ops.keep_numpy_view(v))
        return KVSource(*kv, view.window_table, view.window_lens)

    def start_transfer(self, layer: int, view: StepView) -> None:
        """Starts copying the layer's first ping-pong chunk into buffer layer % 2 (on CUDA on a side
        stream, returning at once), so layer l + 1's copy runs while layer l computes; nothing when
        cpu_transfer is attended in place or the view has no transfer tokens."""
        if view.chunks:
            self.pingpong.prefetch(layer, view.chunks[0], self.transfer.arrays, view.key)

    def device_source_groups(self, layer: int, view: StepView) -> Iterator[list[KVSource]]:
        """The sources the device attends for one layer, in groups attended one call each: the window
        and cpu_transfer, in place (one group) or through the ping-pong buffer, one group per chunk
        (one in all when the buffer holds the layer's transfer blocks). A group is valid until the
        next is asked for: the next chunk refills the buffer."""
        window = self.window_source(layer, view)
        if self.pingpong is None:
            transfer = [] if not view.transfer_tokens else [KVSource(
                self.transfer.k[layer], self.transfer.v[layer], *view.transfer)]
            yield [window, *transfer]
            return
        if not view.chunks:
            yield [window]
        for index, chunk in enumerate(view.chunks):
            source = self.pingpong.source(layer, chunk, self.transfer.arrays, view.key, first=index == 0)
            yield [window, source] if index == 0 else [source]

    def shipped_compute_sources(self, layer: int, view: StepView) -> list[KVSource]:
        """The monolithic baseline: the view's cpu_compute blocks of every shard copied whole to the
        device from unpinned memory (one gather and one pageable copy per shard, array and step)."""
        sources = []
        for source in self.compute_sources(layer, view):
            used = torch.arange(source.block_table.shape[1])[None, :] < (source.seq_lens // self.block_size)[:, None]
            index = source.block_table[used].long()  # row-major: each sequence's blocks consecutive
            k = source.k_cache.index_select(0, index).to(self.device)
            # paired blocks ship as they are: the C++ kernel reads them, and ops.attend gives the torch and
            # Triton backends a token-major copy made on the device
            v = k[..., : self.config.format.head_dim_v] if self.config.format.v_in_k else \
                source.v_cache.index_select(0, index).to(self.device)
            counts = source.seq_lens // self.block_size
            starts = torch.cumsum(counts, 0) - counts
            table = (starts[:, None] + torch.arange(source.block_table.shape[1])[None, :]).to(torch.int32)
            sources.append(KVSource(k, v, table.to(self.device), source.seq_lens.to(self.device)))
        return sources

    def sequence_kv(self, seq_id, layer: int, num_tokens: int | None = None,
                    first_token: int = 0) -> list[torch.Tensor]:
        """A copy of a sequence's stored arrays of one layer in logical token order: [num_kv_heads,
        tokens, dim] each, on the host. num_tokens: only tokens [first_token, num_tokens), whole placed
        blocks (a piece of what a chunked prefill has written so far); None: every token. For checks
        and for the prefix of a chunked prefill, not the decode step's path."""
        state = self._state(seq_id)
        fmt = self.config.format
        blocks = state.blocks
        if num_tokens is not None:
            if num_tokens % self.block_size or num_tokens > len(blocks) * self.block_size or first_token % \
                    self.block_size or not 0 <= first_token < num_tokens:
                raise ValueError(f"tokens [{first_token}, {num_tokens}) must be whole blocks among the sequence's "
                                 f"{len(blocks)} placed blocks of {self.block_size}")
            blocks = blocks[first_token // self.block_size: num_tokens // self.block_size]
        bs = self.block_size
        gathered = [torch.empty(fmt.num_kv_heads, len(blocks), bs, dim, dtype=fmt.torch_dtype)
                    for dim in fmt.stored_dims]
        by_region: dict[tuple, list[tuple[int, int]]] = {}  # (region, shard) -> [(logical index, block id)]
        for index, p in enumerate(blocks):
            by_region.setdefault((p.region, p.shard), []).append((index, p.block))
        for (region_name, shard), items in by_region.items():  # one gather per region and stored array
            logical = torch.tensor([i for i, _ in items])
            physical = torch.tensor([b for _, b in items])
            region = self.compute[shard] if region_name is Region.CPU_COMPUTE else self.transfer
            for (name, _), out, array in zip(fmt.stored_arrays, gathered, region.arrays, strict=True):
                if region_name is Region.CPU_TRANSFER:  # [block, kv_head, token, dim]
                    chosen = array[layer].index_select(0, physical).movedim(0, 1)
                else:  # head-major [kv_head, block, <block layout>]
                    chosen = array[layer].index_select(1, physical)
                    chosen = from_paired(name, chosen) if fmt.compute_layout == PAIRED else chosen
                out[:, logical] = chosen
        placed = [array.flatten(1, 2) for array in gathered]  # [num_kv_heads, blocks * block_size, dim]
        if num_tokens is not None:
            return placed
        return [torch.cat([p, window[layer, state.slot, :, : state.window_len].cpu()], dim=1)
                for p, window in zip(placed, self.window, strict=True)]

    def device_bytes(self) -> int:
        window = sum(t.numel() * t.element_size() for t in self.window)
        return window + (self.pingpong.nbytes() if self.pingpong is not None else 0)

    # ---------------------------------------------------------------- invariants
    def check_integrity(self) -> None:
        """Every token of every live sequence is in exactly one region; tables, spans and
        allocators agree with the placements."""
        owned, held = {}, {}
        for seq_id, state in self.seqs.items():
            placed = len(state.blocks) * self.block_size
            assert placed + state.window_len == state.num_tokens, f"{seq_id!r}: tokens do not add up"
            assert 0 <= state.window_len < self.config.window_tokens or state.num_tokens == state.max_tokens
            assert state.reserved_blocks >= 0, f"{seq_id!r}: negative reservation"
            assert len(state.blocks) + state.reserved_blocks == self.blocks_needed(state.max_tokens)
            for key in [*self._compute_keys(), _TRANSFER]:
                expected = [p.block for p in state.blocks if (p.region, p.shard) == key]
                assert self.tables.row(key, state.slot) == expected, f"{seq_id!r}: the {key} table differs"
            spans = self.tables.spans.get(state.slot, [])
            assert [b for first, n in spans for b in range(first, first + n)] == \
                self.tables.row(_TRANSFER, state.slot), f"{seq_id!r}: transfer spans differ from its table"
            assert state.registered_blocks <= len(state.block_names)
            for p in state.blocks:
                key = (p.region, p.shard, p.block)
                assert key not in owned or self.prefix.users(p), f"block {key} is owned by {owned[key]!r} and " \
                                                                 f"{seq_id!r} and not shared"
                owned[key] = seq_id
                held[p] = held.get(p, 0) + 1
        self.prefix.check_integrity(held)
        for p in self.prefix.evictable_blocks():  # cached, held by none: still allocated, still in memory
            owned[(p.region, p.shard, p.block)] = "the prefix cache"
        for shard, alloc in enumerate(self.compute_alloc):
            alloc.check_integrity()
            mine = {b for (r, s, b) in owned if r is Region.CPU_COMPUTE and s == shard}
            assert alloc.allocated == mine, f"cpu_compute shard {shard}: allocator and placements differ"
        self.transfer_alloc.check_integrity()
        assert self.transfer_alloc.allocated == {b for (r, _, b) in owned if r is Region.CPU_TRANSFER}
        slots = [s.slot for s in self.seqs.values()]
        assert len(set(slots)) == len(slots) and not set(slots) & set(self._free_slots)
        assert self.free_blocks() >= 0
        regions = self._regions()
        for (region_name, shard, block), seq_id in owned.items():
            region, alloc = regions[shard if region_name is Region.CPU_COMPUTE else -1]
            assert alloc.segment_of(block) in region.committed, f"{seq_id!r}: block {block} is in no committed segment"
        for region, alloc in regions:
            idle = [s for s in region.committed if not alloc.segment_in_use(s)]
            assert len(idle) <= 1, f"{region.kind}: {len(idle)} idle segments keep memory (one at most)"

    def capacity_text(self) -> str:
        """What is free, for a refusal: tokens free of the host's, and the host limit."""
        config = self.config
        limit = "" if config.host_kv_bytes is None else \
            f" (host limit {config.host_kv_bytes / 2**30:.2f} GiB, from {config.host_limit_source})"
        return (f"{self.free_blocks() * self.block_size} tokens of host KV are free of the {config.host_tokens()} "
                f"it holds{limit}")

    def host_resident_bytes(self) -> int:
        """Bytes of the host regions in memory now (their committed segments' pages)."""
        return sum(region.resident_bytes() for region, _ in self._regions())

    def host_memory(self) -> dict[str, dict[str, int]]:
        """Each host region by name (cpu_compute_<shard>, cpu_transfer): its size (address space) and
        its bytes in memory now, as the Ray region owner reports them (RegionOwner.memory)."""
        memory = {f"cpu_compute_{i}": region.memory() for i, region in enumerate(self.compute)}
        return {**memory, "cpu_transfer": self.transfer.memory()}

    def placed_bytes(self) -> int:
        """Host bytes of the KV placed now: every sealed block of every live sequence (a shared one
        once), and the prefix cache's unused ones."""
        return self.allocated_blocks() * self.config.block_bytes

    # ---------------------------------------------------------------- helpers
    def _regions(self) -> list[tuple[HostRegion, BlockAllocator]]:
        return [*zip(self.compute, self.compute_alloc, strict=True), (self.transfer, self.transfer_alloc)]

    def _compute_keys(self) -> list[tuple[Region, int]]:
        return [(Region.CPU_COMPUTE, shard) for shard in range(self.config.num_shards)]

    def _state(self, seq_id) -> SequenceState:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id!r}") from None

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.config.format.num_layers:
            raise ValueError(f"layer {layer} is outside [0, {self.config.format.num_layers})")

    def _check_decodable(self, seq_id, state: SequenceState, appending: bool = True) -> None:
        if len(state.prefilled_layers) != self.config.format.num_layers:
            raise ValueError(f"sequence {seq_id!r} must be prefilled in every layer before decoding")
        if appending and state.num_tokens >= state.max_tokens:
            raise CapacityError(f"sequence {seq_id!r} reached its admitted {state.max_tokens} tokens")

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


_TRANSFER = (Region.CPU_TRANSFER, 0)


def host_memory_available() -> tuple[int, str]:
    """(bytes, where the figure comes from): MemAvailable, or less where this process's cgroup
    allows less (a container's memory limit, which shared memory counts against)."""
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    available, source = int(fields["MemAvailable"].split()[0]) * 1024, "MemAvailable"
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max" and int(limit) - used < available:
            available, source = int(limit) - used, "the cgroup's memory.max"
    except (OSError, ValueError):
        pass  # no cgroup v2 limit to read: MemAvailable it is
    return available, source


def create_region(config: CacheConfig, kind: str, shard: int = 0, **options) -> HostRegion:
    """A host region as config sizes it (options: HostRegion.create's pin and label)."""
    return HostRegion.create(kind, config.format, config.region_blocks(kind),
                             segment_blocks=config.region_segment_blocks(kind), shard=shard,
                             huge_pages=config.huge_pages, **options)


def _release_idle_segments(region: HostRegion, alloc: BlockAllocator) -> None:
    """Segments with no placed block give their memory back, but for the lowest one: the next block
    placed likely goes there (ids go lowest first, and so do the extents a sequence takes), without
    committing memory again."""
    idle = sorted(s for s in region.committed if not alloc.segment_in_use(s))
    for index in idle[1:]:
        region.release(index)


def compute_source(region: HostRegion, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor) -> KVSource:
    """One layer of a cpu_compute shard as a paged source, in its own block layout (views, on the host):
    [num_blocks, num_kv_heads, <block layout>] each, with the given table and lengths."""
    kv = region.layer_views.get(layer)
    if kv is None:
        if region.handle.format.compute_layout == PAIRED:
            k, v = (array[layer].transpose(0, 1) for array in region.arrays)
        else:
            k, v = region.k[layer].transpose(0, 1), region.v[layer].transpose(0, 1)
        kv = region.layer_views[layer] = (ops.keep_numpy_view(k), ops.keep_numpy_view(v))
    return KVSource(*kv, block_table, seq_lens)


def one_token_blocks(array: torch.Tensor) -> torch.Tensor:
    """A token-major array of one layer with one KV head ([..., tokens, head_dim]) as blocks of one
    token: [all its tokens, 1 kv head, 1, head_dim], a view. A table of token indices into it is a
    block table, so the paged kernels attend any selection of its tokens in place."""
    return array.reshape(-1, 1, 1, array.shape[-1])


def selected_source(region: HostRegion, layer: int, token_table: torch.Tensor, seq_lens: torch.Tensor) -> KVSource:
    """Chosen tokens of one layer of a cpu_compute shard whose format has one KV head read as both K
    and V (DeepSeek-V4's entries): token_table [num_seqs, width] int32 indices of tokens in the shard
    (each row's first seq_lens[row] count), in place."""
    fmt = region.handle.format
    if fmt.num_kv_heads != 1 or not fmt.v_in_k:
        raise ValueError(f"a selection of tokens reads a region of one KV head whose V is its K; this one has "
                         f"{fmt.num_kv_heads} KV heads, v_in_k={fmt.v_in_k}")
    blocks = one_token_blocks(region.arrays[0][layer])
    return KVSource(blocks, blocks, token_table, seq_lens)


def _attach_regions(config: CacheConfig, compute_handles, transfer_handle):
    """Attaches an owner's regions, refusing any whose kind, format or size differs from config."""
    if len(compute_handles) != config.num_shards:
        raise ValueError(f"{len(compute_handles)} cpu_compute handles for {config.num_shards} shards")
    expected = [("cpu_compute", shard) for shard in range(config.num_shards)] + [("cpu_transfer", 0)]
    regions = []
    try:
        for payload, (kind, shard) in zip([*compute_handles, transfer_handle], expected, strict=True):
            region = HostRegion.attach(payload)
            regions.append(region)
            got = region.handle
            num_blocks, segment_blocks = config.region_blocks(kind), config.region_segment_blocks(kind)
            if (got.kind, got.shard, got.num_blocks, got.segment_blocks, got.format, got.page_bytes) != (
                    kind, shard, num_blocks, segment_blocks, config.format, config.page_bytes):
                raise ValueError(f"region {got.shm_name!r} is {got.kind} shard {got.shard} of {got.num_blocks} "
                                 f"blocks in segments of {got.segment_blocks}, pages of {got.page_bytes} bytes; this "
                                 f"cache needs {kind} shard {shard} of {num_blocks} blocks in segments of "
                                 f"{segment_blocks}, pages of {config.page_bytes} bytes, in {config.format}")
    except BaseException:
        for region in regions:
            region.close()
        raise
    return regions[:-1], regions[-1]
