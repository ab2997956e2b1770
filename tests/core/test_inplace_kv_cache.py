"""InplaceKVCache: residency fixed at write, integrity after every operation, exact bytes."""

import contextlib
import dataclasses
import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.test_block_allocator import runs
from tests.tolerances import MERGE
from writescope import ops
from writescope.block_allocator import CapacityError
from writescope.inplace_kv_cache import CacheConfig, InplaceKVCache
from writescope.kv_format import KVFormat
from writescope.perf_model import PerfModel
from writescope.policies import Region, make_policy

GQA = KVFormat(num_layers=2, num_kv_heads=2, head_dim_k=8, head_dim_v=8, block_size=4)
MLA = KVFormat(num_layers=2, num_kv_heads=1, head_dim_k=12, head_dim_v=8, block_size=4, v_in_k=True)
# a block of one kv head is a page (16 tokens x 128 x bf16): segments of any number of blocks
PAGED = KVFormat(num_layers=2, num_kv_heads=2, head_dim_k=128, head_dim_v=128, block_size=16)
SEGMENTED = {"window_tokens": 16, "segment_blocks": 4}  # 6 segments a cpu_compute shard, 10 in cpu_transfer


def make_cache(fmt=GQA, policy=None, **overrides):
    """A small cache; its cpu_transfer goes through the ping-pong buffers (the GPU's path) unless
    transfer_in_place=True is asked for (what a CPU-only engine does)."""
    config = {"compute_blocks_per_shard": 24, "transfer_blocks": 40, "max_seqs": 4, "pingpong_blocks": 3,
              "num_shards": 2, "window_tokens": 8, "transfer_in_place": False, **overrides}
    return InplaceKVCache(CacheConfig(fmt, **config), policy or make_policy("writescope", PerfModel(2e-7, 1e-7)))


def device_arrays(cache):
    return [*cache.window, *(cache.pingpong.buffers if cache.pingpong is not None else [])]


class Shadow:
    """What was written, per sequence and layer, in token order: the independent record."""

    def __init__(self, cache):
        self.cache = cache
        self.tokens = {}  # seq -> layer -> list of per-array [num_kv_heads, n, dim] tensors
        self.checksums = {}  # (region, shard, block) -> digest of its bytes in every layer

    def random_arrays(self, n):
        fmt = self.cache.config.format
        return [torch.randn(fmt.num_kv_heads, n, d).to(fmt.torch_dtype) for d in fmt.stored_dims]

    def admit(self, seq, prompt_len, max_new):
        self.cache.admit(seq, prompt_len, max_new)
        self.tokens[seq] = {}
        for layer in range(self.cache.config.format.num_layers):
            arrays = self.random_arrays(prompt_len)
            self.cache.write_prefill(seq, layer, *arrays)
            self.tokens[seq][layer] = [arrays]

    def step(self, seqs):
        for layer in range(self.cache.config.format.num_layers):
            per_seq = [self.random_arrays(1) for _ in seqs]
            if len(seqs) > 1:  # the engine's batched write
                stored = [torch.stack([p[i][:, 0] for p in per_seq]) for i in range(len(per_seq[0]))]
                self.cache.append_batch(seqs, layer, stored)
            else:  # the single-sequence write
                self.cache.append(seqs[0], layer, *[a[:, 0] for a in per_seq[0]])
            for seq, arrays in zip(seqs, per_seq, strict=True):
                self.tokens[seq][layer].append(arrays)
        self.cache.commit(seqs)

    def finish(self, seq):
        self.cache.finish(seq)
        del self.tokens[seq]
        self.checksums = {key: d for key, d in self.checksums.items() if self.owner(key) is not None}

    def owner(self, key):
        for seq, state in self.cache.seqs.items():
            if any((p.region, p.shard, p.block) == key for p in state.blocks):
                return seq
        return None

    def block_digest(self, placement):
        cache = self.cache
        region = cache.compute[placement.shard] if placement.region is Region.CPU_COMPUTE else cache.transfer
        digest = hashlib.sha256()
        for array in region.arrays:
            for layer in range(cache.config.format.num_layers):
                block = array[layer, :, placement.block] if placement.region is Region.CPU_COMPUTE \
                    else array[layer, placement.block]
                digest.update(block.contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def check(self):
        self.cache.check_integrity()
        for seq, layers in self.tokens.items():
            for layer, chunks in layers.items():
                expected = [torch.cat([c[i] for c in chunks], dim=1) for i in range(len(chunks[0]))]
                got = self.cache.sequence_kv(seq, layer)
                for e, g in zip(expected, got, strict=True):
                    assert torch.equal(e, g), f"sequence {seq} layer {layer}: bytes read back differ"
        for state in self.cache.seqs.values():
            for p in state.blocks:
                key = (p.region, p.shard, p.block)
                digest = self.block_digest(p)
                assert self.checksums.setdefault(key, digest) == digest, f"placed block {key} changed"


operations = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(1, 30), st.integers(0, 40)),
        st.tuples(st.just("step"), st.integers(1, 12), st.just(0)),
        st.tuples(st.just("finish"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("share"), st.floats(1e-8, 1e-5), st.just(0)),
    ),
    max_size=25,
)


@pytest.mark.parametrize("fmt,overrides", [(GQA, {}), (MLA, {}), (PAGED, SEGMENTED),
                                           (PAGED, {**SEGMENTED, "extent_blocks": 8})],
                         ids=["gqa", "mla", "segmented", "extents"])
@settings(max_examples=30, deadline=None)
@given(ops_list=operations)
def test_random_interleavings_keep_every_invariant(fmt, overrides, ops_list):
    with make_cache(fmt, **overrides) as cache:
        shadow = Shadow(cache)
        device_bytes = cache.device_bytes()
        device_ptrs = [t.data_ptr() for t in device_arrays(cache)]
        for next_id, (op, x, y) in enumerate(ops_list):
            play(cache, shadow, next_id, op, x, y)
            if op == "share":  # r* changes: the CPU rate moved
                cache.policy.estimator.model = cache.policy.model.with_cpu_rate(x)
            shadow.check()
            check_step_tables(cache)
            if overrides:
                check_memory_follows_the_placed_kv(cache)
        assert cache.device_bytes() == device_bytes  # GPU memory does not grow with the sequences
        assert [t.data_ptr() for t in device_arrays(cache)] == device_ptrs


def play(cache, shadow, seq_id, op, x, y) -> None:
    """One operation of a random interleaving on the cache and its shadow: ("admit", prompt or its
    length, max new tokens) as sequence seq_id, ("step", steps, _) of every sequence with room, or
    ("finish", which, _); an admission that does not fit is skipped."""
    live = list(cache.seqs)
    if op == "admit":
        with contextlib.suppress(CapacityError):
            shadow.admit(seq_id, x, y)
    elif op == "step" and live:
        for _ in range(x):
            ready = [s for s in live if cache.seqs[s].num_tokens < cache.seqs[s].max_tokens]
            if ready:
                shadow.step(ready)
    elif op == "finish" and live:
        shadow.finish(live[x % len(live)])


def check_step_tables(cache):
    """A step's block tables (kept from step to step until a block is sealed) list each live
    sequence's blocks in every host region as its placements, the record of where each block went."""
    seqs = list(cache.seqs)
    if not seqs:
        return
    view = cache.step_view(seqs, pending_tokens=0)

    def check(region, shard, table, lens):
        rows = [[p.block for p in cache.seqs[s].blocks if p.region is region and p.shard == shard] for s in seqs]
        assert lens.tolist() == [len(row) * cache.block_size for row in rows]
        assert [table[i, : len(row)].tolist() for i, row in enumerate(rows)] == rows

    for shard, (table, lens) in enumerate(view.compute):
        check(Region.CPU_COMPUTE, shard, table, lens)
    check(Region.CPU_TRANSFER, 0, *view.transfer)


@pytest.mark.parametrize("extent_blocks,run", [(16, 16), (1, 2)])
def test_sequences_decoding_in_turn_fill_runs_as_long_as_their_extents(extent_blocks, run):
    # two sequences flush their 8-token windows (2 blocks) in the same steps; with one-block extents
    # their ids interleave as lowest-first ids did, two by two
    with make_cache(policy=make_policy("all_cpu"), compute_blocks_per_shard=256, num_shards=1, transfer_blocks=8,
                    window_tokens=8, extent_blocks=extent_blocks) as cache:
        shadow = Shadow(cache)
        shadow.admit("a", 1, 160)
        shadow.admit("b", 1, 160)
        for _ in range(128):
            shadow.step(["a", "b"])
        shadow.check()
        for seq in ("a", "b"):
            ids = [p.block for p in cache.seqs[seq].blocks]
            assert len(ids) == 32 and all(p.region is Region.CPU_COMPUTE for p in cache.seqs[seq].blocks)
            assert set(runs(ids)) == {run}, f"sequence {seq}: runs of {runs(ids)}"


def test_a_batch_keeps_its_tables_until_one_of_its_blocks_is_sealed():
    with make_cache(policy=make_policy("fixed_half"), window_tokens=8) as cache:
        shadow = Shadow(cache)
        shadow.admit("a", 12, 40)
        shadow.admit("b", 9, 40)
        first = cache.step_view(["a", "b"], pending_tokens=0)
        again = cache.step_view(["a", "b"], pending_tokens=0)
        assert all(x[0] is y[0] for x, y in zip(first.compute, again.compute, strict=True))
        assert first.transfer[0] is again.transfer[0]  # nothing sealed between the two: the same tensors
        blocks = {s: len(cache.seqs[s].blocks) for s in "ab"}
        while all(len(cache.seqs[s].blocks) == blocks[s] for s in "ab"):
            shadow.step(["a", "b"])
            check_step_tables(cache)
        check_step_tables(cache)  # a block was sealed: the tables follow
        shadow.finish("a")
        shadow.admit("c", 20, 8)  # a's slot, new blocks
        check_step_tables(cache)
        only_b = cache.step_view(["b"], pending_tokens=0)
        assert only_b.compute_tokens + only_b.transfer_tokens == len(cache.seqs["b"].blocks) * cache.block_size


def check_memory_follows_the_placed_kv(cache):
    """The host regions hold in memory their committed segments' bytes, no more: the segments of
    placed blocks and at most one idle segment per region."""
    config = cache.config
    segment_bytes = config.segment_blocks * config.block_bytes
    committed = sum(len(region.committed) for region, _ in cache._regions())
    assert cache.host_resident_bytes() == committed * segment_bytes
    used = {(region.kind, region.handle.shard, p.block // config.segment_blocks)
            for state in cache.seqs.values() for p in state.blocks
            for region in [cache.compute[p.shard] if p.region is Region.CPU_COMPUTE else cache.transfer]}
    assert len(used) <= committed <= len(used) + len(cache._regions())


def test_a_region_commits_segments_as_blocks_are_placed_and_releases_them_when_freed():
    with make_cache(PAGED, num_shards=1, policy=make_policy("all_cpu"), **SEGMENTED) as cache:
        block_bytes = cache.config.block_bytes
        assert cache.host_resident_bytes() == 0  # address space only, until KV is placed
        cache.admit("a", 16 * 6, 0)  # 6 blocks: segments 0 and 1 of cpu_compute
        assert cache.compute[0].committed == {0, 1} and cache.host_resident_bytes() == 8 * block_bytes
        cache.admit("b", 16 * 3, 0)  # blocks 6..8: segment 1, then 2
        assert cache.compute[0].committed == {0, 1, 2}
        cache.finish("b")  # segment 2 is idle: kept, the next blocks go there
        assert cache.compute[0].committed == {0, 1, 2}
        cache.finish("a")  # 0, 1 and 2 idle: only the lowest keeps its memory
        assert cache.compute[0].committed == {0} and cache.host_resident_bytes() == 4 * block_bytes
        cache.check_integrity()


def test_a_sequence_finished_after_its_cache_was_closed_only_drops_its_bookkeeping():
    """A consumer's generator may be finalized after the engine shut down: finishing then must not
    touch the unmapped regions."""
    cache = make_cache(PAGED, num_shards=1, policy=make_policy("all_cpu"), **SEGMENTED)
    cache.admit("a", 16 * 6, 0)
    cache.admit("b", 16 * 6, 0)
    cache.close()
    cache.finish("a")
    cache.finish("b")
    assert not cache.seqs and len(cache.compute[0].committed) == 1  # the lowest idle one, as ever


def test_the_host_budget_bounds_admission_and_is_named_when_it_refuses():
    config = CacheConfig(PAGED, compute_blocks_per_shard=24, transfer_blocks=40, max_seqs=4, pingpong_blocks=3,
                         window_tokens=16, segment_blocks=4, max_blocks_per_seq=8)
    limited = dataclasses.replace(config, host_kv_bytes=(16 + 12) * config.block_bytes, host_limit_source="a test")
    assert limited.slack_blocks() == 16 and limited.host_budget_blocks() == 12
    assert limited.frontier_blocks() == 8  # a segment of each region: a's run fills its own
    with InplaceKVCache(limited, make_policy("writescope", PerfModel(2e-7, 1e-7))) as cache:
        assert cache.free_blocks() == 12
        cache.admit("a", 16 * 2, 0)  # 2 blocks of the 12, and a segment in each region being filled
        assert cache.free_blocks() == 12 - 2 - 8
        cache.finish("a")
        cache.admit("a", 16 * 8, 0)  # 8 blocks of the 12
        with pytest.raises(CapacityError, match="needs 8 blocks for 128 tokens; 0 are free .* of the 12 the host "):
            cache.admit("b", 16 * 8, 0)
        assert "host limit 0.00 GiB, from a test" in cache.capacity_text()
        cache.finish("a")
        cache.admit("b", 16 * 8, 0)
    with pytest.raises(ValueError, match=r"cannot hold one sequence of 128 tokens"):
        dataclasses.replace(config, max_blocks_per_seq=8).with_host_limit(20 * config.block_bytes)


def test_refused_admission_writes_nothing():
    with make_cache(compute_blocks_per_shard=2, transfer_blocks=2, num_shards=1) as cache:
        cache.admit("a", 12, 4)  # 16 tokens: 4 blocks of 4, all the capacity
        free, slots = cache.free_blocks(), list(cache._free_slots)
        with pytest.raises(CapacityError, match="needs 1 blocks.*0 are free"):
            cache.admit("b", 4, 0)
        assert "b" not in cache.seqs and cache.free_blocks() == free and cache._free_slots == slots
        cache.check_integrity()


def test_slots_run_out_with_a_clear_error():
    with make_cache(max_seqs=1) as cache:
        cache.admit("a", 3, 1)
        with pytest.raises(CapacityError, match="all 1 sequence slots"):
            cache.admit("b", 3, 1)


def test_bad_writes_are_refused():
    with make_cache() as cache:
        cache.admit("a", 5, 3)
        with pytest.raises(ValueError, match=r"k must be \[num_kv_heads, tokens, head_dim\] = \[2, 5, 8\]"):
            cache.write_prefill("a", 0, torch.zeros(2, 4, 8).bfloat16(), torch.zeros(2, 4, 8).bfloat16())
        with pytest.raises(ValueError, match="dtype"):
            cache.write_prefill("a", 0, torch.zeros(2, 5, 8), torch.zeros(2, 5, 8))
        with pytest.raises(ValueError, match="layer 2 is outside"):
            cache.write_prefill("a", 2, torch.zeros(2, 5, 8).bfloat16(), torch.zeros(2, 5, 8).bfloat16())
        with pytest.raises(ValueError, match="prefilled in every layer"):
            cache.append("a", 0, torch.zeros(2, 8).bfloat16(), torch.zeros(2, 8).bfloat16())
        with pytest.raises(ValueError, match="unknown sequence"):
            cache.finish("z")


@pytest.mark.parametrize("in_place", [True, False], ids=["transfer-in-place", "through-pingpong"])
@pytest.mark.parametrize("fmt", [GQA, MLA], ids=["gqa", "mla"])
def test_regions_attended_and_merged_equal_attention_over_the_sequence(fmt, in_place):
    """compute shards (CPU kernel) + the window and cpu_transfer (in place, or in ping-pong chunks)
    merge to attention over the whole sequence."""
    with make_cache(fmt, make_policy("fixed_half"), transfer_in_place=in_place) as cache:
        shadow = Shadow(cache)
        shadow.admit("a", 29, 40)
        shadow.admit("b", 3, 40)
        for _ in range(21):
            shadow.step(["a", "b"])
        seqs, layer = ["a", "b"], 1
        view = cache.step_view(seqs, pending_tokens=0)  # every token is committed: none is pending
        q = torch.randn(2, 4, fmt.head_dim_k).to(fmt.torch_dtype)
        cpu = [ops.multi_source_partial_attention(q, [s], backend="cpu") for s in cache.compute_sources(layer, view)]
        # Each group is valid until the next one refills the buffer: attend it as it comes.
        device = [ops.multi_source_partial_attention(q, group, backend="torch")
                  for group in cache.device_source_groups(layer, view)]
        assert len(device) == (1 if in_place else len(view.chunks))
        assert in_place or len(view.chunks) >= 2  # more transfer blocks than one ping-pong buffer holds
        parts = [*cpu, *device]
        out, lse = ops.merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        for i, seq in enumerate(seqs):
            arrays = cache.sequence_kv(seq, layer)
            v = arrays[0][..., : fmt.head_dim_v] if fmt.v_in_k else arrays[1]
            ref_out, ref_lse = ops.partial_attention(q[i], arrays[0], v, backend="torch")
            torch.testing.assert_close(out[i], ref_out, **MERGE)
            torch.testing.assert_close(lse[i], ref_lse, **MERGE)
        assert view.compute_tokens + view.transfer_tokens == sum(len(cache.seqs[s].blocks) * 4 for s in seqs)


def test_placed_share_follows_r_star_and_placed_blocks_never_move():
    model = PerfModel(2e-7, 1e-7)  # r* = 1/3 without fixed costs
    with make_cache(policy=make_policy("writescope", model), compute_blocks_per_shard=200,
                    transfer_blocks=400) as cache:
        shadow = Shadow(cache)
        shadow.admit("a", 40, 1500)
        for _ in range(6):
            for _ in range(64):
                shadow.step(["a"])
            cpu_tokens = sum(4 for p in cache.seqs["a"].blocks if p.region is Region.CPU_COMPUTE)
            total = len(cache.seqs["a"].blocks) * 4
            assert abs(cpu_tokens - model.optimal_share(cache.spilled_tokens()) * total) <= 4
        shadow.check()
        # r* changes (the CPU got 4x faster): only future blocks follow, placed ones stay put.
        before = list(cache.seqs["a"].blocks)
        cache.policy.estimator.model = model.with_cpu_rate(0.5e-7)
        for _ in range(256):
            shadow.step(["a"])
        assert cache.seqs["a"].blocks[: len(before)] == before
        new = cache.seqs["a"].blocks[len(before):]
        assert sum(p.region is Region.CPU_COMPUTE for p in new) / len(new) > 0.6  # r* is now 2/3
        shadow.check()


def test_the_pingpong_plan_fills_buffers_with_spans_of_consecutive_blocks():
    with make_cache(policy=make_policy("all_transfer"), pingpong_blocks=4, transfer_in_place=False) as cache:
        shadow = Shadow(cache)
        shadow.admit("a", 24, 0)  # 6 blocks: 0..5, one span
        shadow.admit("b", 9, 0)  # 2 blocks: 6..7
        view = cache.step_view(["a", "b"], pending_tokens=0)
        assert [c.spans for c in view.chunks] == [((0, 0, 4),), ((0, 4, 2), (2, 6, 2))]  # split at 4 blocks
        assert [c.seq_lens.tolist() for c in view.chunks] == [[16, 0], [8, 8]]
        assert [c.tokens for c in view.chunks] == [16, 16] and view.transfer_tokens == 32
        assert cache.step_view(["b"], pending_tokens=0).chunks[0].spans == ((0, 6, 2),)


@pytest.mark.parametrize("field,value,message", [
    ("window_tokens", 6, "multiple of block_size"),
    ("max_seqs", 0, "max_seqs must be >= 1"),
    ("extent_blocks", 0, "extent_blocks must be >= 1"),
    ("transfer_blocks", -1, "transfer_blocks must be >= 0"),
])
def test_cache_config_validation(field, value, message):
    config = {"compute_blocks_per_shard": 4, "transfer_blocks": 4, "max_seqs": 2, "pingpong_blocks": 2,
              "window_tokens": 8, field: value}
    with pytest.raises(ValueError, match=message):
        CacheConfig(GQA, **config)


@pytest.mark.parametrize("field,value,message", [
    ("num_layers", 0, "num_layers must be a positive integer"),
    ("dtype", "int8", "dtype must be one of"),
    ("head_dim_v", 20, "v_in_k needs head_dim_v"),
])
def test_kv_format_validation(field, value, message):
    fields = {**MLA.to_dict(), field: value}
    with pytest.raises(ValueError, match=message):
        KVFormat(**fields)


def test_a_started_transfer_is_used_not_copied_again():
    with make_cache(policy=make_policy("all_transfer"), pingpong_blocks=4, transfer_in_place=False) as cache:
        shadow = Shadow(cache)
        shadow.admit("a", 24, 0)
        shadow.admit("b", 9, 0)
        view = cache.step_view(["a", "b"], pending_tokens=0)
        expected = [[s.k_cache.clone() for s in group] for group in cache.device_source_groups(1, view)]
        cache.start_transfer(1, view)
        cache.transfer.k[1].add_(1)  # the source changes after the copy started: a second copy would show it
        groups = cache.device_source_groups(1, view)
        first = next(groups)
        used = first[1].block_table[0, :4].long()
        assert torch.equal(first[1].k_cache[used], expected[0][1][used])  # the prefetched bytes
        second = next(groups)[0]
        used = second.block_table[0, :2].long()
        assert not torch.equal(second.k_cache[used], expected[1][0][used])  # copied now: the changed bytes
        # A transfer started for another step is not mistaken for this one.
        other = cache.step_view(["b"], pending_tokens=0)
        cache.start_transfer(1, other)
        a_view = cache.step_view(["a"], pending_tokens=0)
        got = []
        for group in cache.device_source_groups(1, a_view):
            source = group[-1]
            n = int(source.seq_lens[0]) // 4
            blocks = source.k_cache[source.block_table[0, :n].long()]  # [n, num_kv_heads, 4, head_dim]
            got.append(blocks.permute(1, 0, 2, 3).reshape(2, n * 4, -1))
        assert torch.equal(torch.cat(got, dim=1), cache.sequence_kv("a", 1)[0])


@pytest.mark.parametrize("fmt", [GQA, MLA], ids=["gqa", "mla"])
def test_a_prompt_written_in_chunks_is_the_prompt_written_whole(fmt):
    """Chunks of whole blocks, then a last chunk with the partial block: the same KV in every region
    and the window as one whole write, and sequence_kv(num_tokens) reads back what is written so far."""
    torch.manual_seed(0)
    prompt_len, bs = 23, fmt.block_size
    arrays = [torch.randn(fmt.num_kv_heads, prompt_len, d).to(fmt.torch_dtype) for d in fmt.stored_dims]
    with make_cache(fmt, make_policy("fixed_half"), transfer_in_place=True) as whole, \
            make_cache(fmt, make_policy("fixed_half"), transfer_in_place=True) as chunked:
        for cache in (whole, chunked):
            cache.admit("a", prompt_len, 4)
        for layer in range(fmt.num_layers):
            whole.write_prefill("a", layer, *arrays)
            for start in range(0, prompt_len, 2 * bs):
                end = min(start + 2 * bs, prompt_len)
                chunked.write_prefill_chunk("a", layer, start, *[a[:, start:end] for a in arrays])
                if end < prompt_len:
                    so_far = chunked.sequence_kv("a", layer, end)
                    assert all(torch.equal(s, a[:, :end]) for s, a in zip(so_far, arrays, strict=True))
            for ours, theirs in zip(chunked.sequence_kv("a", layer), whole.sequence_kv("a", layer), strict=True):
                assert torch.equal(ours, theirs)
        chunked.check_integrity()


def test_chunks_out_of_order_or_ending_inside_a_block_are_refused():
    with make_cache() as cache:
        bs = GQA.block_size
        cache.admit("a", 3 * bs + 1, 2)
        kv = [torch.zeros(GQA.num_kv_heads, bs, d).to(GQA.torch_dtype) for d in GQA.stored_dims]
        with pytest.raises(ValueError, match=f"continues at token 0 with whole blocks of {bs}"):
            cache.write_prefill_chunk("a", 0, bs, *kv)  # skips the first chunk
        with pytest.raises(ValueError, match=r"got tokens \[0, 1\)"):
            cache.write_prefill_chunk("a", 0, 0, *[a[:, :1] for a in kv])  # ends inside a block
        with pytest.raises(ValueError, match=r"tokens \[0, 1\) must be whole blocks among"):
            cache.sequence_kv("a", 0, 1)
        with pytest.raises(ValueError, match=r"tokens \[8, 8\) must be whole blocks among"):
            cache.sequence_kv("a", 0, 8, 8)  # an empty piece
