"""Prefix reuse in the engine: a second request over the same long document is admitted holding the
first one's blocks, prefills only its own question, allocates blocks only for it, and answers the
tokens an engine without reuse answers; greedy and seeded sampling alike."""

import pytest

from writescope.engine import Engine
from writescope.sampling import SamplingParams

DOCUMENT = [(31 * i) % 251 + 1 for i in range(4096)]  # 256 blocks of 16
QUESTIONS = [[300, 5, 6, 7, 8], [301, 9, 10], [302, 11, 12, 13, 14, 15, 16]]


def engine(enable_prefix_caching: bool) -> Engine:
    return Engine.from_pretrained("tiny-qwen3-moe", policy="fixed_half", max_batch_size=2, max_seq_len=4400,
                                  window_tokens=64, enable_prefix_caching=enable_prefix_caching)


@pytest.fixture(scope="module")
def without_reuse():
    plain = engine(False)
    try:
        greedy = [plain.generate(DOCUMENT + q, max_new_tokens=8)[0].token_ids for q in QUESTIONS]
        sampled = [plain.generate(DOCUMENT + q, params=[SamplingParams(8, 0.9, 0.95, seed=5)])[0].token_ids
                   for q in QUESTIONS]
        return greedy, sampled
    finally:
        plain.shutdown()


def test_later_requests_reuse_the_document_and_answer_the_same_tokens(without_reuse):
    greedy, sampled = without_reuse
    reusing = engine(True)
    try:
        prefill_s, allocated, cached, answers = [], [], [], []
        for question in QUESTIONS:
            before_s, before_cached = reusing.stats["prefill_s"], reusing.stats["cached_prompt_tokens"]
            stream = reusing.generate_stream([DOCUMENT + question], max_new_tokens=8)
            first = next(stream)
            allocated.append(reusing.cache.allocated_blocks())
            answers.append([first.token_id] + [e.token_id for e in stream if e.token_id >= 0])
            prefill_s.append(reusing.stats["prefill_s"] - before_s)
            cached.append(reusing.stats["cached_prompt_tokens"] - before_cached)
            assert first.cached_tokens == cached[-1]
        seeded = [reusing.generate(DOCUMENT + q, params=[SamplingParams(8, 0.9, 0.95, seed=5)])[0].token_ids
                  for q in QUESTIONS]
        reusing.cache.check_integrity()
    finally:
        reusing.shutdown()
    assert answers == greedy and seeded == sampled
    assert cached == [0, 4096, 4096]
    # the first request allocated the document's 256 blocks; the later ones none of their own for it
    assert allocated[0] == 256 and allocated[1] == allocated[2] == 256
    assert max(prefill_s[1:]) < prefill_s[0] / 5, prefill_s
