"""Host regions of InplaceKVCache in shared memory, and the handles other processes attach them by.

A host region (`cpu_compute` shard or `cpu_transfer`) is one shared-memory segment holding the K
array (and the V array unless V lives inside K), laid out as `KVFormat.shape` says. A segment is an
anonymous memfd, not a file in /dev/shm: its memory is freed by the kernel when the last process
holding it (its creator's descriptor, any process's mapping) is gone, so no kill, crash or torn-down
cluster can leave KV behind. Another process attaches a segment from a `RegionHandle` (a small
msgpack message naming the creator's PID and descriptor) by opening /proc/PID/fd/FD, which the
kernel allows to processes of the same user; the creator must be alive then (a worker restarted
by Ray re-attaches from the long-lived region owner). Handles are validated on decode and on
attach: a wrong kind, layout, dtype, size, offset, block id or descriptor is a ValueError, never
an out-of-bounds access.

A region's memory follows the KV placed in it: its block ids fall in fixed-size segments of
`segment_blocks` blocks, and a segment takes memory only once committed (by the cache, when it
places the segment's first block): its pages allocated then (populated through the mapping, so a
host out of memory is an error, not a SIGBUS on a later write), on the shard's NUMA node and
page-locked for DMA where that applies, both fixed for as long as the segment is committed. A
segment with no placed block left may be released: its pages go back to the kernel. No byte ever
moves: the mapping spans the whole region from the start (address space, not memory), so every
process that attached the region sees a new segment at once, at the same offsets.

Where the host gives shared memory transparent huge pages (or WRITESCOPE_HUGE_PAGES=on), a region
is laid out in 2 MB pages: its arrays and every segment's runs start and end on one, and every
mapping of it is advised for them; otherwise its mappings are advised against them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import mmap
import os
import secrets
from dataclasses import dataclass, field, fields

import msgpack
import numpy as np
import torch

from writescope import env
from writescope.kv_format import HOST_REGIONS, LAYOUTS, KVFormat

log = logging.getLogger(__name__)

PAGE_BYTES = 4096
# A region in huge pages lays every run of a segment out in whole 2 MB pages (see HostRegion.create).
HUGE_PAGE_BYTES = 2 * 2**20
_SHMEM_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
# madvise(MADV_POPULATE_WRITE) (Linux 5.14): faults pages in through the mapping, so they take the
# mapping's huge-page advice; Python's mmap module does not name it.
_MADV_POPULATE_WRITE = 23
# Target bytes of one segment of a region (every layer and stored array of its blocks): large enough
# that committing one is rare and cheap per byte, small next to a host's memory.
SEGMENT_BYTES = 16 * 2**20
_NUMPY_STORAGE = {"bfloat16": np.int16, "float16": np.float16, "float32": np.float32}


def _align(n: int, page_bytes: int = PAGE_BYTES) -> int:
    return -(-n // page_bytes) * page_bytes


def huge_pages_wanted() -> bool:
    """Whether host regions are laid out in huge pages: WRITESCOPE_HUGE_PAGES on or off, else (auto)
    where the host gives shared memory huge pages."""
    value = (env.HUGE_PAGES.get() or "auto").lower()
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{env.HUGE_PAGES.name} must be auto, on or off, got {value!r}")
    return host_huge_pages() if value == "auto" else value == "on"


def host_huge_pages() -> bool:
    """Whether this host gives shared memory transparent huge pages (shmem_enabled is not never or
    deny). Where it does, a memfd region's pages become 2 MB folios as they are allocated: committing a
    32 KB run took a whole 2 MB page (a 16 MB segment of a 32-layer, 8-head model: up to 1 GiB), so a
    region there is laid out in huge pages or advised against them."""
    try:
        with open(_SHMEM_THP_SETTING) as setting:
            selected = setting.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return False
    return selected not in ("never", "deny")


class Segment:
    """Shared memory that cannot outlive its users: an anonymous memfd mapped MAP_SHARED.

    create() makes one in this process, which keeps its descriptor until close(); attach() maps
    the creator's segment from (creator PID, descriptor, name, size) through /proc. The memory is
    freed when the creator has closed it (or died) and every mapping is gone.
    """

    def __init__(self, name: str, mapping: mmap.mmap, size: int, owner_pid: int, fd: int, owned: bool,
                 local_fd: int):
        self.name = name
        self.buf = mapping
        self.size = size
        self.owner_pid = owner_pid
        self.fd = fd  # the creator's descriptor number (open in this process only if owned)
        self.owned = owned
        self._local_fd = local_fd  # open here: the creator's own, or one opened through /proc

    @classmethod
    def create(cls, name: str, size: int, huge_pages: bool = False) -> Segment:
        """huge_pages: the mapping advised for transparent huge pages, else advised against them (a
        host whose shmem_enabled is `always` would otherwise give them to it anyway)."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        _advise_pages(mapping, huge_pages)
        return cls(name, mapping, size, os.getpid(), fd, owned=True, local_fd=fd)

    @classmethod
    def attach(cls, name: str, owner_pid: int, fd: int, size: int, huge_pages: bool = False) -> Segment:
        """ValueError when the creator is gone, the descriptor is not that segment, or it is smaller than size."""
        path = f"/proc/{owner_pid}/fd/{fd}"
        try:
            target = os.readlink(path)
            local_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ValueError(f"segment {name!r}: its owner (pid {owner_pid}) or its descriptor {fd} is gone; "
                             f"the region is gone") from None
        except PermissionError:
            raise ValueError(f"segment {name!r}: /proc/{owner_pid}/fd/{fd} cannot be opened (the owner runs as "
                             f"another user, or /proc is restricted)") from None
        try:
            if target != f"/memfd:{name} (deleted)":
                raise ValueError(f"descriptor {fd} of pid {owner_pid} is {target!r}, not segment {name!r}")
            actual = os.fstat(local_fd).st_size
            if actual < size:
                raise ValueError(f"segment {name!r} holds {actual} bytes, the handle says {size}")
            mapping = mmap.mmap(local_fd, size)
        except BaseException:
            os.close(local_fd)
            raise
        _advise_pages(mapping, huge_pages)  # a huge page is mapped whole only where the mapping allows it
        return cls(name, mapping, size, owner_pid, fd, owned=False, local_fd=local_fd)

    @property
    def address(self) -> int:
        """Where the segment is mapped in this process (page-aligned)."""
        return np.frombuffer(self.buf, dtype=np.uint8).ctypes.data

    def allocate(self, offset: int, length: int) -> None:
        """Allocates the pages of [offset, offset + length) now (under the range's NUMA policy, if
        set); HostMemoryError when the host cannot give them, not a SIGBUS on a later write. They are
        faulted in through this mapping, so they follow its huge-page advice: fallocate has no mapping
        to follow, and gives small pages under shmem_enabled=advise and a whole 2 MB page for any run
        under always. A kernel before 5.14 (no MADV_POPULATE_WRITE) fallocates."""
        try:
            try:
                self.buf.madvise(_MADV_POPULATE_WRITE, offset, length)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                os.posix_fallocate(self._local_fd, offset, length)
        except OSError as error:
            raise HostMemoryError(f"segment {self.name!r}: {length / 2**20:.1f} MiB of host memory could not be "
                                  f"allocated ({error.strerror}): the host KV limit is above what this machine "
                                  f"can give; lower max_host_kv_gb") from None

    def release(self, offset: int, length: int) -> None:
        """Gives the pages of [offset, offset + length) back (they read as zeros after); offset and
        length page-aligned."""
        assert offset % mmap.PAGESIZE == 0 and length % mmap.PAGESIZE == 0, (offset, length)
        self.buf.madvise(mmap.MADV_REMOVE, offset, length)

    def resident_bytes(self) -> int:
        """Bytes of the segment allocated in memory (by anyone: the pages belong to the segment)."""
        return os.fstat(self._local_fd).st_blocks * 512

    def close(self) -> None:
        """Unmaps (unless views are still held: the mapping then lives until they go) and closes
        the descriptor, so the memory goes with the last mapping and the creator's descriptor."""
        with contextlib.suppress(BufferError):
            self.buf.close()
        if self._local_fd >= 0:
            os.close(self._local_fd)
            self._local_fd = -1
        if self.owned:
            self.fd = -1


def _advise_pages(mapping: mmap.mmap, huge_pages: bool) -> None:
    """Advises a segment's mapping for or against transparent huge pages (a kernel without THP refuses
    the advice: nothing to do there)."""
    with contextlib.suppress(OSError):
        mapping.madvise(mmap.MADV_HUGEPAGE if huge_pages else mmap.MADV_NOHUGEPAGE)


class HostMemoryError(MemoryError):
    """The host could not give the pages of a KV segment being committed."""


def segment_name(label: str) -> str:
    """A segment name unique on this host (it shows in /proc/PID/maps as /memfd:NAME)."""
    return f"writescope_{label}_{secrets.token_hex(6)}"


@dataclass(frozen=True)
class RegionHandle:
    kind: str
    shm_name: str  # the segment's memfd name
    owner_pid: int  # the process that created the segment and holds its descriptor
    fd: int  # that descriptor, in the owner
    shard: int
    num_blocks: int
    segment_blocks: int  # blocks per committed segment of the region (num_blocks is a multiple)
    segment_bytes: int  # bytes of the shared-memory segment (the memfd), the whole region
    offsets: tuple[int, ...]  # byte offset of each stored array (K, then V unless V is inside K)
    layout: tuple[str, ...]
    format: KVFormat
    pinned: bool = False
    block_table: tuple[int, ...] = field(default=())  # optional: one sequence's blocks in this region
    page_bytes: int = PAGE_BYTES  # the region's page: 4 KB, or 2 MB where it is laid out in huge pages

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.kind not in HOST_REGIONS:
            raise ValueError(f"handle kind {self.kind!r} is not a host region; allowed: {', '.join(HOST_REGIONS)}")
        if tuple(self.layout) != LAYOUTS[self.kind]:
            raise ValueError(f"handle layout {self.layout} does not match {self.kind}'s {LAYOUTS[self.kind]}")
        if not isinstance(self.format, KVFormat):
            raise ValueError("handle format must be a KVFormat")
        if not self.shm_name or not isinstance(self.shm_name, str):
            raise ValueError(f"handle shm_name must be a non-empty string, got {self.shm_name!r}")
        if self.shard < 0 or self.num_blocks < 0:
            raise ValueError(f"handle shard ({self.shard}) and num_blocks ({self.num_blocks}) must be >= 0")
        if self.page_bytes not in (PAGE_BYTES, HUGE_PAGE_BYTES):
            raise ValueError(f"handle page_bytes must be {PAGE_BYTES} or {HUGE_PAGE_BYTES}, got {self.page_bytes}")
        check_segment_blocks(self.format, self.kind, self.num_blocks, self.segment_blocks, self.page_bytes)
        if self.owner_pid < 1 or self.fd < 0:
            raise ValueError(f"handle owner_pid ({self.owner_pid}) must be >= 1 and fd ({self.fd}) >= 0")
        stored = self.format.stored_arrays
        if len(self.offsets) != len(stored):
            raise ValueError(f"handle has {len(self.offsets)} offsets for {len(stored)} stored arrays")
        end = 0
        for offset, (array, dim) in zip(self.offsets, stored, strict=True):
            nbytes = _array_bytes(self.format, self.kind, self.num_blocks, dim, array)
            if offset < end or offset % self.page_bytes:
                raise ValueError(f"handle offset {offset} overlaps the previous array or is not "
                                 f"{self.page_bytes}-aligned")
            end = offset + nbytes
        if end > self.segment_bytes:
            raise ValueError(f"handle arrays end at byte {end}, past the segment's {self.segment_bytes} bytes")
        bad = [b for b in self.block_table if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"handle block_table holds {bad[:5]}, outside [0, {self.num_blocks})")

    def with_block_table(self, blocks) -> RegionHandle:
        return RegionHandle(**{**self._fields(), "block_table": tuple(int(b) for b in blocks)})

    def to_bytes(self) -> bytes:
        data = self._fields()
        data["format"] = self.format.to_dict()
        return msgpack.packb(data)

    @classmethod
    def from_bytes(cls, payload: bytes) -> RegionHandle:
        try:
            data = msgpack.unpackb(payload)
        except Exception as error:  # msgpack raises several types for garbage
            raise ValueError(f"not a region handle: {error}") from None
        expected = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != expected:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"a region handle needs the fields {sorted(expected)}, got {got}")
        ints = ("owner_pid", "fd", "shard", "num_blocks", "segment_blocks", "segment_bytes", "page_bytes")
        if not all(isinstance(data[k], int) for k in ints) or not isinstance(data["pinned"], bool):
            raise ValueError(f"handle fields {ints} must be integers and pinned a bool")
        for key, kind in (("offsets", int), ("block_table", int), ("layout", str)):
            if not isinstance(data[key], list) or not all(isinstance(x, kind) for x in data[key]):
                raise ValueError(f"handle field {key} must be a list of {kind.__name__}, got {data[key]!r}")
        if not isinstance(data["shm_name"], str) or not isinstance(data["kind"], str):
            raise ValueError("handle fields shm_name and kind must be strings")
        data["format"] = KVFormat.from_dict(data["format"])
        for key in ("offsets", "layout", "block_table"):
            data[key] = tuple(data[key])
        return cls(**data)

    def _fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _array_bytes(fmt: KVFormat, kind: str, num_blocks: int, head_dim: int, array: str) -> int:
    return int(np.prod(fmt.shape(kind, num_blocks, head_dim, array=array))) * fmt.itemsize


# The axis of block ids in each host region's arrays: the block's bytes follow it contiguously,
# what precedes it (layers, and kv heads in cpu_compute) repeats once per block id.
_BLOCK_AXIS = {"cpu_compute": 2, "cpu_transfer": 1}


def _run_bytes(fmt: KVFormat, kind: str, head_dim: int, array: str) -> int:
    """Bytes of one block id's contiguous run in one array (one layer, and one kv head in cpu_compute)."""
    shape = fmt.shape(kind, 1, head_dim, array=array)
    return int(np.prod(shape[_BLOCK_AXIS[kind] + 1:])) * fmt.itemsize


def segment_blocks_for(fmt: KVFormat, target_bytes: int = SEGMENT_BYTES, page_bytes: int = PAGE_BYTES) -> int:
    """Blocks per segment: about target_bytes of KV (every layer and stored array), a multiple of the
    count that makes each of a segment's runs whole pages of page_bytes in both host regions (so a
    segment can be committed and released without touching its neighbours' pages). In 2 MB pages a
    segment is 2 MB or more per layer, kv head and array: 1 GiB for a 32-layer model of 8 kv heads."""
    step = 1
    for kind in _BLOCK_AXIS:
        for array, dim in fmt.stored_arrays:
            run = _run_bytes(fmt, kind, dim, array)
            step = math.lcm(step, page_bytes // math.gcd(page_bytes, run))
    return max(step, target_bytes // fmt.nbytes("cpu_transfer", 1) // step * step)


def check_segment_blocks(fmt: KVFormat, kind: str, num_blocks: int, segment_blocks: int,
                         page_bytes: int = PAGE_BYTES) -> None:
    """ValueError unless segment_blocks divides num_blocks and each segment's runs are whole pages of
    page_bytes (a region of one segment may end inside a page: nothing else lives there)."""
    if segment_blocks < 1 or num_blocks % segment_blocks:
        raise ValueError(f"segment_blocks ({segment_blocks}) must be >= 1 and divide num_blocks ({num_blocks})")
    if num_blocks in (0, segment_blocks):
        return
    for array, dim in fmt.stored_arrays:
        if segment_blocks * _run_bytes(fmt, kind, dim, array) % page_bytes:
            raise ValueError(f"segment_blocks ({segment_blocks}) cuts {kind}'s {array} runs of "
                             f"{_run_bytes(fmt, kind, dim, array)} bytes off page boundaries ({page_bytes}); "
                             f"use a multiple of {segment_blocks_for(fmt, 0, page_bytes)}")


class HostRegion:
    """A `cpu_compute` shard or the `cpu_transfer` region in shared memory.

    Authoritative state: the bytes of the segment. The creator's close() lets the memory go once
    no process maps it; an attached region's close() only unmaps. Arrays are torch tensors over
    the mapping (zero-copy). Which segments are committed is known to the process that commits
    them (the cache); pages are the segment's, whoever committed them.
    """

    def __init__(self, segment: Segment, handle: RegionHandle):
        self._segment = segment
        self.handle = handle
        self.owner = segment.owned
        self.arrays = [self._view(offset, array, dim)
                       for offset, (array, dim) in zip(handle.offsets, handle.format.stored_arrays, strict=True)]
        self.committed: set[int] = set()  # segments committed by this process
        # views derived from the arrays (a layer's K and V as a kernel reads them), made once: the
        # arrays never move, and a view made per call costs the step its Python (compute_source)
        self.layer_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Page-locking is per mapping: the process that commits a segment of a pinned region (the
        # cache's: the GPU worker) registers its own view of it with CUDA, where CUDA is present.
        self._pinned: dict[int, list[int]] = {}  # segment -> addresses registered with CUDA

    @classmethod
    def create(cls, kind: str, fmt: KVFormat, num_blocks: int, *, segment_blocks: int | None = None, shard: int = 0,
               pin: bool | None = None, label: str = "cache", huge_pages: bool = False) -> HostRegion:
        """segment_blocks: blocks per segment (None: the region is one segment). label names the
        segment (with kind, shard and a random suffix) in /proc/PID/maps. huge_pages: the arrays and
        every segment's runs in whole 2 MB pages, the mapping advised for transparent huge pages (a
        host whose shmem_enabled is never gives 4 KB pages all the same)."""
        page_bytes = HUGE_PAGE_BYTES if huge_pages else PAGE_BYTES
        segment_blocks = max(num_blocks, 1) if segment_blocks is None else segment_blocks
        check_segment_blocks(fmt, kind, num_blocks, segment_blocks, page_bytes)
        offsets, end = [], 0
        for array, dim in fmt.stored_arrays:
            offsets.append(end)
            end = _align(end + _array_bytes(fmt, kind, num_blocks, dim, array), page_bytes)
        pin = torch.cuda.is_available() and kind == "cpu_transfer" if pin is None else pin
        segment = Segment.create(segment_name(f"{label}_{kind}_{shard}"), max(end, 1), huge_pages)
        handle = RegionHandle(kind=kind, shm_name=segment.name, owner_pid=segment.owner_pid, fd=segment.fd,
                              shard=shard, num_blocks=num_blocks, segment_blocks=segment_blocks,
                              segment_bytes=segment.size, offsets=tuple(offsets), layout=LAYOUTS[kind], format=fmt,
                              pinned=pin, page_bytes=page_bytes)
        return cls(segment, handle)

    @classmethod
    def attach(cls, handle: RegionHandle | bytes) -> HostRegion:
        if isinstance(handle, bytes | bytearray):
            handle = RegionHandle.from_bytes(bytes(handle))
        handle.validate()
        segment = Segment.attach(handle.shm_name, handle.owner_pid, handle.fd, handle.segment_bytes,
                                 huge_pages=handle.page_bytes == HUGE_PAGE_BYTES)
        return cls(segment, handle)

    # ---------------------------------------------------------------- segments
    @property
    def segment_blocks(self) -> int:
        return self.handle.segment_blocks

    @property
    def page_bytes(self) -> int:
        return self.handle.page_bytes

    @property
    def num_segments(self) -> int:
        return -(-self.handle.num_blocks // self.segment_blocks)

    def segment_ranges(self, index: int) -> list[tuple[int, int]]:
        """(byte offset in the mapping, length) of each contiguous run of segment `index`: one per
        layer (and kv head in cpu_compute) and stored array, adjacent runs joined."""
        if not 0 <= index < self.num_segments:
            raise ValueError(f"segment {index} is outside [0, {self.num_segments}) of {self.kind}")
        fmt, kind, num_blocks = self.handle.format, self.kind, self.handle.num_blocks
        ranges: list[list[int]] = []
        for offset, (array, dim) in zip(self.handle.offsets, fmt.stored_arrays, strict=True):
            run = _run_bytes(fmt, kind, dim, array)
            outer = int(np.prod(fmt.shape(kind, num_blocks, dim, array=array)[: _BLOCK_AXIS[kind]]))
            for o in range(outer):
                start = offset + (o * num_blocks + index * self.segment_blocks) * run
                if ranges and ranges[-1][0] + ranges[-1][1] == start:
                    ranges[-1][1] += self.segment_blocks * run
                else:
                    ranges.append([start, self.segment_blocks * run])
        return [(start, length) for start, length in ranges]

    def commit(self, index: int, node: int | None = None) -> None:
        """Segment `index` takes memory now: its pages bound to NUMA node `node` (None: the kernel's
        choice), allocated, and page-locked where the region is pinned and CUDA is present."""
        if index in self.committed:
            return
        ranges = self.segment_ranges(index)
        if node is not None:
            from writescope.numa_memory import bind_to_node

            for start, length in ranges:
                bind_to_node(self.address + start, _align(length, self.page_bytes), node)
        try:
            for start, length in ranges:
                self._segment.allocate(start, length)
        except HostMemoryError:  # the runs allocated so far go back: the segment stays uncommitted
            for start, length in ranges:
                self._segment.release(start, _align(length, self.page_bytes))
            raise
        if self.handle.pinned and torch.cuda.is_available():
            self._pinned[index] = [self.address + start for start, length in ranges
                                   if _pin(self.address + start, _align(length, self.page_bytes))]
        self.committed.add(index)

    def release(self, index: int) -> None:
        """Segment `index` gives its pages back; its blocks must hold nothing anyone will read. After
        close() only the bookkeeping goes (a cache's sequences may be finished after it was closed)."""
        self.committed.discard(index)
        if self._segment is None:
            return
        for address in self._pinned.pop(index, []):
            _unpin(address)
        for start, length in self.segment_ranges(index):
            self._segment.release(start, _align(length, self.page_bytes))

    def release_all(self) -> None:
        """Every page of the region goes back, in one call (a cache starting on attached regions:
        nothing in them is live)."""
        for addresses in self._pinned.values():
            for address in addresses:
                _unpin(address)
        self._pinned = {}
        whole_pages = self.size_bytes // mmap.PAGESIZE * mmap.PAGESIZE  # all of it but a 1-byte empty region's
        if whole_pages:
            self._segment.release(0, whole_pages)
        self.committed.clear()

    def resident_bytes(self) -> int:
        """Bytes of the region in memory now (its pages allocated, by any process)."""
        return self._segment.resident_bytes()

    def memory(self) -> dict[str, int]:
        """Its size (address space) and its bytes in memory now, as metrics and benchmarks report them."""
        return {"size_bytes": self.size_bytes, "resident_bytes": self.resident_bytes()}

    @property
    def kind(self) -> str:
        return self.handle.kind

    @property
    def attached(self) -> bool:
        """The segment is mapped here (not closed)."""
        return self._segment is not None

    @property
    def address(self) -> int:
        """Where the segment is mapped in this process (page-aligned)."""
        return self._segment.address

    @property
    def size_bytes(self) -> int:
        return self._segment.size

    @property
    def k(self) -> torch.Tensor:
        return self.arrays[0]

    @property
    def v(self) -> torch.Tensor:
        fmt = self.handle.format
        return self.arrays[0][..., : fmt.head_dim_v] if fmt.v_in_k else self.arrays[1]

    def _view(self, offset: int, array: str, head_dim: int) -> torch.Tensor:
        fmt = self.handle.format
        shape = fmt.shape(self.handle.kind, self.handle.num_blocks, head_dim, array=array)
        array = np.ndarray(shape, dtype=_NUMPY_STORAGE[fmt.dtype], buffer=self._segment.buf, offset=offset)
        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if fmt.dtype == "bfloat16" else tensor

    def close(self) -> None:
        if self._segment is None:
            return
        for index in list(self._pinned):
            for address in self._pinned.pop(index):
                _unpin(address)
        self.arrays = []
        self.layer_views.clear()
        self._segment.close()
        self._segment = None


def _pin(address: int, length: int) -> bool:
    """Page-locks [address, address + length) for the CUDA runtime, so copies from it are true DMA."""
    result = torch.cuda.cudart().cudaHostRegister(address, length, 0)
    return int(result) == 0


def _unpin(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)
