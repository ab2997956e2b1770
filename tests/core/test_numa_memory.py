"""mbind through ctypes: pages of a shared-memory range land on the node asked for, and bad
arguments are refused with the reason."""

import mmap
from multiprocessing import shared_memory

import numpy as np
import pytest

from writescope.numa_memory import bind_to_node, page_nodes
from writescope.topology import read_topology


@pytest.fixture
def segment():
    shm = shared_memory.SharedMemory(create=True, size=64 * mmap.PAGESIZE)
    yield shm, np.frombuffer(shm.buf, np.uint8).ctypes.data
    shm.close()
    shm.unlink()


def test_bound_pages_are_resident_on_the_node(segment):
    shm, address = segment
    assert set(page_nodes(address, shm.size)) == {-2}  # nothing touched yet: -ENOENT
    node = read_topology()[-1].index
    bind_to_node(address, shm.size, node)
    assert set(page_nodes(address, shm.size)) == {-2}  # binding allocates nothing
    np.frombuffer(shm.buf, np.uint8)[:: mmap.PAGESIZE] = 1  # first writes allocate under the policy
    assert set(page_nodes(address, shm.size)) == {node}


def test_a_node_the_host_lacks_is_refused(segment):
    shm, address = segment
    with pytest.raises(OSError, match="mbind to node 1000 failed"):
        bind_to_node(address, shm.size, 1000)


def test_an_unaligned_address_is_refused(segment):
    shm, address = segment
    with pytest.raises(ValueError, match="not aligned"):
        bind_to_node(address + 8, 64, 0)
