"""Automatic prefix caching: sealed prompt blocks found again by what they hold, and shared.

A prompt's full blocks are named by a chain of hashes (block i's: SHA-256 of block i-1's hash and
block i's token ids), so a name stands for a block's tokens and every token before them: two
prompts that share a name share the whole prefix up to it, at the same positions, hence the same
KV. A block is registered once every layer of it is written; a later prompt whose first blocks
have registered names takes those blocks as they are (where they were placed: a block's residency
stays what it was when it was written) and prefills only what follows.

A registered block counts its live users. With none it is kept, evictable, least recently used
first: the cache evicts such blocks when it needs room, and counts them as free when it admits.
No torch, no I/O: placements are whatever hashable values the cache gives.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np

_ROOT = b"writescope-prefix-v1"


def block_hashes(tokens: Sequence[int], block_size: int, num_blocks: int) -> list[bytes]:
    """The chained names of the first num_blocks full blocks of tokens."""
    ids = np.asarray(tokens[: num_blocks * block_size], dtype=np.int64)
    names, parent = [], _ROOT
    for index in range(num_blocks):
        parent = hashlib.sha256(parent + ids[index * block_size:(index + 1) * block_size].tobytes()).digest()
        names.append(parent)
    return names


class PrefixCache:
    def __init__(self):
        self._by_name: dict[bytes, Hashable] = {}
        self._name_of: dict[Hashable, bytes] = {}
        self._users: dict[Hashable, int] = {}  # registered block -> live sequences holding it
        self._evictable: OrderedDict[Hashable, None] = OrderedDict()  # registered, unused; oldest first
        self.queried_tokens = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hit_tokens = 0  # of them, found (vLLM's prefix_cache_hits)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_registered(self) -> int:
        return len(self._by_name)

    def match(self, names: list[bytes]) -> list[Hashable]:
        """The blocks of the longest run of names, from the first, that are registered."""
        found = []
        for name in names:
            block = self._by_name.get(name)
            if block is None:
                break
            found.append(block)
        return found

    def count_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queried_tokens += queried_tokens
        self.hit_tokens += hit_tokens

    def evictable_among(self, blocks: list[Hashable]) -> int:
        return sum(block in self._evictable for block in blocks)

    def acquire(self, blocks: list[Hashable]) -> None:
        """A new sequence holds these registered blocks."""
        for block in blocks:
            self._users[block] += 1
            self._evictable.pop(block, None)

    def register(self, block: Hashable, name: bytes) -> bool:
        """A block just written in every layer, held by the sequence that wrote it, under its name;
        False (it stays that sequence's own) when another block already has the name."""
        if name in self._by_name or block in self._name_of:
            return False
        self._by_name[name] = block
        self._name_of[block] = name
        self._users[block] = 1
        return True

    def release(self, block: Hashable) -> bool:
        """A sequence lets go of a block: True when the block is its own (unregistered), to be freed;
        a registered one is kept, evictable once no sequence holds it."""
        if block not in self._name_of:
            return True
        self._users[block] -= 1
        assert self._users[block] >= 0, f"block {block!r} released more often than held"
        if self._users[block] == 0:
            self._evictable[block] = None
        return False

    def evict(self, accept=lambda block: True) -> Hashable | None:
        """The least recently used evictable block that accept() takes, unregistered (to be freed), or None."""
        for block in self._evictable:
            if accept(block):
                del self._evictable[block]
                del self._by_name[self._name_of.pop(block)]
                del self._users[block]
                return block
        return None

    def users(self, block: Hashable) -> int | None:
        """Live holders of a registered block; None for a block that is not registered."""
        return self._users.get(block)

    def evictable_blocks(self) -> list[Hashable]:
        return list(self._evictable)

    def check_integrity(self, held: dict[Hashable, int]) -> None:
        """held: each block of a live sequence -> how many sequences hold it."""
        assert {self._by_name[n] for n in self._name_of.values()} == set(self._name_of), "names and blocks differ"
        for block, name in self._name_of.items():
            assert self._by_name[name] == block
            assert self._users[block] == held.get(block, 0), f"block {block!r}: {self._users[block]} users counted, " \
                                                             f"{held.get(block, 0)} hold it"
            assert (self._users[block] == 0) == (block in self._evictable), f"block {block!r}: evictable is wrong"
        for block, count in held.items():
            assert count == 1 or block in self._name_of, f"unregistered block {block!r} is held {count} times"
