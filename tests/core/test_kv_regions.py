"""Region handles: another process maps the same bytes; a tampered handle is refused."""

import contextlib
import dataclasses
import hashlib
import os
import subprocess
import sys

import msgpack
import pytest
import torch

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
region.k[1, 0, 0, 0, 0] = 7.0  # writes land in the owner's bytes too
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
        assert region.k[1, 0, 0, 0, 0].item() == 7.0
        # The reader exited; the region is still there (the owner, not a reader, unlinks it).
        HostRegion.attach(region.handle).close()
    finally:
        region.close()
    with pytest.raises(ValueError, match="the region is gone"):
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
    ({"shm_name": "writescope_no_such_segment"}, "the region is gone"),
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


def test_segments_of_dead_creators_are_reaped_and_live_ones_kept():
    from multiprocessing import shared_memory

    from writescope.kv_regions import reap_orphaned_segments, segment_prefix

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = shared_memory.SharedMemory(name=f"{segment_prefix(dead.pid)}_test_orphan", create=True, size=64)
    mine = shared_memory.SharedMemory(name=f"{segment_prefix()}_test_live", create=True, size=64)
    try:
        removed = reap_orphaned_segments()
        assert orphan.name.lstrip("/") in removed
        assert mine.name.lstrip("/") not in removed
        assert os.path.exists(f"/dev/shm/{mine.name.lstrip('/')}")
        assert not os.path.exists(f"/dev/shm/{orphan.name.lstrip('/')}")
    finally:
        orphan.close()
        mine.close()
        mine.unlink()
        with contextlib.suppress(FileNotFoundError):
            orphan.unlink()
