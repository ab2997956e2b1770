"""The GPU worker: the model, the window and ping-pong buffers, the device partial and the merge
of each decode step; the CPU partials go to the CPU workers over their channels.

It is an async actor: one EngineService thread runs the engine's loop, and the requests of every
concurrent call join its running batch between decode steps (continuous batching across callers).

Authoritative state: none that outlives it. Rebuilt on (re)start: the weights (from the checkpoint
or preset), the device buffers, the attachment of the regions and channels, and the policy snapshot
(from the policy store, to which it publishes its corrected policy every few steps). Lost with the process: the
placement tables of the sequences it was decoding. A restarted worker starts with an empty batch
and free regions; the caller of a lost generation gets an error naming its requests.

`EngineService` serves requests from any thread (an actor method, an HTTP handler, a batch job's
reader); it also serves an engine in the caller's process (the batch job's `--executor local`):

    service = EngineService(engine, max_waiting=64)
    stream = service.submit("a prompt", SamplingParams(max_new_tokens=32))   # QueueFullError when full
    for event in stream: ...            # or `async for` with service.submit(..., loop=asyncio loop)
    service.close()

Admission: a request is checked (encoded, against max_seq_len) in submit(); it then waits until
the KV regions have room for it (admission reserves its blocks), so an admitted request always
finishes. When max_waiting requests already wait, submit() refuses with QueueFullError: callers
answer 429 with Retry-After rather than queue without bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque

import ray

from writescope.config import EngineConfig
from writescope.engine import UNAVAILABLE, Engine, GenerationOutput, StepTimes, StreamEvent
from writescope.sampling import SamplingParams, call_params

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ the engine's loop, serving callers
class QueueFullError(RuntimeError):
    """Too many requests wait for KV capacity; retry after retry_after_s."""

    def __init__(self, waiting: int, retry_after_s: int):
        self.waiting = waiting
        self.retry_after_s = retry_after_s
        super().__init__(f"{waiting} requests already wait for KV capacity (the limit): retry in {retry_after_s} s")

    def __reduce__(self):  # crosses process boundaries (Ray) with its fields
        return QueueFullError, (self.waiting, self.retry_after_s)


class RequestStream:
    """The events of one request, in order, ending with the one that carries finish_reason."""

    def __init__(self, request_id: int, loop: asyncio.AbstractEventLoop | None):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue | queue.SimpleQueue = asyncio.Queue() if loop else queue.SimpleQueue()
        self.done = False
        self.admitted = False  # left the waiting queue
        self._request = None

    def _put(self, event: StreamEvent) -> None:  # from the engine thread
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        else:
            self._queue.put(event)

    def __iter__(self):
        while not self.done:
            event = self._queue.get()
            self.done = event.finish_reason is not None
            yield event

    async def __aiter__(self):
        while not self.done:
            event = await self._queue.get()
            self.done = event.finish_reason is not None
            yield event

    @property
    def request(self):
        """The engine's request behind this stream (prompt, tokens, text, logits when kept)."""
        return self._request

    def cancel(self) -> None:
        """Stops the request between steps (its caller went away); it ends with finish_reason "abort"."""
        if self._request is not None:
            self._request.cancelled = True


class EngineService:
    def __init__(self, engine: Engine, max_waiting: int = 64, on_failure=None):
        """on_failure(error): called from the loop's thread after the loop failed and every caller
        got an error event (a GPU worker exits there, so Ray restarts it)."""
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_failure = on_failure
        self._incoming: deque = deque()
        self._streams: dict[int, RequestStream] = {}
        self._wake = threading.Condition()
        self._ids = itertools.count()
        self._closed = False
        self._waiting = 0  # submitted, not yet admitted
        self.counters = {"requests": 0, "finished": 0, "errors": 0, "tokens": 0}
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="writescope-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, prompt, params: SamplingParams, loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Queues one request; raises ValueError (bad prompt or too long) or QueueFullError."""
        return self.submit_many([prompt], [params], loop=loop)[0]

    def submit_many(self, prompts: list, params: list[SamplingParams], *, call_seed: int | None = None,
                    loop: asyncio.AbstractEventLoop | None = None, keep_logits: bool = False,
                    bounded: bool = True) -> list[RequestStream]:
        """Queues the prompts of one call together (all or none); their samplers are seeded as
        Engine.generate seeds them, so the tokens match a local run of the same call. bounded=False
        skips the queue limit: a generate() call brings its own batch, however large, as it does on
        the local executor."""
        if self._closed or self.failure is not None:
            raise RuntimeError(f"the engine service is stopped{f': {self.failure}' if self.failure else ''}")
        requests = [self.engine.make_request(next(self._ids), prompt, p, call_seed=call_seed, position=position)
                    for position, (prompt, p) in enumerate(zip(prompts, params, strict=True))]
        with self._wake:
            if bounded and self._waiting + len(requests) > self.max_waiting:
                raise QueueFullError(self._waiting, retry_after_s=1)
            streams = []
            for request in requests:
                request.keep_logits = keep_logits
                stream = RequestStream(request.index, loop)
                stream._request = request  # noqa: SLF001 - the stream's own request, for cancel()
                self._streams[request.index] = stream
                self._incoming.append(request)
                streams.append(stream)
            self._waiting += len(requests)
            self.counters["requests"] += len(requests)
            self._wake.notify()
        return streams

    def cancel(self, request_id: int) -> None:
        """Stops a request between steps, if it is still running or waiting."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.cancel()

    @property
    def waiting(self) -> int:
        return self._waiting

    def _poll(self, block: bool):
        with self._wake:
            while block and not self._incoming and not self._closed:
                self._wake.wait()
            if self._closed:
                return []
            new = list(self._incoming)
            self._incoming.clear()
            return new

    def _serve(self) -> None:
        try:
            for event in self.engine.run_loop(deque(), self._poll):
                self._deliver(event)
        except BaseException as error:  # noqa: BLE001 - every waiting caller learns why
            log.exception("the engine loop failed")
            self.failure = error
            for request_id in list(self._streams):  # the details stay in the log, not in what clients see
                self._deliver(StreamEvent(request_id, -1, "", "error", "the engine failed and is restarting: retry "
                                          "the request", UNAVAILABLE))
            if self.on_failure is not None:
                self.on_failure(error)

    def _deliver(self, event: StreamEvent) -> None:
        stream = self._streams.get(event.index)
        if stream is None:
            return
        with self._wake:
            if not stream.admitted and (event.token_id >= 0 or event.finish_reason is not None):
                stream.admitted = True  # its first token (prefill), or refused / aborted while waiting
                self._waiting -= 1
            if event.finish_reason is not None:
                self._streams.pop(event.index, None)
                self.counters["finished"] += 1
                self.counters["errors"] += event.finish_reason == "error"
            self.counters["tokens"] += event.token_id >= 0
        stream._put(event)  # noqa: SLF001

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout=60)


# ------------------------------------------------------------------ the actor
@ray.remote(max_restarts=-1, max_task_retries=0)
class GPUWorker:
    def __init__(self, config: EngineConfig, cache_config, region_handles, channel_specs, policy_store,
                 max_waiting: int = 64):
        """config: the driver's, its num_shards one per CPU worker (channel_specs); its policy a name.
        cache_config: the regions as the driver sized them (the region owner's); region_handles their
        handles. For DeepSeek-V4 both are dicts by layer type (one entry cache each)."""
        from writescope.actors.cpu_worker import ChannelExecutor
        from writescope.actors.policy_store import RemotePolicy
        from writescope.engine import PROVISIONAL_MODEL
        from writescope.topology import share_cores

        share_cores()  # its dense products run on the cores the CPU workers' kernels use

        learns = config.policy == "writescope"
        snapshot = ray.get(policy_store.configure.remote(config.policy, PROVISIONAL_MODEL if learns else None))
        self.engine = Engine.from_config(config.replace(policy=RemotePolicy(policy_store, snapshot)),
                                         executor=ChannelExecutor(channel_specs), region_handles=region_handles,
                                         cache_config=cache_config)
        if learns:  # timed here, through the CPU workers' channels: the CPU partial as this engine pays it
            model_fit = self.engine.calibrate()
            self.engine.policy.reset(ray.get(policy_store.calibrated.remote(model_fit)))
        if config.device == "cpu":
            # Ray sets OMP_NUM_THREADS=1 for an actor of num_cpus=0. With no GPU the prefill's matmuls
            # run here on the CPU: on every CPU, while decode keeps one torch thread (more would
            # fight the CPU workers' kernel pools for the same cores).
            self.engine.prefill_threads = len(os.sched_getaffinity(0))
        self.service = EngineService(self.engine, max_waiting=max_waiting, on_failure=self._exit_for_restart)
        self._pending: dict[int, tuple[object, float]] = {}  # submitted, stream not yet asked for: (stream, when)

    # Every call goes through one EngineService: requests of concurrent callers share the running
    # batch (continuous batching), and each call's events come back as they are made.
    async def generate(self, prompts, kwargs: dict):
        streams = self._submit_call(prompts, kwargs)
        outputs = []
        try:
            for stream in streams:
                async for event in stream:
                    if event.finish_reason == "error" and event.retryable:
                        raise RuntimeError(event.error)  # the engine failed: the whole call is lost
                request = stream.request
                outputs.append(GenerationOutput(request.tokens, request.text, request.finish_reason,
                                                len(request.prompt),
                                                request.logits if kwargs.get("return_logits") else None,
                                                request.error))
        finally:  # an error or a cancelled call stops the call's other requests too
            for stream in streams:
                if not stream.done:
                    stream.cancel()
        return outputs

    @ray.method(num_returns="streaming")
    async def generate_stream(self, prompts, kwargs: dict):
        """The call's events as they come, indexed by prompt position (as Engine.generate_stream), in
        lists: every event ready when one is yielded goes with it (a decode step's tokens travel as one
        Ray object, not one each)."""
        streams = self._submit_call(prompts, kwargs)
        position = {stream.request_id: i for i, stream in enumerate(streams)}
        merged: asyncio.Queue = asyncio.Queue()

        async def forward(stream):
            async for event in stream:
                await merged.put(event)

        tasks = [asyncio.create_task(forward(stream)) for stream in streams]
        try:
            remaining = len(streams)
            while remaining:
                events = [await merged.get()]
                while not merged.empty():
                    events.append(merged.get_nowait())
                remaining -= sum(event.finish_reason is not None for event in events)
                yield [dataclasses.replace(event, index=position[event.index]) for event in events]
        finally:
            for task, stream in zip(tasks, streams, strict=True):
                task.cancel()
                stream.cancel()

    async def submit(self, prompt, params) -> dict:
        """Queues one request (servers, batch jobs): {id, prompt_tokens}, or QueueFullError /
        ValueError at once."""
        self._cancel_unclaimed()
        stream = self.service.submit(prompt, params, loop=asyncio.get_running_loop())
        self._pending[stream.request_id] = (stream, time.monotonic())
        return {"id": stream.request_id, "prompt_tokens": len(stream.request.prompt)}

    async def cancel(self, request_id: int) -> None:
        """Stops a submitted request (its caller went away)."""
        self._pending.pop(request_id, None)
        self.service.cancel(request_id)

    def _cancel_unclaimed(self, after_s: float = 60.0) -> None:
        """Requests submitted but never streamed (their caller vanished in between) are cancelled."""
        now = time.monotonic()
        for request_id, (stream, when) in list(self._pending.items()):
            if now - when > after_s:
                del self._pending[request_id]
                stream.cancel()

    @ray.method(num_returns="streaming")
    async def stream(self, request_id: int):
        """The events of a submitted request; a caller that stops listening cancels it."""
        if request_id not in self._pending:
            raise ValueError(f"no submitted request {request_id} waits to be streamed")
        stream, _ = self._pending.pop(request_id)
        try:
            async for event in stream:
                yield event
        finally:
            if not stream.done:
                stream.cancel()

    def _submit_call(self, prompts, kwargs: dict):
        kwargs = dict(kwargs)
        params = kwargs.pop("params", None)
        keep_logits = kwargs.pop("return_logits", False)
        defaults = SamplingParams(kwargs.pop("max_new_tokens", 32), kwargs.pop("temperature", 0.0),
                                  kwargs.pop("top_p", 1.0), kwargs.pop("seed", None), kwargs.pop("stop", None) or ())
        if kwargs:
            raise ValueError(f"unknown generate arguments: {sorted(kwargs)}")
        prompts, per_prompt = call_params(prompts, defaults, params)
        return self.service.submit_many(prompts, per_prompt, call_seed=defaults.seed, bounded=False,
                                        loop=asyncio.get_running_loop(), keep_logits=keep_logits)

    @staticmethod
    def _exit_for_restart(error: BaseException) -> None:
        """The engine loop failed (a CPU worker that never came back, a device error): the callers
        got their error events; the process then exits so Ray restarts a clean worker."""
        log.error("engine loop failed (%s): exiting in 2 s so Ray restarts this GPU worker", error)
        threading.Timer(2.0, os._exit, args=(1,)).start()

    async def state(self) -> dict:
        """Occupancy, queue and counters, for metrics and progress."""
        return {"waiting": self.service.waiting, "running_seqs": len(self.engine.cache.seqs), **self.service.counters,
                "steps": self.engine.stats["steps"], "decode_s": self.engine.stats["decode_s"],
                **self.engine.cache_state()}

    async def check_integrity(self) -> None:
        self.engine.cache.check_integrity()

    async def stats(self) -> dict:
        return dict(self.engine.stats)

    async def step_history(self) -> list[StepTimes]:
        """The recent decode steps, as the engine timed them."""
        return list(self.engine.step_history)

    async def shutdown(self) -> None:
        self.service.close()
        self.engine.shutdown()

    async def pid(self) -> int:
        return os.getpid()

    async def pool_spin(self) -> int:
        """Microseconds this process's kernel pool polls between jobs (for checks from outside)."""
        from writescope import _cpu

        return _cpu.pool_spin()

    async def check_health(self) -> bool:
        if self.service.failure is not None:
            raise RuntimeError(f"the engine loop failed: {self.service.failure}")
        return True
