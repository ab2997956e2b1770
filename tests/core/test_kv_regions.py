"""Region handles: another process maps the same bytes; a tampered handle is refused; a region's
memory goes with the last process that holds it, whichever way its owner ends."""

import dataclasses
import hashlib
import mmap
import os
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch

from tests.processes import processes_mapping
from writescope import kv_regions
from writescope.kv_format import KVFormat
from writescope.kv_regions import HUGE_PAGE_BYTES, HostRegion, RegionHandle, segment_blocks_for
from writescope.numa_memory import page_nodes
from writescope.topology import read_topology

FMT = KVFormat(num_layers=2, num_kv_heads=2, head_dim_k=16, head_dim_v=8, block_size=4)

READER = """
import hashlib, sys
from writescope.kv_regions import HostRegion
region = HostRegion.attach(bytes.fromhex(sys.stdin.read()))
digest = hashlib.sha256()
for array in region.arrays:
    digest.update(array.contiguous().view(__import__("torch").uint8).numpy().tobytes())
print(digest.hexdigest())
region.k[1].view(-1)[0] = 7.0  # writes land in the owner's bytes too
region.close()
"""


def digest(region):
    h = hashlib.sha256()
    for array in region.arrays:
        h.update(array.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("kind", ["cpu_compute", "cpu_transfer"])
def test_second_process_reads_and_writes_the_same_bytes(kind):
    region = HostRegion.create(kind, FMT, 5)
    try:
        for array in region.arrays:
            array.copy_(torch.randn(array.shape).to(array.dtype))
        written = digest(region)
        result = subprocess.run([sys.executable, "-c", READER], input=region.handle.to_bytes().hex(),
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == written
        assert region.k[1].view(-1)[0].item() == 7.0
        # The reader exited; the region is still there (the owner holds it).
        HostRegion.attach(region.handle).close()
    finally:
        region.close()
    with pytest.raises(ValueError, match="the region is gone|not segment"):  # the descriptor may be reused
        HostRegion.attach(region.handle)


def test_handle_round_trips_through_msgpack():
    region = HostRegion.create("cpu_compute", FMT, 3)
    try:
        handle = region.handle.with_block_table([2, 0])
        assert RegionHandle.from_bytes(handle.to_bytes()) == handle
    finally:
        region.close()


def tamper(handle, **changes):
    data = msgpack.unpackb(handle.to_bytes())
    data.update(changes)
    return msgpack.packb(data)


@pytest.mark.parametrize("changes,message", [
    ({"kind": "gpu_window"}, "not a host region"),
    ({"layout": ["layer", "block", "kv_head", "token", "dim"]}, "does not match"),
    ({"offsets": [0, 100]}, "overlaps the previous array or is not 4096-aligned"),
    ({"num_blocks": 9999, "segment_blocks": 9999}, "past the segment|overlaps the previous array"),
    ({"segment_blocks": 2}, r"segment_blocks \(2\) must be >= 1 and divide num_blocks \(3\)"),
    ({"segment_blocks": 0}, r"segment_blocks \(0\) must be >= 1"),
    ({"segment_bytes": 1 << 40}, "holds .* bytes, the handle says"),
    ({"block_table": [0, 3]}, r"block_table holds \[3\]"),
    ({"shm_name": "writescope_no_such_segment"}, "not segment 'writescope_no_such_segment'"),
    ({"fd": 0}, "descriptor 0 of pid .* not segment"),
    ({"fd": 1 << 20}, "the region is gone"),
    ({"owner_pid": 0}, "owner_pid .* must be >= 1"),
    ({"owner_pid": "me"}, "must be integers"),
    ({"shard": -1}, "must be >= 0"),
    ({"extra": 1}, "needs the fields"),
    ({"offsets": 5}, "offsets must be a list of int"),
    ({"block_table": ["x"]}, "block_table must be a list of int"),
    ({"layout": [1, 2]}, "layout must be a list of str"),
    ({"page_bytes": 8192}, "page_bytes must be 4096 or 2097152, got 8192"),
    ({"page_bytes": HUGE_PAGE_BYTES}, "not 2097152-aligned|cuts .* off page boundaries"),
])
def test_tampered_handle_is_refused(changes, message):
    region = HostRegion.create("cpu_compute", FMT, 3)
    try:
        with pytest.raises(ValueError, match=message):
            HostRegion.attach(tamper(region.handle, **changes))
    finally:
        region.close()


def test_handle_with_a_wrong_format_is_refused():
    region = HostRegion.create("cpu_compute", FMT, 3)
    try:
        bad_dtype = {**FMT.to_dict(), "dtype": "int4"}
        with pytest.raises(ValueError, match="dtype must be one of"):
            HostRegion.attach(tamper(region.handle, format=bad_dtype))
        bigger = dataclasses.replace(FMT, head_dim_k=4096)
        with pytest.raises(ValueError, match="past the segment|overlaps the previous array"):
            HostRegion.attach(tamper(region.handle, format=bigger.to_dict()))
    finally:
        region.close()


def test_garbage_is_not_a_handle():
    with pytest.raises(ValueError, match="not a region handle|needs the fields"):
        RegionHandle.from_bytes(b"\xc1garbage")


OWNER = """
import sys, time
from writescope.kv_format import KVFormat
from writescope.kv_regions import HostRegion
region = HostRegion.create("cpu_transfer", KVFormat(num_layers=2, num_kv_heads=2, head_dim_k=16, head_dim_v=8,
                                                    block_size=4), 5)
region.k.fill_(3.0)
print(region.handle.to_bytes().hex(), flush=True)
time.sleep(600)
"""


def test_a_killed_owners_region_lives_while_mapped_and_is_gone_with_its_last_user():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        handle = RegionHandle.from_bytes(bytes.fromhex(owner.stdout.readline()))
        region = HostRegion.attach(handle)
        assert processes_mapping(handle.shm_name) == sorted([owner.pid, os.getpid()])
        owner.kill()
        owner.wait()
        assert region.k.float().eq(3.0).all()  # a worker's mapping outlives the owner's death
        region.close()
        del region
        assert processes_mapping(handle.shm_name) == []  # nothing holds it: the kernel freed it
        assert not [n for n in os.listdir("/dev/shm") if handle.shm_name in n]  # and no file ever existed
        with pytest.raises(ValueError, match="the region is gone"):
            HostRegion.attach(handle)
    finally:
        owner.kill()


PAGED = KVFormat(num_layers=2, num_kv_heads=2, head_dim_k=128, head_dim_v=64, block_size=16)


@pytest.mark.parametrize("kind", ["cpu_compute", "cpu_transfer"])
def test_a_segments_runs_hold_exactly_its_blocks_in_every_layer_and_array(kind):
    region = HostRegion.create(kind, PAGED, 12, segment_blocks=4)
    try:
        for array in region.arrays:  # every byte of block b holds b + 1, written through the tensor views
            ids = array.view(torch.int16)
            for block in range(12):
                (ids[:, :, block] if kind == "cpu_compute" else ids[:, block]).fill_(block + 1)
        raw = np.frombuffer(region._segment.buf, np.uint8)
        covered = 0
        for segment in range(3):
            values = set()
            for start, length in region.segment_ranges(segment):
                assert start % mmap.PAGESIZE == 0 and length % mmap.PAGESIZE == 0
                values |= set(np.unique(raw[start:start + length].view(np.int16)).tolist())
                covered += length
            assert values == {4 * segment + 1, 4 * segment + 2, 4 * segment + 3, 4 * segment + 4}
        assert covered == PAGED.nbytes(kind, 12)
    finally:
        region.close()


def test_a_segment_committed_through_any_mapping_takes_memory_and_gives_it_back_when_released():
    owner = HostRegion.create("cpu_transfer", PAGED, 12, segment_blocks=4)
    attached = HostRegion.attach(owner.handle.to_bytes())  # another mapping and descriptor, as a worker's
    try:
        segment_bytes = 4 * PAGED.nbytes("cpu_transfer", 1)
        assert owner.resident_bytes() == 0
        attached.commit(1, node=read_topology()[0].index)
        assert owner.resident_bytes() == segment_bytes and attached.committed == {1}
        owner.k[0, 4:8].fill_(2.0)
        assert attached.k[0, 4:8].float().eq(2.0).all()  # read here: the pages are now mapped here too
        start, length = attached.segment_ranges(1)[0]
        assert set(page_nodes(attached.address + start, length)) == {read_topology()[0].index}
        attached.release(1)
        assert owner.resident_bytes() == 0 and owner.k[0, 4:8].float().eq(0).all()  # given back: zeros
    finally:
        attached.close()
        owner.close()


def test_segments_that_cut_pages_are_refused_with_the_multiple_allowed():
    with pytest.raises(ValueError, match=r"segment_blocks \(2\) cuts cpu_compute's k runs of 128 bytes off page "
                                         r"boundaries \(4096\); use a multiple of 64"):
        HostRegion.create("cpu_compute", FMT, 4, segment_blocks=2)


def _shmem_huge_page_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("ShmemHugePages:"))


@pytest.mark.parametrize("kind", ["cpu_compute", "cpu_transfer"])
def test_a_huge_page_region_lays_every_segment_out_in_whole_2mb_pages(kind):
    """In 2 MB pages each segment's runs are whole huge pages, so committing one takes its KV's bytes
    and releasing it gives them back, whatever the host's huge-page setting; a worker attaching the
    handle maps it the same way and sees the owner's bytes."""
    segment_blocks = segment_blocks_for(PAGED, 0, HUGE_PAGE_BYTES)
    assert segment_blocks == 2 * 2**20 // (16 * 64 * 2)  # the shortest run, v's: one block's 2 KB per layer and head
    owner = HostRegion.create(kind, PAGED, 2 * segment_blocks, segment_blocks=segment_blocks, huge_pages=True)
    attached = HostRegion.attach(owner.handle.to_bytes())
    try:
        assert owner.page_bytes == attached.page_bytes == HUGE_PAGE_BYTES
        assert all(offset % HUGE_PAGE_BYTES == 0 for offset in owner.handle.offsets)
        for segment in range(2):
            for start, length in owner.segment_ranges(segment):
                assert start % HUGE_PAGE_BYTES == 0 and length % HUGE_PAGE_BYTES == 0
        attached.commit(1)
        assert owner.resident_bytes() == segment_blocks * PAGED.nbytes(kind, 1)
        blocks = (slice(None), slice(None), slice(segment_blocks, None)) if kind == "cpu_compute" else (
            slice(None), slice(segment_blocks, None))
        owner.k[blocks].fill_(3.0)
        assert attached.k[blocks].float().eq(3.0).all()
        attached.release(1)
        assert owner.resident_bytes() == 0 and owner.k[blocks].float().eq(0).all()
    finally:
        attached.close()
        owner.close()


@pytest.mark.skipif(not kv_regions.host_huge_pages(), reason="this host gives shared memory no huge pages")
def test_where_the_host_gives_shared_huge_pages_a_committed_segment_is_in_them():
    segment_blocks = segment_blocks_for(PAGED, 0, HUGE_PAGE_BYTES)
    region = HostRegion.create("cpu_compute", PAGED, segment_blocks, huge_pages=True)
    try:
        before = _shmem_huge_page_bytes()
        region.commit(0)
        assert _shmem_huge_page_bytes() - before >= region.resident_bytes() > 0
    finally:
        region.close()


def test_segments_that_cut_huge_pages_are_refused_with_the_multiple_allowed():
    with pytest.raises(ValueError, match=r"segment_blocks \(64\) cuts cpu_compute's k runs of 4096 bytes off page "
                                         r"boundaries \(2097152\); use a multiple of 1024"):
        HostRegion.create("cpu_compute", PAGED, 128, segment_blocks=64, huge_pages=True)


@pytest.mark.parametrize("setting, expected", [("on", True), ("off", False)])
def test_huge_pages_follow_the_environment(monkeypatch, setting, expected):
    monkeypatch.setenv("WRITESCOPE_HUGE_PAGES", setting)
    assert kv_regions.huge_pages_wanted() is expected
    monkeypatch.setenv("WRITESCOPE_HUGE_PAGES", "sometimes")
    with pytest.raises(ValueError, match="WRITESCOPE_HUGE_PAGES must be auto, on or off, got 'sometimes'"):
        kv_regions.huge_pages_wanted()
