"""Continuous batching across callers: one thread runs the engine's loop, and requests from any
thread (an HTTP handler, an actor method) join the running batch between decode steps.

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
import itertools
import logging
import queue
import threading
from collections import deque

from writescope.engine import UNAVAILABLE, Engine, SamplingParams, StreamEvent

log = logging.getLogger(__name__)


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
