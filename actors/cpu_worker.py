"""The CPU worker: one Ray actor per NUMA node, computing the CPU partials over its node's
cpu_compute shard, served over a shared-memory channel to the GPU worker.
On a real (not emulated) NUMA node the shard's pages lie in the node's memory: the cache binds each
segment of the shard to the node (mbind) when it commits it, before any KV is written there.

Authoritative state: none. The shard's bytes and the channel's segment live in shared memory owned
by the region owner, so a worker that crashes loses nothing. Rebuilt on (re)start: the pinning of
the process and of the kernel's thread pool to the node's CPUs, the attachment of the shard from
its handle, and the channel's listening socket (the GPU worker reconnects and resends).

The CPU side of a Ray decode step lives in this one file, both ends of it: the channel's wire
(`ChannelSpec`, the request and reply headers), the worker's end (`PartialServer`, which answers
through `CPUWorker._partial`), and the GPU worker's end (`PartialClient`, and `ChannelExecutor` with
its `ChannelCPUPartial`: the engine's CPU partial as one request per shard).

The channel, one per CPU worker, used by every layer: the exchange of a CPU partial
(q, block table and lengths in; out and lse back) through a shared-memory segment, with a Unix
stream socket carrying a small header each way to wake the other side.

Why not a Ray call per layer: a plain actor call costs ~1-3 ms here, and a compiled graph
busy-spins a core per actor (see the README). The socket wait blocks in the kernel, so nothing
spins, and the arrays never cross the socket. Ray still places, starts, restarts and kills the
workers. The socket has an abstract name (no file to leave behind when a process is killed) and
nothing listens on the network; both ends check the other's user id (SO_PEERCRED), so no other
user of the host can talk to either. The segment is a memfd (writescope.kv_regions.Segment): it
goes with the last process that maps it.

A CPU worker that dies takes only its socket with it: the segment belongs to the region owner.
The client then reconnects to the restarted worker and sends the same request again; a partial is
a pure function of q, the table and the shard's bytes, so the retry gives the same result.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, replace

import numpy as np
import ray
import torch

from writescope import ops
from writescope.executor import CPUPartial, LocalExecutor, PendingPartial
from writescope.kv_regions import Segment, segment_name
from writescope.topology import NumaNode

log = logging.getLogger(__name__)

# ------------------------------------------------------------------ the channel's wire
REQUEST = struct.Struct("<QIIIIIId")  # request id, region, layer, num_seqs, table width, unit, q dtype, scale
BLOCKS, TOKENS = 0, 1  # what a request's table indexes in its region: blocks, or single tokens (a selection)
# q crosses in its own dtype (its code: the index here), so the worker's kernel takes the same path
# as the local executor's on the same q: a bf16 q takes the bf16-dot path, which rounds the
# probabilities to bf16, and a float32 copy of it would not. The q slot holds float32 at most.
Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REPLY = struct.Struct("<QdI")  # request id, kernel seconds, length of the error message that follows (0: ok)
_ALIGN = 64


@dataclass(frozen=True)
class ChannelSpec:
    """Where one CPU worker's channel lives and the largest request it carries."""

    shm_name: str  # the segment's memfd name
    owner_pid: int  # the region owner, which holds the segment's descriptor
    fd: int
    socket_address: str  # an abstract Unix socket name (leading NUL byte)
    max_seqs: int
    max_blocks: int  # table width: blocks of one sequence in a shard (or, a selection, the tokens it chooses)
    num_q_heads: int
    head_dim_qk: int
    head_dim_v: int

    def layout(self) -> dict[str, tuple[int, tuple[int, ...], np.dtype]]:
        """Array name -> (byte offset, shape, dtype) inside the segment."""
        arrays = {"q": ((self.max_seqs, self.num_q_heads, self.head_dim_qk), np.float32),
                  "table": ((self.max_seqs * self.max_blocks,), np.int32),
                  "lens": ((self.max_seqs,), np.int32),
                  "out": ((self.max_seqs, self.num_q_heads, self.head_dim_v), np.float32),
                  "lse": ((self.max_seqs, self.num_q_heads), np.float32)}
        layout, offset = {}, 0
        for name, (shape, dtype) in arrays.items():
            layout[name] = (offset, shape, np.dtype(dtype))
            offset += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
        return layout

    def segment_bytes(self) -> int:
        offset, shape, dtype = self.layout()["lse"]
        return offset + int(np.prod(shape)) * dtype.itemsize


def write_q(slot: np.ndarray, q: torch.Tensor) -> None:
    """q [num_seqs, num_q_heads, head_dim_qk] (a Q_DTYPES dtype, contiguous) into the channel's q slot
    (float32 [max_seqs, num_q_heads, head_dim_qk]) from its first byte."""
    if q.dtype == torch.float32:
        slot[: q.shape[0]] = q.numpy()
    else:  # numpy has no bf16: the bits, as 16-bit words
        slot.reshape(-1).view(np.int16)[: q.numel()] = q.view(torch.int16).reshape(-1).numpy()


def read_q(slot: np.ndarray, num_seqs: int, dtype: torch.dtype) -> torch.Tensor:
    """The q write_q put in the slot: [num_seqs, num_q_heads, head_dim_qk] of `dtype`, a view."""
    if dtype == torch.float32:
        return torch.from_numpy(slot[:num_seqs])
    _, num_q_heads, head_dim_qk = slot.shape
    words = slot.reshape(-1).view(np.int16)[: num_seqs * num_q_heads * head_dim_qk]
    return torch.from_numpy(words.reshape(num_seqs, num_q_heads, head_dim_qk)).view(dtype)


def create_segment(spec: ChannelSpec, label: str) -> tuple[ChannelSpec, Segment]:
    """The segment of one channel (made by the region owner, which holds it for the engine's life),
    and the spec that names it."""
    segment = Segment.create(segment_name(label), spec.segment_bytes())
    return replace(spec, shm_name=segment.name, owner_pid=segment.owner_pid, fd=segment.fd), segment


class _Buffers:
    """Numpy views of a channel's segment, attached from the region owner."""

    def __init__(self, spec: ChannelSpec):
        self.spec = spec
        try:
            self._segment = Segment.attach(spec.shm_name, spec.owner_pid, spec.fd, spec.segment_bytes())
        except ValueError as error:
            raise ValueError(f"channel segment: {error}") from None
        self.arrays = {name: np.ndarray(shape, dtype=dtype, buffer=self._segment.buf, offset=offset)
                       for name, (offset, shape, dtype) in spec.layout().items()}

    def close(self) -> None:
        self.arrays = {}
        self._segment.close()


def _peer_uid(sock: socket.socket) -> int:
    pid_uid_gid = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", pid_uid_gid)[1]


def _receive_exact(sock: socket.socket, size: int) -> bytes:
    data = sock.recv(size, socket.MSG_WAITALL)  # one call, where a loop of recv cost ~10 us more a message
    while len(data) < size:  # cut short: the peer closed, or a signal came
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the other side of the channel closed it")
        data += chunk
    return data


# ------------------------------------------------------------------ the CPU worker's end
class PartialServer:
    """The CPU worker's side: a thread that answers partial requests over its shards (one region per
    KV cache of the engine: one for most models, one per compression rate for DeepSeek-V4).

    compute(region, layer, q, table, lens, scale, unit) -> (out, lse, kernel seconds) runs the kernel;
    requests are checked against the channel's bounds first (region, layer of that region, sizes,
    unit), and any failure goes back to the client as an error. region_layers: each region's layers.
    """

    def __init__(self, spec: ChannelSpec, compute, region_layers: list[int]):
        self.spec = spec
        self._compute = compute
        self._region_layers = list(region_layers)
        self._buffers = _Buffers(spec)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(spec.socket_address)  # free again as soon as a previous life of this worker died
        self._listener.listen(1)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="writescope-partial-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            if _peer_uid(conn) != os.getuid():  # an abstract name is reachable by any user of the host
                log.warning("refused a channel connection from another user (uid %d)", _peer_uid(conn))
                conn.close()
                continue
            with conn:
                try:
                    while True:
                        self._answer(conn, REQUEST.unpack(_receive_exact(conn, REQUEST.size)))
                except (ConnectionError, OSError):
                    continue  # the client went away (a restarted GPU worker reconnects)

    def _answer(self, conn, request) -> None:
        request_id, region, layer, num_seqs, width, unit, q_dtype, scale = request
        seconds, error = 0.0, ""
        try:
            self._check(region, layer, num_seqs, width, unit, q_dtype)
            a = self._buffers.arrays
            table = a["table"][: num_seqs * width].reshape(num_seqs, width)
            out, lse, seconds = self._compute(region, layer, read_q(a["q"], num_seqs, Q_DTYPES[q_dtype]),
                                              torch.from_numpy(table), torch.from_numpy(a["lens"][:num_seqs]), scale,
                                              unit)
            a["out"][:num_seqs] = out.numpy()
            a["lse"][:num_seqs] = lse.numpy()
        except Exception as exc:  # noqa: BLE001 - every failure is the client's to raise
            error = f"{type(exc).__name__}: {exc}"
        message = error.encode()
        conn.sendall(REPLY.pack(request_id, seconds, len(message)) + message)

    def _check(self, region: int, layer: int, num_seqs: int, width: int, unit: int, q_dtype: int) -> None:
        spec = self.spec
        if not 0 <= q_dtype < len(Q_DTYPES):
            raise ValueError(f"q dtype code {q_dtype} is outside [0, {len(Q_DTYPES)}): "
                             f"{', '.join(str(d) for d in Q_DTYPES)}")
        if not 0 <= region < len(self._region_layers):
            raise ValueError(f"region {region} is outside [0, {len(self._region_layers)}): this worker serves "
                             f"{len(self._region_layers)} shard region(s)")
        if not 0 <= layer < self._region_layers[region]:
            raise ValueError(f"layer {layer} is outside [0, {self._region_layers[region]}) of region {region}")
        if unit not in (BLOCKS, TOKENS):
            raise ValueError(f"table unit {unit} is neither {BLOCKS} (blocks) nor {TOKENS} (tokens)")
        if not 0 < num_seqs <= spec.max_seqs:
            raise ValueError(f"num_seqs {num_seqs} is outside [1, {spec.max_seqs}]")
        if not 0 < width <= spec.max_blocks:
            raise ValueError(f"table width {width} is outside [1, {spec.max_blocks}]")

    def serving(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)
        self._buffers.close()


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class CPUWorker:
    def __init__(self, node: NumaNode, shard_handles: list[bytes], channel):
        """shard_handles: this node's cpu_compute shard of each of the engine's KV caches (one, or one
        per compression rate for DeepSeek-V4); a request names its region by index in this list."""
        # Imported here, in the worker: Ray pickles this class by value, and its globals with it.
        from writescope.kv_regions import HostRegion
        from writescope.topology import pin_process, share_cores

        pin_process(node.cpus)  # the threads Ray started before us and the kernel's pool
        share_cores()  # the node's cores are the GPU worker's and the other CPU workers' too
        self.node = node
        # their segments bound to the node as the cache commits them
        self.regions = [HostRegion.attach(handle) for handle in shard_handles]
        self.server = PartialServer(channel, self._partial,
                                    region_layers=[r.handle.format.num_layers for r in self.regions])

    def _partial(self, region, layer, q, table, seq_lens, scale, unit):
        """q [num_seqs, num_q_heads, head_dim_qk] as sent (Q_DTYPES); table: blocks of the region, or (unit TOKENS)
        tokens of it -> (out [num_seqs, num_q_heads, head_dim_v], lse, the kernel's own seconds)."""
        from writescope.inplace_kv_cache import compute_source, selected_source

        shard = self.regions[region]
        source = (selected_source if unit == TOKENS else compute_source)(shard, layer, table, seq_lens)
        # the channel checked the request's bounds; the C++ launcher checks every block id before a read
        return ops.cpu_paged_attention_timed(q, source, scale)

    def pool_spin(self) -> int:
        """Microseconds this process's kernel pool polls between jobs (for checks from outside)."""
        from writescope import _cpu

        return _cpu.pool_spin()

    def thread_affinities(self) -> dict[int, list[int]]:
        """CPU sets of every thread of this process, read by thread id (for checks from outside)."""
        return {int(tid): sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}

    def shard_page_nodes(self) -> list[int]:
        """The NUMA node of each page of this worker's shard (for checks from outside)."""
        from writescope.numa_memory import page_nodes

        return [node for r in self.regions for node in page_nodes(r.address, r.size_bytes)]

    def pid(self) -> int:
        return os.getpid()

    def check_health(self) -> bool:
        """The shard is mapped and the channel's thread is serving."""
        return all(r.attached for r in self.regions) and self.server.serving()

    def shutdown(self) -> None:
        self.server.close()
        for region in self.regions:
            region.close()


# ------------------------------------------------------------------ the GPU worker's end
class PartialClient:
    """The GPU worker's side of one channel: send() a request, then receive() its partial. A lost
    connection (the CPU worker died) is re-established within reconnect_timeout_s, while Ray
    restarts the worker, and the same request is sent again."""

    def __init__(self, spec: ChannelSpec, reconnect_timeout_s: float = 120.0):
        self.spec = spec
        self.reconnect_timeout_s = reconnect_timeout_s
        self._buffers = _Buffers(spec)
        self._sock: socket.socket | None = None
        self._next_id = 0
        self._request = None  # (header, q, table, lens) of the request in flight, for a resend

    def send(self, layer: int, q: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
             scale: float, *, region: int = 0, unit: int = BLOCKS) -> None:
        """q [num_seqs, num_q_heads, head_dim_qk]; block_table [num_seqs, width] int32 (blocks of the
        worker's region `region`, or with unit TOKENS its tokens); seq_lens [num_seqs] int32."""
        num_seqs, width = block_table.shape
        spec = self.spec
        if tuple(q.shape) != (num_seqs, spec.num_q_heads, spec.head_dim_qk):
            raise ValueError(f"q is {list(q.shape)}, the channel carries [num_seqs={num_seqs}, "
                             f"{spec.num_q_heads}, {spec.head_dim_qk}]")
        if not 0 < num_seqs <= spec.max_seqs or not 0 < width <= spec.max_blocks:
            raise ValueError(f"a table of {num_seqs} x {width} does not fit the channel's "
                             f"{spec.max_seqs} x {spec.max_blocks}")
        self._next_id += 1
        q = q if q.dtype in Q_DTYPES else q.float()
        header = REQUEST.pack(self._next_id, region, layer, num_seqs, width, unit, Q_DTYPES.index(q.dtype), scale)
        self._request = (header, q.contiguous(), block_table.numpy(), seq_lens.numpy())
        try:
            self._transmit()
        except (ConnectionError, OSError):
            self._drop()  # receive() reconnects and sends it again

    def _transmit(self) -> None:
        header, q, table, lens = self._request
        num_seqs, width = table.shape
        a = self._buffers.arrays
        write_q(a["q"], q)
        a["table"][: num_seqs * width] = table.reshape(-1)
        a["lens"][:num_seqs] = lens
        self._connected().sendall(header)

    def receive(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(out [num_seqs, num_q_heads, head_dim_v], lse [num_seqs, num_q_heads], kernel seconds)."""
        header = self._request[0]
        request_id, _, _, num_seqs, *_ = REQUEST.unpack(header)
        deadline = time.monotonic() + self.reconnect_timeout_s
        while True:
            try:
                if self._sock is None:
                    self._transmit()
                got_id, seconds, error_len = REPLY.unpack(_receive_exact(self._sock, REPLY.size))
                error = _receive_exact(self._sock, error_len).decode() if error_len else ""
                if got_id != request_id:
                    raise ConnectionError(f"reply {got_id} to request {request_id}")
                break
            except (ConnectionError, OSError) as exc:
                self._drop()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the CPU worker at {self.spec.socket_address!r} did not come back within "
                                       f"{self.reconnect_timeout_s:.0f} s") from exc
                log.warning("CPU worker channel %r lost (%s): resending to the restarted worker",
                            self.spec.socket_address, exc)
        if error:
            raise RuntimeError(f"CPU worker at {self.spec.socket_address!r}: {error}")
        a = self._buffers.arrays
        return torch.from_numpy(a["out"][:num_seqs].copy()), torch.from_numpy(a["lse"][:num_seqs].copy()), seconds

    def _connected(self) -> socket.socket:
        deadline = time.monotonic() + self.reconnect_timeout_s
        while self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.spec.socket_address)
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no CPU worker listens at {self.spec.socket_address!r} after "
                                       f"{self.reconnect_timeout_s:.0f} s") from None
                time.sleep(0.02)
                continue
            if _peer_uid(sock) != os.getuid():
                sock.close()
                raise RuntimeError(f"another user holds the channel name {self.spec.socket_address!r}")
            self._sock = sock
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        self._drop()
        self._buffers.close()


class ChannelCPUPartial(CPUPartial):
    """The CPU side of the split over one KV cache computed by the CPU workers: one request per shard
    over its channel, all sent before any is waited for, so the workers run in parallel. region: the
    cache's index among the shard regions each worker serves."""

    runs_elsewhere = True

    def __init__(self, clients: list[PartialClient], cache, region: int):
        if cache.config.num_shards != len(clients):
            raise ValueError(f"the cache has {cache.config.num_shards} cpu_compute shards for {len(clients)} "
                             f"CPU workers: one shard per worker")
        self.clients = clients
        self.region = region

    def attend(self, layer: int, q, view, scale: float) -> PendingPartial:
        # a worker whose shard has no tokens in this step is not asked: a round trip for a partial that
        # would change no merge (one per layer, 0.1-0.4 ms on a 2-vCPU host)
        asked = []
        for client, (table, lens), tokens in zip(self.clients, view.compute, view.compute_shard_tokens, strict=True):
            if tokens:
                client.send(layer, q, table, lens, scale, region=self.region, unit=BLOCKS)
                asked.append(client)
        if not asked:
            return PendingPartial.done(ops.empty_partial(q, self.clients[0].spec.head_dim_v))
        return PendingPartial(lambda: self._collect(asked, view.compute_tokens))

    def attend_selected(self, layer: int, q, selection: list, tokens: int, scale: float) -> PendingPartial:
        for client, (table, lens) in zip(self.clients, selection, strict=True):
            client.send(layer, q, table, lens, scale, region=self.region, unit=TOKENS)
        return PendingPartial(lambda: self._collect(self.clients, tokens))

    @staticmethod
    def _collect(clients: list[PartialClient], tokens: int) -> ops.Partial:
        results = [client.receive() for client in clients]
        out, lse = ops.merge([(out, lse) for out, lse, _ in results])
        return ops.Partial(out, lse, tokens, max(seconds for _, _, seconds in results))


class ChannelExecutor(LocalExecutor):
    """Inside the GPU worker: the graph runs here, each layer's CPU partial on the CPU workers, which
    compute while this thread runs the device partial (the request is sent, the answer collected at
    the merge: no thread hand-off in this process). One client per channel, shared by the partials
    of every cache (a worker serves one connection; the step's requests never overlap on it)."""

    name = "channel"

    def __init__(self, specs: list[ChannelSpec]):
        super().__init__(concurrent=False)
        self.overlaps = True
        self.specs = specs
        self._clients: list[PartialClient] | None = None

    def make_cpu_partial(self, cache, region: int = 0) -> CPUPartial:
        if self._clients is None:
            clients = []
            try:
                for spec in self.specs:
                    clients.append(PartialClient(spec))
            except BaseException:
                for client in clients:
                    client.close()
                raise
            self._clients = clients
        return ChannelCPUPartial(self._clients, cache, region)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            for client in self._clients or []:
                client.close()
            self._clients = None
