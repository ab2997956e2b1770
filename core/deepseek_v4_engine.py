"""DeepSeek-V4 on InplaceKVCache: its native sparse attention composed with the CPU/GPU split.

A V4 layer attends two things (see `models.deepseek_v4`): the newest `sliding_window` tokens, kept
on the device per sequence (`SequenceStates`: the window region is exactly that), and compressed
entries, one per `rate` tokens, which are the long-range KV. The entries are what this module
places: one InplaceKVCache per compression rate (the CSA layers', the HCA layers'), whose
"tokens" are entries. An entry is written once, when its window of tokens closes: into the cache's
device window, flushed as sealed blocks to cpu_compute or cpu_transfer where the policy routes
them, like any block. Per decode step and layer:
- HCA: every entry, split as for any model: the device attends its window and cpu_transfer (in
  place on a CPU host, through the ping-pong buffer beside a GPU), the CPU kernel cpu_compute.
- CSA: the indexer (on the device) picks the top-k entries per query. The selection is split by
  where each entry lies. cpu_compute's are attended in place by the CPU kernel: it reads a
  token-major region as blocks of one token, so a selection is a table of token indices into the
  region. The window's and cpu_transfer's are the device's: attended in place too on a CPU host;
  beside a GPU gathered into one contiguous pinned span and copied as one DMA (GatherBuffers: two
  spans and two device buffers for alternate layers, as the ping-pong buffers are).
The partials (sliding window, device entries, CPU entries) merge by LSE, and the sinks enter as an
extra term of the softmax's denominator. The policy is fed the entries each side attended, so the
perf model sees the bytes the sparse step moves, not the context length.

On Ray (executor="ray") the region owner holds one set of regions per entry cache and each CPU
worker serves its shard of every cache over its one channel: a request names the cache (region)
and whether its table indexes blocks (HCA, dense) or single tokens (a CSA selection's share).

The request loop (admission, sampling, stop handling, streaming, chunked prefill between decode
steps) is Engine's; this engine brings its own model, KV and step. A prompt is prefilled in chunks
of prefill_chunk_tokens, each ending where every cache's entries fill whole blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque

import torch

from writescope import ops
from writescope.block_allocator import CapacityError
from writescope.config import EngineConfig
from writescope.engine import PROVISIONAL_MODEL, Engine, StepTimes, _DeviceClock, _Request, _torch_threads
from writescope.executor import LocalExecutor, device_side
from writescope.inplace_kv_cache import CacheConfig, InplaceKVCache, one_token_blocks, selected_source
from writescope.kv_format import KVFormat
from writescope.loading import engine_cache_config
from writescope.models.deepseek_v4 import (
    CSA,
    HCA,
    DeepseekV4Config,
    DeepseekV4Forward,
    DeepseekV4Model,
    SequenceStates,
)
from writescope.policies import Policy, Region, check_policy, make_policy
from writescope.prompts import PromptEncoder
from writescope.sampling import Sampled

log = logging.getLogger(__name__)

COMPUTE, TRANSFER = 0, 1  # region codes of a sequence's placed entry blocks


@dataclasses.dataclass(frozen=True)
class EntryFormat:
    """The entries of one layer type as a model the cache sizing reads: one shared KV head whose V is
    all of K (V4 reads one tensor as both)."""

    num_layers: int
    head_dim: int

    def kv_format(self, dtype: str, block_size: int) -> KVFormat:
        return KVFormat(self.num_layers, 1, self.head_dim, self.head_dim, dtype=dtype, block_size=block_size,
                        v_in_k=True)


@dataclasses.dataclass
class _Sequence:
    slot: int  # row of the SequenceStates
    num_tokens: int  # tokens committed (prompt + generated): the next token's position


class PlacedBlocks:
    """Each sequence's placed entry blocks by logical index, as tensors kept up to date as blocks are
    placed (a flush converts only its new blocks): what splitting a CSA selection reads each step."""

    def __init__(self):
        self.rows: dict[tuple[str, object], torch.Tensor] = {}  # (kind, seq) -> [n, 3]: code, block, shard

    def of(self, kind: str, cache: InplaceKVCache, seq_id) -> torch.Tensor:
        blocks = cache.seqs[seq_id].blocks
        held = self.rows.get((kind, seq_id))
        known = 0 if held is None else held.shape[0]
        if known < len(blocks):
            new = torch.tensor([[COMPUTE if p.region is Region.CPU_COMPUTE else TRANSFER, p.block, p.shard]
                                for p in blocks[known:]], dtype=torch.int64)
            held = new if held is None else torch.cat([held, new])
            self.rows[(kind, seq_id)] = held
        return held if held is not None else torch.zeros((0, 3), dtype=torch.int64)

    def batch(self, kind: str, cache: InplaceKVCache, seq_ids):
        """-> (region codes, physical blocks, shards) [B, n] int64 and the entries they hold [B], on the
        host; n: the most blocks any of the sequences has placed (rows padded past their own)."""
        rows = [self.of(kind, cache, s) for s in seq_ids]
        width = max([r.shape[0] for r in rows] + [1])
        table = torch.zeros((len(rows), width, 3), dtype=torch.int64)
        table[..., 0] = TRANSFER
        for row, held in enumerate(rows):
            table[row, : held.shape[0]] = held
        placed = torch.tensor([r.shape[0] * cache.block_size for r in rows], dtype=torch.int64)
        return table[..., 0], table[..., 1], table[..., 2], placed

    def forget(self, seq_id) -> None:
        for key in [k for k in self.rows if k[1] == seq_id]:
            del self.rows[key]


def entry_cache_configs(cfg: DeepseekV4Config, kv_dtype: torch.dtype, *, block_size: int, window_tokens: int,
                        max_batch_size: int, max_seq_len: int, num_shards: int, pingpong_blocks: int | None,
                        device: str, max_host_kv_bytes: int | None) -> dict[str, CacheConfig]:
    """The entry caches' configs, by layer type (CSA, HCA: those the model has), under the host limit:
    each cache takes the part of it its entries take of the whole (a CSA entry covers csa_rate tokens,
    an HCA entry hca_rate), so that together they stay within it."""
    configs = {}
    for kind in (CSA, HCA):
        layers = cfg.layers_of(kind)
        if layers:
            configs[kind] = engine_cache_config(EntryFormat(len(layers), cfg.head_dim), kv_dtype,
                                                block_size=block_size, max_batch_size=max_batch_size,
                                                max_seq_len=max(max_seq_len // _rate(cfg, kind), block_size),
                                                num_shards=num_shards, window_tokens=window_tokens,
                                                pingpong_blocks=pingpong_blocks, device=device)
    bytes_per_token = {kind: c.format.token_bytes / _rate(cfg, kind) for kind, c in configs.items()}
    total = sum(bytes_per_token.values())
    limited = {}
    for kind, config in configs.items():
        try:
            limited[kind] = config.with_host_limit(max_host_kv_bytes, share=bytes_per_token[kind] / total)
        except ValueError as error:  # its "tokens" are entries: say so, and what they stand for
            raise ValueError(f"{kind} entries (one per {_rate(cfg, kind)} tokens, {max_seq_len} tokens a sequence "
                             f"at most): {error}") from None
    return limited


def _rate(cfg: DeepseekV4Config, kind: str) -> int:
    return cfg.csa_rate if kind == CSA else cfg.hca_rate


class EntryCaches:
    """The KV of a DeepSeek-V4 engine: an InplaceKVCache of compressed entries per compressed layer
    type (configs: entry_cache_configs), and each sequence's token count and state slot. Admission
    reserves, in each cache, the entries the sequence's prompt and max_new_tokens can produce.
    region_handles: per layer type, the handles of regions made elsewhere (a Ray region owner) to
    attach instead of creating them."""

    def __init__(self, cfg: DeepseekV4Config, configs: dict[str, CacheConfig], policy: Policy, *,
                 max_batch_size: int, region_handles: dict | None = None):
        self.cfg = cfg
        self.policy = policy
        self.caches: dict[str, InplaceKVCache] = {}
        self.where: dict[int, tuple[str, int]] = {}  # model layer -> (layer type, its layer in that cache)
        try:
            for kind, config in configs.items():
                self.caches[kind] = InplaceKVCache(config, policy, region_handles=(region_handles or {}).get(kind))
                self.where.update({layer: (kind, index) for index, layer in enumerate(cfg.layers_of(kind))})
        except BaseException:
            self.close()
            raise
        self.seqs: dict[object, _Sequence] = {}
        self.placed = PlacedBlocks()
        self._free_slots = list(range(max_batch_size - 1, -1, -1))

    def rate(self, kind: str) -> int:
        return _rate(self.cfg, kind)

    def admit(self, seq_id, prompt_len: int, max_new_tokens: int, block_names=None) -> int:
        """Reserves each cache's entries for prompt_len + max_new_tokens tokens; CapacityError (nothing
        kept) when a cache or the slots cannot hold them. Returns 0: no prompt tokens are reused."""
        if not self._free_slots:
            raise CapacityError(f"all {len(self.seqs)} sequence slots are in use")
        admitted = []
        try:
            for kind, cache in self.caches.items():
                rate = self.rate(kind)
                prompt_entries = prompt_len // rate
                cache.admit(seq_id, prompt_entries, (prompt_len + max_new_tokens) // rate - prompt_entries)
                admitted.append(cache)
        except BaseException:
            for cache in admitted:
                cache.finish(seq_id)
            raise
        self.seqs[seq_id] = _Sequence(self._free_slots.pop(), prompt_len)
        return 0

    def finish(self, seq_id) -> None:
        for cache in self.caches.values():
            if seq_id in cache.seqs:
                cache.finish(seq_id)
        self.placed.forget(seq_id)
        self._free_slots.append(self.seqs.pop(seq_id).slot)

    def close(self) -> None:
        for cache in self.caches.values():
            cache.close()

    def capacity_text(self) -> str:
        return "; ".join(f"{kind} entries (one per {self.rate(kind)} tokens): {cache.capacity_text()}"
                         for kind, cache in self.caches.items())

    def check_integrity(self) -> None:
        for cache in self.caches.values():
            cache.check_integrity()


@dataclasses.dataclass
class _EntryStep:
    """One decode step's reading of the entry caches: each cache's view (window lengths counting the
    entries this step writes), which sequences close a window, and each sequence's placed blocks by
    logical index (for the CSA selection's split)."""

    seq_ids: tuple
    views: dict
    closes: dict  # layer type -> [B] bool: the sequences whose window closes this step
    window_tokens: dict  # layer type -> entries in the batch's windows this step (counted on the host)
    blocks: dict  # layer type -> (codes [B, n], physical [B, n], shard [B, n], placed entries [B]) on the host
    # per attended layer: (CPU tokens, CPU s, device tokens, device clock marker, span), for Engine._account
    layers: list = dataclasses.field(default_factory=list)


class SplitEntries:
    """The EntryStore of the engine: entries written to the caches, attended split between the
    device and the CPU (module docstring)."""

    def __init__(self, caches: EntryCaches, cpu_partials: dict, policy: Policy, device: torch.device):
        self.caches = caches
        self.cpu_partials = cpu_partials
        self.policy = policy
        self.device = device
        self.backend = "triton" if device.type == "cuda" else "cpu"
        # the device side attends its share of a CSA selection where it lies (a CPU host) or gathered
        # into one span and copied (beside a GPU); tests take the second path on the CPU too
        self.device_in_place = device.type == "cpu"
        self.clock = _DeviceClock(device)
        self.step: _EntryStep | None = None
        # layer type -> entries the CPU and the device attended, and those the device read from
        # cpu_transfer (beside a GPU: copied over PCIe)
        self.attended: dict[str, dict[str, int]] = {}
        self.gather_s = 0.0  # host time gathering CSA selections into the device's span
        self.gathers: dict[str, GatherBuffers] = {}  # layer type -> its staging and device buffers (beside a GPU)
        self.prefill_seq = None  # the sequence a prefill writes

    # ------------------------------------------------------------------ writes
    def write_many(self, layer, slot, entries, first):
        kind, index = self.caches.where[layer]
        cache = self.caches.caches[kind]
        cache.write_prefill_chunk(self.prefill_seq, index, first, entries.to(cache.config.format.torch_dtype)[None])

    def read(self, layer, slot, count):
        kind, index = self.caches.where[layer]
        k = self.caches.caches[kind].sequence_kv(self.prefill_seq, index, count)[0]  # [1 kv head, count, dim]
        return k[0].to(self.device)

    def write(self, layer, slots, entries):
        """entries [n, head_dim] of the sequences at slots (those whose window closed), into the cache's
        window where the step's view puts each sequence's next entry."""
        kind, index = self.caches.where[layer]
        cache, view = self.caches.caches[kind], self.step.views[kind]
        rows = self.step.closes[kind].nonzero()[:, 0].to(view.window_slots.device)
        window = cache.window[0][index]  # [max_seqs, 1, window_tokens, head_dim]
        window[view.window_slots[rows], 0, view.window_positions[rows]] = entries.to(window.dtype)

    # ------------------------------------------------------------------ attention
    def attend(self, layer, slots, q, scale, selected):
        kind, index = self.caches.where[layer]
        began = time.perf_counter()
        if selected is None:
            cpu, device, moved = self._dense(kind, index, q, scale)
        else:
            cpu, device, moved = self._sparse(kind, index, q, scale, selected)
        span = time.perf_counter() - began
        attended = self.attended.setdefault(kind, {"cpu": 0, "device": 0, "transfer": 0})
        attended["cpu"] += 0 if cpu is None else cpu.tokens
        attended["device"] += device.tokens
        attended["transfer"] += moved
        if cpu is None:
            self.step.layers.append((0, 0.0, device.tokens, device.seconds, span))
            return device.out, device.lse
        self.step.layers.append((cpu.tokens, cpu.seconds, device.tokens, device.seconds, span))
        return ops.merge([(cpu.out.to(device.out.device), cpu.lse.to(device.out.device)), (device.out, device.lse)])

    def _dense(self, kind, index, q, scale):
        """Every entry: the cache's own split (window + cpu_transfer on the device, cpu_compute on the CPU)."""
        cache, view = self.caches.caches[kind], self.step.views[kind]
        ships = self.policy.ships_cpu_compute
        cache.start_transfer(index, view)
        cpu, (out, lse), marker = self._both_sides(
            kind, None if ships else lambda partial: partial.attend(index, q.to("cpu"), view, scale),
            lambda: device_side(cache, index, view, q, scale, self.backend, ships_compute=ships))
        moved = view.transfer_tokens + (view.compute_tokens if ships else 0)
        return cpu, ops.Partial(out, lse, moved + self.step.window_tokens[kind], marker), moved

    def _sparse(self, kind, index, q, scale, selected):
        """The indexer's selection [B, k] (-1: none), split by where each selected entry lies. The CPU
        attends cpu_compute's selected entries in place: the C++ kernel reads a token-major region as
        blocks of one token, so a selection is a table of token indices into it. The device attends the
        window's and cpu_transfer's: in place too on a CPU host; beside a GPU gathered into one pinned
        span and copied once (monolithic: cpu_compute's with them)."""
        cache = self.caches.caches[kind]
        codes, physical, shards, placed = self.step.blocks[kind]
        selected = selected.to("cpu")
        valid = selected >= 0
        in_window = valid & (selected >= placed[:, None])
        block = torch.where(valid & ~in_window, selected // cache.block_size, 0)
        token = physical.gather(1, block) * cache.block_size + selected % cache.block_size  # within its region
        code = codes.gather(1, block)
        in_compute = valid & ~in_window & (code == COMPUTE)
        on_transfer = valid & ~in_window & (code == TRANSFER)
        shard = shards.gather(1, block)
        ships = self.policy.ships_cpu_compute
        cpu_tokens = 0 if ships else int(in_compute.sum())

        def send_cpu(partial):
            selection = [_token_table(token, in_compute & (shard == s)) for s in range(len(cache.compute))]
            return partial.attend_selected(index, q.to("cpu"), selection, cpu_tokens, scale)

        device_path = self._device_in_place if self.device_in_place else self._device_gathered
        cpu, (out, lse), marker = self._both_sides(
            kind, send_cpu if cpu_tokens else None,
            lambda: device_path(kind, index, q, scale, selected, placed, token, in_window, on_transfer,
                                in_compute if ships else None, shard))
        device_tokens = int(in_window.sum()) + int(on_transfer.sum()) + (int(in_compute.sum()) if ships else 0)
        moved = int(on_transfer.sum()) + (int(in_compute.sum()) if ships else 0)
        return cpu, ops.Partial(out, lse, device_tokens, marker), moved

    def _both_sides(self, kind, send_cpu, run_device):
        """send_cpu: (CPUPartial) -> PendingPartial, or None when the CPU has nothing; run_device: () ->
        (out, lse). -> (the CPU's Partial or None, the device's (out, lse), its clock marker). Which goes
        first: the CPU's request where the partial runs elsewhere (the CPU workers compute while the
        device side runs here), else the device's work (asynchronous beside a GPU: the kernel then runs
        in this thread while the GPU computes)."""
        partial = self.cpu_partials[kind]
        pending = send_cpu(partial) if send_cpu is not None and partial.runs_elsewhere else None
        started = self.clock.start()
        device = run_device()
        stopped = self.clock.stop(started)
        if send_cpu is not None and not partial.runs_elsewhere:
            pending = send_cpu(partial)
        return None if pending is None else pending.result(), device, stopped

    def _window_tokens(self, kind, selected, placed):
        """Selected window entries as token indices into the window's [max_seqs x window_tokens] rows."""
        cache, view = self.caches.caches[kind], self.step.views[kind]
        return view.window_slots.cpu()[:, None] * cache.config.window_tokens + (selected - placed[:, None])

    def _device_in_place(self, kind, index, q, scale, selected, placed, token, in_window, on_transfer, in_compute,
                         shard):
        cache = self.caches.caches[kind]
        sources = [_token_source(cache.window[0][index], self._window_tokens(kind, selected, placed), in_window),
                   _token_source(cache.transfer.arrays[0][index], token, on_transfer)]
        if in_compute is not None:
            sources += _compute_sources(cache, index, token, in_compute, shard)
        return ops.attend(q, sources, scale, "cpu")

    def _device_gathered(self, kind, index, q, scale, selected, placed, token, in_window, on_transfer, in_compute,
                         shard):
        """The device's share gathered into one span: cpu_transfer's (and, shipped, cpu_compute's) rows
        into the layer's pinned staging span, one copy to its device buffer, then the window's rows
        on the device."""
        cache = self.caches.caches[kind]
        if kind not in self.gathers:
            fmt = cache.config.format
            self.gathers[kind] = GatherBuffers(cache.config.max_seqs * self.caches.cfg.index_topk, fmt.head_dim_k,
                                               fmt.torch_dtype, self.device)
        began = time.perf_counter()
        rows = self.gathers[kind].staging(index, selected.shape)
        rows[on_transfer] = one_token_blocks(cache.transfer.arrays[0][index])[token[on_transfer], 0, 0]
        chosen = on_transfer
        if in_compute is not None:
            for s, region in enumerate(cache.compute):
                here = in_compute & (shard == s)
                rows[here] = one_token_blocks(region.arrays[0][index])[token[here], 0, 0]
            chosen = chosen | in_compute
        self.gather_s += time.perf_counter() - began
        device_rows = self.gathers[kind].copy(index, rows)
        window = one_token_blocks(cache.window[0][index])
        window_token = self._window_tokens(kind, selected, placed)
        device_rows[in_window.to(self.device)] = window[window_token[in_window].to(self.device), 0, 0]
        return _attend_rows(q, device_rows, (chosen | in_window).to(self.device), scale, self.backend)


class GatherBuffers:
    """Where the device's share of a CSA selection travels beside a GPU: two pinned host staging
    spans and two device buffers of `rows` entries each, used by alternate layers (layer % 2), as
    the ping-pong buffers are. A layer's selected rows are gathered into its staging span (one
    contiguous span, however scattered the entries lie in the regions), then copied to its device
    buffer as one DMA on a side stream, which the compute stream waits for. A staging span is
    refilled only after its last copy finished (the host waits for that copy's event: two layers
    back, long done), a device buffer only after the compute that read it (the side stream waits
    for the compute stream)."""

    def __init__(self, rows: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        cuda = device.type == "cuda"
        self.head_dim = head_dim
        self._staging = [torch.zeros(rows * head_dim, dtype=dtype, pin_memory=cuda) for _ in range(2)]
        self._device = [torch.zeros(rows * head_dim, dtype=dtype, device=device) for _ in range(2)]
        self._stream = torch.cuda.Stream(device=device) if cuda else None
        self._copied: list = [None, None]  # the event of each staging span's last copy

    def staging(self, layer: int, shape) -> torch.Tensor:
        """The layer's staging span as [B, k, head_dim] (shape: the selection's [B, k]), free to fill."""
        buffer = layer % 2
        if self._copied[buffer] is not None:
            self._copied[buffer].synchronize()
            self._copied[buffer] = None
        return self._staging[buffer][: shape[0] * shape[1] * self.head_dim].view(*shape, self.head_dim)

    def copy(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """rows (the layer's filled staging span) -> the same rows in its device buffer."""
        buffer = layer % 2
        target = self._device[buffer][: rows.numel()].view(rows.shape)
        if self._stream is None:
            return target.copy_(rows)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            target.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        torch.cuda.current_stream().wait_event(event)
        self._copied[buffer] = event
        return target


def _token_table(tokens, chosen):
    """tokens [B, k] indices into a region's tokens, chosen [B, k] -> (table [B, k] int32, lens [B]
    int32): each row's chosen tokens first, as a table of one-token blocks."""
    order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)
    lens = chosen.sum(dim=1).to(torch.int32)
    return torch.where(chosen.gather(1, order), tokens.gather(1, order), 0).to(torch.int32), lens


def _token_source(array, tokens, chosen):
    """A paged source over `array`'s tokens (token-major, one KV head) holding each row's chosen
    tokens (tokens, chosen: as _token_table)."""
    blocks = one_token_blocks(array)
    return ops.KVSource(blocks, blocks, *_token_table(tokens, chosen))


def _compute_sources(cache, index, token, chosen, shard):
    """The chosen entries of cpu_compute, one source per shard, in place."""
    return [selected_source(region, index, *_token_table(token, chosen & (shard == s)))
            for s, region in enumerate(cache.compute)]


def _attend_rows(q, rows, chosen, scale, backend):
    """q [B, H, D]; rows [B, k, D] of which chosen [B, k] -> the partial over each row's chosen entries:
    compacted to the front of the row, one block per sequence, through the backend's kernel."""
    order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)
    packed = rows.gather(1, order[..., None].expand(-1, -1, rows.shape[-1]))
    blocks = packed[:, None]  # [B blocks, 1 kv head, k, D]
    table = torch.arange(rows.shape[0], dtype=torch.int32, device=rows.device)[:, None]
    lens = chosen.sum(dim=1).to(torch.int32)
    return ops.attend(q, [ops.KVSource(blocks, blocks, table, lens)], scale, backend)


class DeepseekV4Engine(Engine):
    """Engine's request loop over DeepSeek-V4 (module docstring): prefill whole prompts, decode the
    running batch with the sliding windows on the device and the entries split."""

    def __init__(self, model: DeepseekV4Model, tokenizer, *, policy: Policy, caches: EntryCaches, executor,
                 max_batch_size: int, max_seq_len: int,
                 prefill_chunk_tokens: int = EngineConfig.prefill_chunk_tokens):
        # what the request loop reads (Engine.__init__ builds the other models' task graph and cache)
        self.model = model
        self.config: DeepseekV4Config = model.config
        self.tokenizer = tokenizer
        self.policy = policy
        self.cache = caches
        self.executor = executor
        self.cpu_partials = {kind: executor.make_cpu_partial(cache, region=i)
                             for i, (kind, cache) in enumerate(caches.caches.items())}
        self._clock = _DeviceClock(model.device)
        self.step_history: deque[StepTimes] = deque(maxlen=4096)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        # a chunk ends where every cache's entries fill whole blocks: a multiple of each rate x block_size
        unit = math.lcm(*(caches.rate(kind) * cache.block_size for kind, cache in caches.caches.items()))
        if prefill_chunk_tokens < 1 or prefill_chunk_tokens % unit:
            raise ValueError(f"prefill_chunk_tokens must be a positive multiple of {unit} for this model (each "
                             f"compression rate x block_size: a chunk's entries fill whole blocks), got "
                             f"{prefill_chunk_tokens}")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prompts = PromptEncoder(tokenizer, self.config.vocab_size, max_seq_len)
        self.stats = {"steps": 0, "decode_s": 0.0, "tokens": 0, "attention_s": 0.0, "prompt_tokens": 0,
                      "cached_prompt_tokens": 0, "prefill_s": 0.0}
        self.enable_prefix_caching = False
        self.decode_threads: int | None = 1 if model.device.type == "cpu" else None
        self.prefill_threads: int | None = None
        self.states = SequenceStates(self.config, max_batch_size, max_seq_len, model.device, model.dtype)
        self.store = SplitEntries(caches, self.cpu_partials, policy, model.device)
        self.forward = DeepseekV4Forward(model, self.states, self.store)

    @classmethod
    def from_config(cls, config: EngineConfig, *, executor=None, concurrent: bool | None = None,
                    region_handles: dict | None = None, cache_configs: dict | None = None):
        """As Engine.from_config. region_handles, cache_configs: per layer type, the regions a Ray
        region owner made and their configs as the driver sized them (entry_cache_configs)."""
        from writescope.loading import load_model

        if config.hot_experts is not None:
            raise ValueError("hot_experts is not supported for DeepSeek-V4 yet: its experts all live on the device")
        model_config, weights, tokenizer, torch_dtype = load_model(config.model, config.dtype, config.weights_seed)
        model = DeepseekV4Model(model_config, weights, device=config.device)
        return cls.from_model(model, tokenizer, torch_dtype, policy=config.policy, executor=executor,
                              window_tokens=config.window_tokens, max_batch_size=config.max_batch_size,
                              max_seq_len=config.max_seq_len, block_size=config.block_size,
                              num_shards=config.num_shards, pingpong_blocks=config.pingpong_blocks,
                              max_host_kv_gb=config.max_host_kv_gb,
                              prefill_chunk_tokens=config.prefill_chunk_tokens, region_handles=region_handles,
                              cache_configs=cache_configs)

    @classmethod
    def from_model(cls, model: DeepseekV4Model, tokenizer, kv_dtype: torch.dtype, *,
                   policy: str | Policy = "writescope", executor=None,
                   window_tokens: int = EngineConfig.window_tokens, max_batch_size: int = EngineConfig.max_batch_size,
                   max_seq_len: int = EngineConfig.max_seq_len, block_size: int = EngineConfig.block_size,
                   num_shards: int | None = None, pingpong_blocks: int | None = None,
                   max_host_kv_gb: float | None = None,
                   prefill_chunk_tokens: int = EngineConfig.prefill_chunk_tokens, region_handles: dict | None = None,
                   cache_configs: dict | None = None):
        check_policy(policy)
        if not model.config.layers_of(CSA) and not model.config.layers_of(HCA):
            raise ValueError("the model has no compressed layer: nothing to place outside the sliding windows")
        calibrate = policy == "writescope"
        if not isinstance(policy, Policy):
            policy = make_policy(policy, PROVISIONAL_MODEL if calibrate else None)
        if cache_configs is None:
            cache_configs = entry_cache_configs(
                model.config, kv_dtype, block_size=block_size, window_tokens=window_tokens,
                max_batch_size=max_batch_size, max_seq_len=max_seq_len, num_shards=num_shards or 1,
                pingpong_blocks=pingpong_blocks, device=str(model.device),
                max_host_kv_bytes=None if max_host_kv_gb is None else int(max_host_kv_gb * 2**30))
        executor = executor or LocalExecutor(concurrent=False)
        caches = None
        try:
            caches = EntryCaches(model.config, cache_configs, policy, max_batch_size=max_batch_size,
                                 region_handles=region_handles)
            engine = cls(model, tokenizer, policy=policy, caches=caches, executor=executor,
                         max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                         prefill_chunk_tokens=prefill_chunk_tokens)
            if calibrate:
                policy.estimator.reset_to(engine.calibrate())
            return engine
        except BaseException:
            if caches is not None:
                caches.close()
            executor.shutdown()
            raise

    def calibrate(self, *, force: bool = False, lengths: tuple[int, ...] | None = None):
        """The perf model, timed on the first entry cache (the same format in each: one head of head_dim)."""
        from writescope.calibration import MAX_BATCH, CalibrationSetup, calibrate

        kind, cache = next(iter(self.cache.caches.items()))
        setup = CalibrationSetup(self.config.num_q_heads, self.config.attention_scale,
                                 batch=min(self.max_batch_size, MAX_BATCH),
                                 cpu_partial=type(self.cpu_partials[kind]).__name__, cpu_in_thread=False)
        with torch.inference_mode():
            return calibrate(cache, self.cpu_partials[kind], setup, force=force, lengths=lengths)

    def cache_state(self) -> dict:
        """As Engine.cache_state, per entry cache: each region's occupancy ("csa.cpu_compute", ...) and
        the live sequences' entries in each region; the CPU share the policy wants now for the
        entries the sequences spilled (the policy sees entries: what a step reads); the entries each
        side attended since the start (cpu, device, and transfer: those the device read from
        cpu_transfer)."""
        caches = self.cache.caches
        occupancy = {f"{kind}.{region}": used for kind, cache in caches.items()
                     for region, used in cache.occupancy().items()}
        placed = {kind: cache.placed_tokens() for kind, cache in caches.items()}  # its "tokens" are entries
        spilled = sum(cache.spilled_tokens() for cache in self.cache.caches.values())
        return {"cpu_share_now": self.policy.preview_share(spilled) if spilled else None,
                "cpu_share_at_32k": self.policy.preview_share(32768), "occupancy": occupancy,
                "placed_entries": placed, "spilled_entries": spilled,
                "entries_attended": {kind: dict(sides) for kind, sides in list(self.store.attended.items())}}

    def shutdown(self) -> None:
        self.executor.shutdown()
        for partial in self.cpu_partials.values():
            partial.close()
        self.cache.close()

    # ------------------------------------------------------------------ prefill and decode
    @torch.inference_mode()
    def _prefill_chunk(self, request: _Request) -> Sampled | None:
        """Prompt tokens [prefilled, prefilled + prefill_chunk_tokens) through the model, each chunk's
        entries written straight to their caches; the first token sampled after the last chunk, else
        None (the running batch decodes a step between two chunks)."""
        sequence = self.cache.seqs[request.seq_id]
        self.store.prefill_seq = request.seq_id
        start = request.prefilled
        end = min(start + self.prefill_chunk_tokens, len(request.prompt))
        tokens = torch.tensor(request.prompt[start:end], device=self.model.device)
        logits = self.forward.prefill(tokens, sequence.slot, start, len(request.prompt))
        request.prefilled = end
        return self._sample([request], logits) if end == len(request.prompt) else None

    @torch.inference_mode()
    def _decode_step(self, running: list[_Request]) -> Sampled:
        began = time.perf_counter()
        seq_ids = tuple(r.seq_id for r in running)
        device = self.model.device
        sequences = [self.cache.seqs[s] for s in seq_ids]
        positions = torch.tensor([s.num_tokens for s in sequences], device=device)
        slots = torch.tensor([s.slot for s in sequences], device=device)
        with _torch_threads(self.decode_threads):  # the whole step, as Engine._decode_step says why
            self.store.step = self._entry_step(seq_ids, positions.cpu())
            logits = self.forward.decode(torch.tensor([r.tokens[-1] for r in running], device=device), positions,
                                         slots)
            tokens = self._sample(running, logits)
        for kind, cache in self.cache.caches.items():
            cache.commit([s for s, closes in zip(seq_ids, self.store.step.closes[kind].tolist(), strict=True)
                          if closes])
        for sequence in sequences:
            sequence.num_tokens += 1
        self._account(self.store.step.layers, len(running), time.perf_counter() - began)
        return tokens

    def _entry_step(self, seq_ids, positions) -> _EntryStep:
        """The step's views of the entry caches: nothing pending in the window but the entries this
        step's closing windows add (window_lens count them: they are attended in the step)."""
        views, closes, window_tokens, blocks = {}, {}, {}, {}
        for kind, cache in self.cache.caches.items():
            closing = (positions + 1) % self.cache.rate(kind) == 0
            view = cache.step_view(seq_ids, pending_tokens=0)
            views[kind] = dataclasses.replace(view, window_lens=view.window_lens + closing.to(view.window_lens))
            closes[kind] = closing
            window_tokens[kind] = sum(cache.seqs[s].window_len for s in seq_ids) + int(closing.sum())
            blocks[kind] = self.cache.placed.batch(kind, cache, seq_ids)
        return _EntryStep(seq_ids, views, closes, window_tokens, blocks)
