"""Region handles: another process maps the same bytes; a tampered handle is refused; a region's
memory goes with the last process that holds it, whichever way its owner ends."""

import dataclasses
import hashlib
import os
import subprocess
import sys

import msgpack
import pytest
import torch

from tests.processes import processes_mapping
from writescope.kv_format import KVFormat
from writescope.kv_regions import HostRegion, RegionHandle

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
    ({"num_blocks": 10_000}, "past the segment|overlaps the previous array"),
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
