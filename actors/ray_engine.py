"""The engine on Ray: `Engine.from_pretrained(..., executor="ray")` returns a RayEngine.

    region owner  (RegionOwner)        creates the shared-memory segments, removes them at shutdown
    scheduler     (WriteScopeScheduler) holds the policy (perf model, r*, online correction) for restarts
    GPU worker    (GPUWorker)          an Engine: model, window, ping-pong, device partial, merge
    CPU workers   (CPUWorker, 1/node)  pinned to their NUMA node, partials over their shard

Ray places, starts, restarts and kills these actors. Inside a decode step the GPU worker exchanges
each layer's q and partials with the CPU workers over shared-memory channels (ChannelExecutor), not
through Ray calls: see writescope.actors.channel and the README for the measured reasons. The
caller's RayEngine holds only handles and forwards generate / generate_stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time

import ray

from writescope import ops
from writescope.actors.channel import ChannelSpec, PartialClient
from writescope.actors.cpu_worker import CPUWorker
from writescope.actors.gpu_worker import GPUWorker
from writescope.actors.region_owner import RegionOwner
from writescope.actors.scheduler import WriteScopeScheduler
from writescope.cpu_partial import CPUPartial, PendingPartial
from writescope.engine import SamplingParams, call_params, engine_cache_config, load_model_config, load_tokenizer
from writescope.executor import LocalExecutor, register_executor
from writescope.prompts import PromptEncoder
from writescope.service import QueueFullError
from writescope.topology import NumaNode, topology

log = logging.getLogger(__name__)


class WorkerLostError(RuntimeError):
    """The GPU worker died during a generation: these requests (indices into the call's prompts)
    are lost. The worker is restarted; the engine accepts new requests."""

    def __init__(self, lost_requests: list[int], cause: BaseException):
        self.lost_requests = lost_requests
        super().__init__(f"the GPU worker died during generation; lost requests (prompt indices): {lost_requests}. "
                         f"It is being restarted and accepts new requests. Cause: {cause}")


class ChannelCPUPartial(CPUPartial):
    """The CPU side of the split computed by the CPU workers: one request per shard over its
    channel, all sent before any is waited for, so the workers run in parallel."""

    def __init__(self, specs: list[ChannelSpec], cache):
        if cache.config.num_shards != len(specs):
            raise ValueError(f"the cache has {cache.config.num_shards} cpu_compute shards for {len(specs)} "
                             f"CPU workers: one shard per worker")
        self.clients = [PartialClient(spec) for spec in specs]

    def attend(self, layer: int, q, view, scale: float) -> PendingPartial:
        for client, (table, lens) in zip(self.clients, view.compute, strict=True):
            client.send(layer, q, table, lens, scale)
        return PendingPartial(lambda: self._collect(view.compute_tokens))

    def _collect(self, tokens: int) -> ops.Partial:
        results = [client.receive() for client in self.clients]
        out, lse = ops.merge([(out, lse) for out, lse, _ in results])
        return ops.Partial(out, lse, tokens, max(seconds for _, _, seconds in results))

    def close(self) -> None:
        for client in self.clients:
            client.close()


class ChannelExecutor(LocalExecutor):
    """Inside the GPU worker: the graph runs here, each layer's CPU partial on the CPU workers, which
    compute while this thread runs the device partial (the request is sent, the answer collected at
    the merge: no thread hand-off in this process)."""

    name = "channel"

    def __init__(self, specs: list[ChannelSpec]):
        super().__init__(concurrent=False)
        self.overlaps = True
        self.specs = specs

    def make_cpu_partial(self, cache) -> CPUPartial:
        return ChannelCPUPartial(self.specs, cache)


class RayEngine:
    """The caller's side of an engine whose actors run on Ray: the Engine API, forwarded."""

    def __init__(self, owner, scheduler, gpu_worker, cpu_workers, prompts: PromptEncoder, engine_id: str):
        self.engine_id = engine_id  # in the names of its memfds and of its channels' sockets
        self.max_seq_len = prompts.max_seq_len
        self.prompts = prompts  # prompts are tokenised and measured here, in the caller's process
        self._worker_lost = False  # the next call first waits for the restarted GPU worker
        self.owner = owner
        self.scheduler = scheduler
        self.gpu_worker = gpu_worker
        self.cpu_workers = cpu_workers
        self._segment_names = ray.get(owner.segment_names.remote())

    @classmethod
    def from_pretrained(cls, path_or_preset: str, *, executor_options: dict, policy, device: str = "cpu",
                        num_shards: int | None = None, **options) -> RayEngine:
        if not ray.is_initialized():
            raise ValueError("executor 'ray' needs a running Ray: call ray.init() (or connect to a cluster) first")
        if not isinstance(policy, str):
            raise ValueError("executor 'ray' takes the policy by name: the scheduler actor makes it")
        unknown = set(executor_options) - {"nodes", "max_waiting"}
        if unknown:
            raise ValueError(f"unknown executor_options {sorted(unknown)}; executor 'ray' takes nodes, max_waiting")
        nodes: list[NumaNode] = executor_options.get("nodes") or topology()
        if num_shards not in (None, len(nodes)):
            raise ValueError(f"num_shards={num_shards} for {len(nodes)} NUMA nodes: one shard per node")
        gpus = 1 if device.startswith("cuda") else 0
        if gpus and ray.cluster_resources().get("GPU", 0) < 1:
            raise ValueError(f"device={device!r} but the Ray cluster has no GPU: use device='cpu' or add a GPU node")
        config, torch_dtype = load_model_config(path_or_preset, options.get("dtype"))
        cache_config = engine_cache_config(config, torch_dtype, block_size=options["block_size"],
                                           max_batch_size=options["max_batch_size"],
                                           max_seq_len=options["max_seq_len"], num_shards=len(nodes),
                                           window_tokens=options["window_tokens"],
                                           pingpong_blocks=options["pingpong_blocks"], device=device)
        engine_id = secrets.token_hex(4)
        fmt = cache_config.format
        specs = [ChannelSpec(shm_name="named by the owner", owner_pid=0, fd=-1,
                             socket_address=f"\0writescope-{engine_id}-cpu{i}", max_seqs=cache_config.max_seqs,
                             max_blocks=cache_config.compute_blocks_per_shard, num_q_heads=config.num_q_heads,
                             head_dim_qk=fmt.head_dim_k, head_dim_v=fmt.head_dim_v) for i in range(len(nodes))]
        named = f"writescope-{engine_id}"  # every actor of the engine is named for it (ray.util.list_named_actors)
        owner = RegionOwner.options(name=f"{named}-region-owner").remote(cache_config, specs, engine_id, gpus > 0)
        actors = [owner]
        try:
            compute_handles, transfer_handle = ray.get(owner.handles.remote())
            specs = ray.get(owner.channel_specs.remote())
            cpu_workers = [CPUWorker.options(name=f"{named}-cpu-worker-{i}").remote(node, compute_handles[i], specs[i])
                           for i, node in enumerate(nodes)]
            scheduler = WriteScopeScheduler.options(name=f"{named}-scheduler").remote()
            actors += [*cpu_workers, scheduler]
            ray.get([w.check_health.remote() for w in cpu_workers])
            gpu_worker = GPUWorker.options(name=f"{named}-gpu-worker", num_gpus=gpus, num_cpus=0).remote(
                path_or_preset, {**options, "policy": policy, "device": device},
                (compute_handles, transfer_handle), specs, scheduler, executor_options.get("max_waiting", 64))
            actors.append(gpu_worker)
            ray.get(gpu_worker.check_health.remote())
        except BaseException:
            _stop(actors, owner)
            raise
        prompts = PromptEncoder(load_tokenizer(path_or_preset), config.vocab_size, options["max_seq_len"])
        return cls(owner, scheduler, gpu_worker, cpu_workers, prompts, engine_id)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, **kwargs):
        """As Engine.generate; raises WorkerLostError (naming every request of the call) if the GPU
        worker dies meanwhile."""
        prompts = self._encode_call(prompts, kwargs)
        self._wait_for_restart()
        try:
            return ray.get(self.gpu_worker.generate.remote(prompts, kwargs))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as error:
            self._worker_lost = True
            raise WorkerLostError(list(range(_num_prompts(prompts))), error) from error

    def generate_stream(self, prompts, **kwargs):
        """As Engine.generate_stream; raises WorkerLostError naming the requests not finished when
        the GPU worker died."""
        finished: set[int] = set()
        prompts = self._encode_call(prompts, kwargs)
        self._wait_for_restart()
        generator = self.gpu_worker.generate_stream.remote(prompts, kwargs)
        try:
            for ref in generator:
                for event in ray.get(ref):  # the events that were ready together
                    if event.finish_reason is not None:
                        finished.add(event.index)
                    yield event
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as error:
            lost = [i for i in range(_num_prompts(prompts)) if i not in finished]
            self._worker_lost = True
            raise WorkerLostError(lost, error) from error
        finally:
            if len(finished) < _num_prompts(prompts):  # the caller stopped early: stop the call's requests
                with contextlib.suppress(Exception):
                    ray.cancel(generator)

    def _encode_call(self, prompts, kwargs: dict) -> list[list[int]]:
        """The call's prompts as checked token ids (ValueError for a bad or too long one)."""
        prompts, params = call_params(prompts, SamplingParams(), kwargs.get("params"))
        max_new_tokens = [p.max_new_tokens if kwargs.get("params") else kwargs.get("max_new_tokens", 32)
                          for p in params]
        return [self.prompts.encode(p, n, position) for position, (p, n) in enumerate(zip(prompts, max_new_tokens,
                                                                                             strict=True))]

    def _wait_for_restart(self, timeout_s: float = 300.0) -> None:
        """After a lost GPU worker: waits until Ray has restarted it (weights loaded, regions attached)."""
        deadline = time.monotonic() + timeout_s
        while self._worker_lost:
            try:
                ray.get(self.gpu_worker.check_health.remote(), timeout=max(deadline - time.monotonic(), 1))
                self._worker_lost = False
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as error:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the GPU worker did not come back within {timeout_s:.0f} s") from error
                time.sleep(0.2)

    async def submit(self, prompt, params) -> int:
        """Queues one request in the running batch (for servers): its id. Raises QueueFullError when
        the queue for KV capacity is full, ValueError for a bad or too long prompt."""
        return (await self.submit_request(prompt, params))["id"]

    async def submit_request(self, prompt, params) -> dict:
        """As submit: {"id", "prompt_tokens"}. The prompt is tokenised and measured here, in a thread
        (a long text does not hold up the caller's event loop, nor ever reach the engine's loop)."""
        ids = await asyncio.to_thread(self.prompts.encode, prompt, params.max_new_tokens)
        try:
            return await self.gpu_worker.submit.remote(ids, params)
        except ray.exceptions.RayTaskError as error:  # the worker's own refusal, as its own type
            if isinstance(error.cause, QueueFullError | ValueError):
                raise error.cause from None
            raise

    async def wait_until_ready(self, timeout_s: float = 300.0) -> None:
        """Returns once the GPU worker answers (after Ray restarted it); RuntimeError past timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await asyncio.wait_for(self.gpu_worker.check_health.remote(), timeout=10)
                return
            except Exception as error:  # noqa: BLE001 - restarting, or its loop failed and it is exiting
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the GPU worker did not come back within {timeout_s:.0f} s") from error
                await asyncio.sleep(0.5)

    async def stream(self, request_id: int):
        """The StreamEvents of a submitted request; closing this generator early cancels it."""
        finished = False
        try:
            async for ref in self.gpu_worker.stream.remote(request_id):
                event = await ref
                finished = event.finish_reason is not None
                yield event
        finally:
            if not finished:  # the caller went away (or the worker died): free its batch slot and KV
                self.gpu_worker.cancel.remote(request_id)

    # ------------------------------------------------------------------ inspection
    def current_share(self) -> float | None:
        """r* for the batch running now (None when nothing runs)."""
        return ray.get(self.gpu_worker.state.remote())["cpu_share_now"]

    def state(self) -> dict:
        """The GPU worker's queue, occupancy and counters, and the scheduler's r*."""
        return {**ray.get(self.gpu_worker.state.remote()), "scheduler": self.scheduler_state()}

    def check_integrity(self) -> None:
        ray.get(self.gpu_worker.check_integrity.remote())

    @property
    def stats(self) -> dict:
        return ray.get(self.gpu_worker.stats.remote())

    @property
    def step_history(self) -> list[tuple[float, float]]:
        """(step seconds, attention seconds) of the GPU worker's recent decode steps."""
        return ray.get(self.gpu_worker.step_history.remote())

    def scheduler_state(self) -> dict:
        return ray.get(self.scheduler.state.remote())

    def segment_names(self) -> list[str]:
        """The memfd names of this engine's shared memory (no process maps them after shutdown)."""
        return list(self._segment_names)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stops every actor of this engine; its shared memory goes with them (memfds: nothing is
        left to remove, whether they stop here or are killed)."""
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.gpu_worker.shutdown.remote(), timeout=30)
        for worker in self.cpu_workers:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(worker.shutdown.remote(), timeout=30)
        _stop([self.gpu_worker, *self.cpu_workers, self.scheduler], self.owner)


def _stop(actors, owner) -> None:
    for actor in actors:
        if actor is not owner:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
    with contextlib.suppress(Exception):
        ray.get(owner.close.remote(), timeout=30)
    with contextlib.suppress(Exception):
        ray.kill(owner, no_restart=True)


def _num_prompts(prompts) -> int:
    return 1 if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else len(prompts)


register_executor("channel", ChannelExecutor)
def _engine_only(**_options):
    raise ValueError("executor 'ray' is a whole engine on actors: use Engine.from_pretrained(..., executor='ray')")


register_executor("ray", _engine_only, engine=RayEngine.from_pretrained)
