"""The engine on Ray: `RayEngine.from_pretrained(model, **EngineConfig fields)` (or its alias
`Engine.from_pretrained(..., executor="ray")`) returns a RayEngine.

    region owner  (RegionOwner)        creates the shared-memory segments, removes them at shutdown
    policy store  (PolicyStore)        holds the policy (perf model, r*, online correction) for restarts
    GPU worker    (GPUWorker)          an Engine: model, window, ping-pong, device partial, merge
    CPU workers   (CPUWorker, 1/node)  pinned to their NUMA node, partials over their shard

Ray places, starts, restarts and kills these actors, all of them in one engine group on one node
(writescope.actors.engine_group: one placement-group bundle, STRICT_PACK, with the GPU and
engine_cpus CPUs). Inside a decode step the GPU worker exchanges
each layer's q and partials with the CPU workers over shared-memory channels
(writescope.actors.cpu_worker), not through Ray calls: see that module and the README for the
measured reasons. The caller's RayEngine holds only handles and forwards generate /
generate_stream. DeepSeek-V4 has two KV caches (its entry caches, one per compression rate): the
region owner makes regions for each, and each CPU worker serves its shard of both over one channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time

import ray

from writescope.actors.cpu_worker import ChannelSpec, CPUWorker
from writescope.actors.engine_group import MAIN_CACHE, EngineGroup, EngineSite, engine_site
from writescope.actors.gpu_worker import GPUWorker, QueueFullError
from writescope.actors.local_ray import ensure_ray
from writescope.actors.policy_store import PolicyStore
from writescope.actors.region_owner import RegionOwner
from writescope.config import EngineConfig
from writescope.engine import StepTimes
from writescope.loading import load_tokenizer
from writescope.prompts import PromptEncoder
from writescope.sampling import SamplingParams, call_params
from writescope.topology import NumaNode

log = logging.getLogger(__name__)


class WorkerLostError(RuntimeError):
    """The GPU worker died during a generation: these requests (indices into the call's prompts)
    are lost. The worker is restarted; the engine accepts new requests."""

    def __init__(self, lost_requests: list[int], cause: BaseException):
        self.lost_requests = lost_requests
        super().__init__(f"the GPU worker died during generation; lost requests (prompt indices): {lost_requests}. "
                         f"It is being restarted and accepts new requests. Cause: {cause}")


class RayEngine:
    """The caller's side of an engine whose actors run on Ray: the Engine API, forwarded."""

    def __init__(self, owner, policy_store, gpu_worker, cpu_workers, prompts: PromptEncoder, engine_id: str,
                 group: EngineGroup):
        self.engine_id = engine_id  # in the names of its memfds and of its channels' sockets
        self.group = group
        self.node_id = group.node_id  # the Ray node its actors run on
        self.max_seq_len = prompts.max_seq_len
        self.prompts = prompts  # prompts are tokenised and measured here, in the caller's process
        self._worker_lost = False  # the next call first waits for the restarted GPU worker
        self.owner = owner
        self.policy_store = policy_store
        self.gpu_worker = gpu_worker
        self.cpu_workers = cpu_workers
        self._segment_names = ray.get(owner.segment_names.remote())

    @classmethod
    def from_pretrained(cls, model: str | None = None, *, config: EngineConfig | None = None,
                        nodes: list[NumaNode] | None = None, max_waiting: int = 64, **fields) -> RayEngine:
        """The engine of `config` (model and any EngineConfig field as keywords replace its values)
        on Ray: the cluster this driver already joined, the one of RAY_ADDRESS (inside `ray job
        submit`), or else a new embedded local one, with token authentication. Its actors run in one
        engine group (EngineGroup.place: the caller's placement group, else one made for it). nodes:
        the NUMA nodes to place one CPU worker on each (default: config.emulated_nodes emulated ones,
        else those of the engine's node, read there). max_waiting: requests the GPU worker holds
        waiting for KV capacity."""
        config = (config or EngineConfig()).replace(**({"model": model} if model is not None else {}), **fields)
        if not isinstance(config.policy, str):
            raise ValueError("executor 'ray' takes the policy by name: the policy_store actor makes it")
        ensure_ray()
        gpus = 1 if config.device.startswith("cuda") else 0
        if gpus and ray.cluster_resources().get("GPU", 0) < 1:
            raise ValueError(f"device={config.device!r} but the Ray cluster has no GPU: "
                             f"use device='cpu' or add a GPU node")
        group = EngineGroup.place(config)
        try:
            return cls._start(config, group, nodes, gpus, max_waiting)
        except BaseException:
            group.remove()
            raise

    @classmethod
    def _start(cls, config: EngineConfig, group: EngineGroup, nodes, gpus: int, max_waiting: int) -> RayEngine:
        """The engine's actors in `group`, sized on its node."""
        site = engine_site(group, config, nodes)
        nodes, model_config = site.nodes, site.model_config
        config = config.replace(num_shards=len(nodes))
        for name, cache_config in site.cache_configs.items():
            log.info("%s%s (node %s)", "" if name == MAIN_CACHE else f"{name} entries: ", cache_config.capacity_line(),
                     group.node_id)
        engine_id = secrets.token_hex(4)
        specs = [_channel_spec(site, f"\0writescope-{engine_id}-cpu{i}") for i in range(len(nodes))]
        named = f"writescope-{engine_id}"  # every actor of the engine is named for it (ray.util.list_named_actors)
        placed = group.options()
        owner = RegionOwner.options(name=f"{named}-region-owner", **placed).remote(site.cache_configs, specs,
                                                                                 engine_id, gpus > 0)
        actors = [owner]
        try:
            handles = ray.get(owner.handles.remote())  # name -> ([cpu_compute per shard], cpu_transfer)
            specs = ray.get(owner.channel_specs.remote())
            # worker i serves shard i of every cache, in the caches' order (a request names the cache by index)
            cpu_workers = [CPUWorker.options(name=f"{named}-cpu-worker-{i}", **placed).remote(
                node, [compute[i] for compute, _ in handles.values()], specs[i]) for i, node in enumerate(nodes)]
            policy_store = PolicyStore.options(name=f"{named}-policy-store", **placed).remote()
            actors += [*cpu_workers, policy_store]
            ray.get([w.check_health.remote() for w in cpu_workers])
            region_handles, cache_config = (handles, site.cache_configs) if site.deepseek_v4 else (
                handles[MAIN_CACHE], site.cache_configs[MAIN_CACHE])
            gpu_worker = GPUWorker.options(name=f"{named}-gpu-worker", num_gpus=gpus, num_cpus=0, **placed).remote(
                config, cache_config, region_handles, specs, policy_store, max_waiting)
            actors.append(gpu_worker)
            ray.get(gpu_worker.check_health.remote())
        except BaseException:
            _stop(actors, owner)
            raise
        prompts = PromptEncoder(load_tokenizer(config.model), model_config.vocab_size, config.max_seq_len)
        return cls(owner, policy_store, gpu_worker, cpu_workers, prompts, engine_id, group)

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

    async def submit_request(self, prompt, params, add_special_tokens: bool = True) -> dict:
        """As submit: {"id", "prompt_tokens"}. The prompt is tokenised and measured here, in a thread
        (a long text does not hold up the caller's event loop, nor ever reach the engine's loop).
        add_special_tokens: off for a chat template's text (it writes its own BOS)."""
        ids = await asyncio.to_thread(self.prompts.encode, prompt, params.max_new_tokens, 0, add_special_tokens)
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

    async def lost(self, timeout_s: float = 30.0) -> bool:
        """Whether this engine is gone for good: its region owner, which is not restarted and without
        which no restarted worker can attach the KV, is dead or has not answered within timeout_s (its
        node is gone). A GPU worker that Ray is restarting does not make the engine lost."""
        try:
            return not await asyncio.wait_for(self.owner.check_health.remote(), timeout=timeout_s)
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            return True

    # ------------------------------------------------------------------ inspection
    def current_share(self) -> float | None:
        """r* for the batch running now (None when nothing runs)."""
        return ray.get(self.gpu_worker.state.remote())["cpu_share_now"]

    def state(self) -> dict:
        """The GPU worker's queue, occupancy and counters, and the policy store's r*."""
        return {**ray.get(self.gpu_worker.state.remote()), "policy_store": self.policy_state()}

    def check_integrity(self) -> None:
        ray.get(self.gpu_worker.check_integrity.remote())

    @property
    def stats(self) -> dict:
        return ray.get(self.gpu_worker.stats.remote())

    @property
    def step_history(self) -> list[StepTimes]:
        """The GPU worker's recent decode steps, as its engine timed them."""
        return ray.get(self.gpu_worker.step_history.remote())

    def policy_state(self) -> dict:
        return ray.get(self.policy_store.state.remote())

    def host_memory(self) -> dict[str, dict[str, int]]:
        """Each host KV region's size and resident bytes (RegionOwner.memory)."""
        return ray.get(self.owner.memory.remote())

    def segment_names(self) -> list[str]:
        """The memfd names of this engine's shared memory (no process maps them after shutdown)."""
        return list(self._segment_names)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self, graceful: bool = True) -> None:
        """Stops every actor of this engine and frees its engine group; its shared memory goes with
        them (memfds: nothing is left to remove, whether they stop here or are killed). graceful:
        ask the workers to close first (not for a lost engine, whose workers cannot answer)."""
        for worker in [self.gpu_worker, *self.cpu_workers] if graceful else []:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(worker.shutdown.remote(), timeout=30)
        _stop([self.gpu_worker, *self.cpu_workers, self.policy_store], self.owner)
        with contextlib.suppress(Exception):
            self.group.remove()


def _stop(actors, owner) -> None:
    for actor in actors:
        if actor is not owner:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
    with contextlib.suppress(Exception):
        ray.get(owner.close.remote(), timeout=30)
    with contextlib.suppress(Exception):
        ray.kill(owner, no_restart=True)


def _channel_spec(site: EngineSite, socket_address: str) -> ChannelSpec:
    """One CPU worker's channel, sized for the largest request of any of the engine's caches: a
    table of its blocks in a shard, or (DeepSeek-V4) of the tokens a CSA selection chooses."""
    formats = [c.format for c in site.cache_configs.values()]
    widest = max(c.compute_blocks_per_shard for c in site.cache_configs.values())
    if site.deepseek_v4:
        widest = max(widest, site.model_config.index_topk)
    return ChannelSpec(shm_name="named by the owner", owner_pid=0, fd=-1, socket_address=socket_address,
                       max_seqs=max(c.max_seqs for c in site.cache_configs.values()), max_blocks=widest,
                       num_q_heads=site.model_config.num_q_heads,
                       head_dim_qk=max(f.head_dim_k for f in formats), head_dim_v=max(f.head_dim_v for f in formats))


def _num_prompts(prompts) -> int:
    return 1 if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else len(prompts)
