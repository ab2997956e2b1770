"""Prefix reuse in InplaceKVCache: a prompt's written blocks are found again by their tokens and
shared where they were placed; admission counts a shared block once; unused cached blocks are
evicted, least recently used first, when room is needed; every invariant holds after any
interleaving of admissions, prefills, steps and finishes, and every sequence reads back the KV
its own tokens have (the independent record: KV as a pure function of the prefix, as a model's)."""

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.test_inplace_kv_cache import play
from writescope.block_allocator import CapacityError
from writescope.inplace_kv_cache import CacheConfig, InplaceKVCache
from writescope.kv_format import KVFormat
from writescope.perf_model import PerfModel
from writescope.policies import make_policy
from writescope.prefix_cache import PrefixCache, block_hashes

FMT = KVFormat(num_layers=2, num_kv_heads=2, head_dim_k=8, head_dim_v=8, block_size=4)
BS = FMT.block_size


def make_cache(**overrides):
    config = {"compute_blocks_per_shard": 12, "transfer_blocks": 20, "max_seqs": 4, "pingpong_blocks": 3,
              "num_shards": 2, "window_tokens": 8, "transfer_in_place": False, **overrides}
    return InplaceKVCache(CacheConfig(FMT, **config), make_policy("writescope", PerfModel(2e-7, 1e-7)))


def prefix_kv(prompt: list[int], layer: int, position: int) -> list[torch.Tensor]:
    """The KV of the token at `position` as a function of the prompt up to it (what a model gives)."""
    seed = int.from_bytes(hashlib.sha256(repr((layer, prompt[:position + 1])).encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(FMT.num_kv_heads, 1, dim, generator=generator).to(FMT.torch_dtype) for dim in FMT.stored_dims]


def prompt_kv(prompt: list[int], layer: int, start: int = 0) -> list[torch.Tensor]:
    per_token = [prefix_kv(prompt, layer, i) for i in range(start, len(prompt))]
    return [torch.cat([t[a] for t in per_token], dim=1) for a in range(len(FMT.stored_dims))]


class Shadow:
    """Admits with prompts and prefills what the cache did not have, as the engine does."""

    def __init__(self, cache):
        self.cache = cache
        self.expected = {}  # seq -> layer -> [per array [num_kv_heads, tokens, dim]]

    def admit(self, seq, prompt, max_new):
        cached = self.cache.admit(seq, len(prompt), max_new, block_names=self.cache.block_names(prompt))
        assert cached % BS == 0 and cached < len(prompt)
        self.expected[seq] = {}
        for layer in range(FMT.num_layers):
            self.cache.write_prefill_chunk(seq, layer, cached, *prompt_kv(prompt, layer, cached))
            self.expected[seq][layer] = prompt_kv(prompt, layer)
        return cached

    def step(self, seqs):
        for layer in range(FMT.num_layers):
            for seq in seqs:
                new = [torch.randn(FMT.num_kv_heads, 1, d).to(FMT.torch_dtype) for d in FMT.stored_dims]
                self.cache.append(seq, layer, *[a[:, 0] for a in new])
                self.expected[seq][layer] = [torch.cat([e, n], 1) for e, n in zip(self.expected[seq][layer], new,
                                                                                     strict=True)]
        self.cache.commit(seqs)

    def finish(self, seq):
        self.cache.finish(seq)
        del self.expected[seq]

    def check(self):
        self.cache.check_integrity()
        for seq, layers in self.expected.items():
            for layer, expected in layers.items():
                for e, got in zip(expected, self.cache.sequence_kv(seq, layer), strict=True):
                    assert torch.equal(e, got), f"sequence {seq} layer {layer} reads back other KV"
        check_memory(self.cache)


def check_memory(cache):
    """Committed segments cover every allocated block (shared and cached ones included), plus at
    most one idle segment per region."""
    for region, alloc in cache._regions():
        used = {alloc.segment_of(b) for b in alloc.allocated}
        assert used <= region.committed and len(region.committed - used) <= 1


DOCUMENTS = [[7] * 13, list(range(1, 18)), list(range(1, 10)) + [99] * 9]  # share their first blocks pairwise
prompts = st.builds(lambda doc, tail: DOCUMENTS[doc] + tail, st.integers(0, 2),
                    st.lists(st.integers(1, 120), max_size=6))
operations = st.lists(st.one_of(
    st.tuples(st.just("admit"), prompts, st.integers(0, 12)),
    st.tuples(st.just("step"), st.integers(1, 9), st.just(0)),
    st.tuples(st.just("finish"), st.integers(0, 3), st.just(0)),
), max_size=30)


@settings(max_examples=60, deadline=None)
@given(ops_list=operations)
def test_random_interleavings_with_shared_prefixes_keep_every_invariant(ops_list):
    with make_cache() as cache:
        shadow = Shadow(cache)
        for seq_id, (op, x, y) in enumerate(ops_list):
            play(cache, shadow, seq_id, op, x, y)
            shadow.check()
        for seq in list(cache.seqs):
            shadow.finish(seq)
        assert cache.free_blocks() == cache.config.host_budget_blocks()  # cached blocks count as free
        shadow.check()


def test_a_second_request_holds_the_first_ones_blocks_where_they_were_placed():
    with make_cache() as cache:
        shadow = Shadow(cache)
        document = list(range(1, 30))  # 7 full blocks and a token
        assert shadow.admit("a", document, 4) == 0
        allocated = cache.allocated_blocks()
        cached = shadow.admit("b", document[:28] + [200, 201, 202], 4)
        assert cached == 28  # every full block of the document
        first, second = cache.seqs["a"].blocks, cache.seqs["b"].blocks
        assert second[:7] == first[:7]  # the same placements: region, shard and block
        assert cache.allocated_blocks() == allocated  # b's prompt has no full block of its own
        assert shadow.admit("c", document, 4) == 28  # the same prompt: its last token is prefilled again
        shadow.check()


def test_a_whole_prompt_of_full_blocks_still_prefills_its_last_block():
    with make_cache() as cache:
        shadow = Shadow(cache)
        document = list(range(1, 17))  # exactly 4 blocks
        shadow.admit("a", document, 2)
        assert shadow.admit("b", document, 2) == 12  # the last block holds the token whose logits are needed
        shadow.check()


def test_only_blocks_written_in_every_layer_are_found():
    with make_cache() as cache:
        document = list(range(1, 30))
        cache.admit("a", len(document), 4, block_names=cache.block_names(document))
        for layer in range(FMT.num_layers):  # the first chunk in every layer, the second in layer 0 only
            cache.write_prefill_chunk("a", layer, 0, *prompt_kv(document[:8], layer))
        cache.write_prefill_chunk("a", 0, 8, *prompt_kv(document, 0, 8)[0:1], *prompt_kv(document, 0, 8)[1:])
        assert cache.admit("b", len(document), 4, block_names=cache.block_names(document)) == 8
        cache.check_integrity()


def test_a_shared_block_is_counted_once_at_admission():
    # room for one 40-token prompt and a little: a second copy fits only if its blocks are shared
    with make_cache(compute_blocks_per_shard=6, transfer_blocks=6, num_shards=1, max_seqs=3) as cache:
        shadow = Shadow(cache)
        document = list(range(1, 41))
        shadow.admit("a", document, 0)
        with pytest.raises(CapacityError, match="needs 10 blocks"):
            shadow.admit("other", list(range(50, 90)), 0)
        assert shadow.admit("b", document, 0) == 36
        shadow.check()


def test_unused_cached_blocks_are_evicted_least_recently_used_first_when_room_is_needed():
    with make_cache(compute_blocks_per_shard=6, transfer_blocks=6, num_shards=1) as cache:
        shadow = Shadow(cache)
        old, recent = list(range(1, 22)), list(range(30, 51))  # 5 full blocks each
        shadow.admit("old", old, 0)
        shadow.admit("recent", recent, 0)
        shadow.finish("old")
        shadow.finish("recent")
        assert cache.prefix.num_evictable == 10 and cache.free_blocks() == 12  # cached blocks are free to admit
        shadow.admit("new", list(range(60, 81)), 3)  # 5 blocks of its own, 2 free: 3 evicted, the oldest
        shadow.check()
        assert cache.prefix.num_evictable == 7
        assert shadow.admit("again", recent + [1], 0) == 20  # the recent document is still whole
        shadow.finish("again")
        assert shadow.admit("again-old", old, 0) == 0  # the old one lost its first blocks: nothing matches
        shadow.check()


def test_a_prompt_given_no_block_names_neither_reuses_nor_registers():
    with make_cache() as cache:
        for seq in ("a", "b"):
            assert cache.admit(seq, 20, 0) == 0
            for layer in range(FMT.num_layers):
                cache.write_prefill(seq, layer, *prompt_kv(list(range(20)), layer))
        cache.finish("a")
        assert cache.prefix.num_registered == 0 and cache.prefix.num_evictable == 0
        cache.check_integrity()


def test_block_names_chain_every_earlier_token():
    one, two = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 2), block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    assert one[0] != two[0] and one[1] != two[1]  # the same second block after another first
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 2) == one
    cache = PrefixCache()
    assert cache.register("x", one[0]) and not cache.register("y", one[0])  # a name is registered once
    assert cache.match(one) == ["x"] and cache.match(two) == []
