"""EngineService: requests from many threads share one running batch and each gets the tokens it
would get alone; a full queue refuses at once; a cancelled request ends with "abort"; async
callers get their events through their own loop."""

import asyncio
import threading
import time

import pytest

from writescope.actors.gpu_worker import EngineService, QueueFullError
from writescope.engine import Engine, SamplingParams

PROMPTS = [[5, 6, 7] * 20, list(range(1, 90)), [9] * 40, list(range(100, 30, -1))]
OPTIONS = {"window_tokens": 8, "block_size": 4, "max_seq_len": 128}


@pytest.fixture(scope="module")
def alone():
    engine = Engine.from_pretrained("tiny-mixtral", policy="fixed_half", max_batch_size=1, **OPTIONS)
    try:
        return [engine.generate(p, max_new_tokens=8)[0].token_ids for p in PROMPTS]
    finally:
        engine.shutdown()


@pytest.fixture
def service():
    engine = Engine.from_pretrained("tiny-mixtral", policy="fixed_half", max_batch_size=2, **OPTIONS)
    service = EngineService(engine, max_waiting=8)
    yield service
    service.close()
    engine.shutdown()


def test_concurrent_callers_get_the_tokens_they_get_alone(service, alone):
    results = {}

    def caller(index):
        results[index] = [e.token_id for e in service.submit(PROMPTS[index], SamplingParams(max_new_tokens=8))]

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [results[i] for i in range(len(PROMPTS))] == alone
    assert service.counters["finished"] == len(PROMPTS) and service.waiting == 0
    # a caller has its last event before the engine's thread frees the sequence: wait for that
    deadline = time.monotonic() + 10
    while service.engine.cache.seqs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not service.engine.cache.seqs
    service.engine.cache.check_integrity()  # read while the engine's thread is idle


def test_a_full_queue_refuses_at_once_and_the_admitted_finish(service):
    service.max_waiting = 2
    streams, refused = [], 0
    for prompt in PROMPTS * 2:  # batch of 2 decoding 16 tokens: at most 2 leave the queue meanwhile
        try:
            streams.append(service.submit(prompt, SamplingParams(max_new_tokens=16)))
        except QueueFullError as error:
            refused += 1
            assert error.retry_after_s >= 1 and "wait for KV capacity" in str(error)
    assert refused >= 1
    for stream in streams:
        events = list(stream)
        assert events[-1].finish_reason == "length" and len(events) == 16


def test_a_whole_call_may_exceed_the_queue_limit_when_unbounded(service):
    service.max_waiting = 2
    streams = service.submit_many(PROMPTS * 2, [SamplingParams(max_new_tokens=3)] * 8, bounded=False)
    assert [len(list(stream)) for stream in streams] == [3] * 8
    with pytest.raises(QueueFullError):
        service.submit_many(PROMPTS, [SamplingParams(max_new_tokens=3)] * 4)


def test_bad_requests_are_refused_before_queueing(service):
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        service.submit(list(range(1, 120)), SamplingParams(max_new_tokens=16))
    with pytest.raises(ValueError, match="outside"):
        service.submit([10**9], SamplingParams())
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="empty string"):
        SamplingParams(stop=["", "x"])
    assert service.waiting == 0


def test_a_cancelled_request_ends_with_abort_and_frees_its_blocks(service):
    max_new_tokens = 100 - len(PROMPTS[1]) + 28
    stream = service.submit(PROMPTS[1], SamplingParams(max_new_tokens=max_new_tokens))
    events = []
    for event in stream:
        events.append(event)
        if len(events) == 3:
            stream.cancel()
    # ended by the cancel, before its length: how many steps the engine thread made meanwhile is the
    # host's scheduling (about 3 ms a step here), not asserted
    assert events[-1].finish_reason == "abort" and len(events) < max_new_tokens
    service.submit(PROMPTS[0], SamplingParams(max_new_tokens=2)).__iter__().__next__()  # the loop moved on
    assert stream.request.seq_id not in service.engine.cache.seqs


def test_async_callers_share_the_batch(service, alone):
    async def main():
        loop = asyncio.get_running_loop()

        async def one(index):
            stream = service.submit(PROMPTS[index], SamplingParams(max_new_tokens=8), loop=loop)
            return [event.token_id async for event in stream]

        return await asyncio.gather(*[one(i) for i in range(len(PROMPTS))])

    assert asyncio.run(main()) == alone


def test_sampling_with_a_request_seed_does_not_depend_on_the_batch(service):
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=1234)
    alone = [e.token_id for e in service.submit(PROMPTS[0], params)]
    together = [service.submit(p, params if i == 0 else SamplingParams(max_new_tokens=8, temperature=1.0))
                for i, p in enumerate(PROMPTS[:2])]
    assert [e.token_id for e in together[0]] == alone
    list(together[1])
