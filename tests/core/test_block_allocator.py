"""BlockAllocator: lowest-first ids, and consecutive ids for owners in the extents they hold."""

import random
from itertools import pairwise

import pytest

from writescope.block_allocator import EXTENT_BLOCKS, BlockAllocator, CapacityError


def runs(ids: list[int]) -> list[int]:
    """Lengths of the runs of consecutive ids, in order."""
    lengths = [1]
    for before, after in pairwise(ids):
        if after == before + 1:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


def test_block_allocator_reuses_freed_blocks_lowest_first():
    alloc = BlockAllocator(6)
    first = alloc.allocate(4)
    assert first == [0, 1, 2, 3]
    alloc.free([1, 2])
    assert alloc.allocate(3) == [1, 2, 4]
    alloc.check_integrity()
    with pytest.raises(CapacityError, match="asked for 2 blocks, 1 of 6 are free"):
        alloc.allocate(2)
    with pytest.raises(ValueError, match="block 5 is not allocated"):
        alloc.free([5])


def test_owners_allocating_in_turn_each_get_runs_of_whole_extents():
    # four sequences flushing 16-block windows in turn: lowest first interleaves them in runs of 16
    by_lowest, by_owner = BlockAllocator(4096), BlockAllocator(4096, extent_blocks=256)
    lowest, owned = {s: [] for s in range(4)}, {s: [] for s in range(4)}
    for _ in range(40):
        for seq in range(4):
            lowest[seq] += by_lowest.allocate(16)
            owned[seq] += by_owner.allocate(16, owner=seq)
    assert all(set(runs(ids)) == {16} for ids in lowest.values())
    assert all(runs(ids) == [256, 256, 128] for ids in owned.values())
    assert [ids[0] for ids in owned.values()] == [0, 256, 512, 768]  # each took the lowest open extent
    assert {by_owner.holder_of(b) for b in owned[2]} == {2}
    by_owner.check_integrity()


def test_a_run_that_reaches_its_extents_end_goes_on_into_the_next_open_one():
    alloc = BlockAllocator(1024, extent_blocks=256)
    alloc.allocate(256, owner="other")  # extent 0
    alloc.free(list(range(256)))
    alloc.release_owner("other")  # extent 0 is open again, below the run's next one
    first = alloc.allocate(300, owner="a")
    assert runs(first) == [300] and first[0] == 0
    more = alloc.allocate(300, owner="a")
    assert more == list(range(300, 600))
    alloc.check_integrity()


def test_a_finished_owners_extents_serve_the_next_owner_whole():
    alloc = BlockAllocator(2048, extent_blocks=256)
    taken = {seq: [] for seq in "abc"}
    for _ in range(20):
        for seq in "abc":
            taken[seq] += alloc.allocate(16, owner=seq)
    alloc.free(taken["b"])
    alloc.release_owner("b")
    fresh = alloc.allocate(320, owner="d")
    assert fresh[0] == 256 and runs(fresh) == [256, 64]  # b's first extent, then the lowest open one
    alloc.check_integrity()


def test_holding_is_a_preference_every_free_id_can_still_be_allocated():
    alloc = BlockAllocator(96, extent_blocks=32)
    assert [alloc.allocate(1, owner=seq) for seq in "abc"] == [[0], [32], [64]]
    assert alloc.allocate(1, owner="d") == [1]  # every extent is held: the lowest free id, in a's
    assert alloc.holder_of(1) == "a"
    rest = alloc.allocate(alloc.num_free, owner="e")
    assert len(rest) == 92 and alloc.num_free == 0
    with pytest.raises(CapacityError, match="asked for 1 blocks, 0 of 96 are free"):
        alloc.allocate(1, owner="a")
    alloc.check_integrity()


def test_a_random_mix_of_owners_and_frees_keeps_every_count_and_loses_no_id():
    rng = random.Random(7)
    alloc = BlockAllocator(700, segment_blocks=50, extent_blocks=64)
    held: dict[str, list[int]] = {}
    for _ in range(3000):
        owner = rng.choice(["s0", "s1", "s2", "s3", "s4", None])
        if rng.random() < 0.55 and alloc.num_free:
            ids = alloc.allocate(rng.randint(1, min(40, alloc.num_free)), owner=owner)
            held.setdefault(owner or "none", []).extend(ids)
        elif held:
            name = rng.choice(sorted(held))
            alloc.free(held.pop(name))
            if name != "none":
                alloc.release_owner(name)
        alloc.check_integrity()
        assert alloc.allocated == frozenset(b for ids in held.values() for b in ids)
        assert alloc.num_free + alloc.num_allocated == 700
    # ids an owner takes stay in the free heap until popped; they are dropped before it grows past twice what is free
    assert len(alloc._free) <= 2 * alloc.num_free + 64


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="extent_blocks must be >= 1, got 0"):
        BlockAllocator(10, extent_blocks=0)
    with pytest.raises(ValueError, match="num_blocks must be >= 0"):
        BlockAllocator(-1)
    assert EXTENT_BLOCKS >= 16  # longer than one 256-token window flush of 16-token blocks
