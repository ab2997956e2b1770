"""The sampler against a float64 torch reference: it cannot fail on any valid setting, draws from
the temperature-scaled nucleus distribution, is greedy below SAMPLING_EPS, and fails a row whose
logits are not finite without touching the other rows."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from writescope.sampling import FAILED, SAMPLING_EPS, SamplingParams, make_generator, sample


def reference_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The nucleus distribution in float64: softmax(logits / T), the most likely tokens whose mass
    before them is below top_p (at least one), renormalised."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    before = torch.cumsum(probs[order], 0) - probs[order]
    keep = order[(before < top_p) | (torch.arange(len(order)) == 0)]
    nucleus = torch.zeros_like(probs)
    nucleus[keep] = probs[keep]
    return nucleus / nucleus.sum()


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (1.9, 0.5), (0.3, 1.0)])
def test_draws_follow_the_reference_distribution(temperature, top_p):
    logits = torch.randn(17) * 2
    expected = reference_distribution(logits, temperature, top_p)
    generators = [make_generator(seed) for seed in range(4000)]
    batch = logits.expand(len(generators), -1)
    tokens = torch.tensor(sample(batch, [temperature] * len(generators), [top_p] * len(generators), generators))
    observed = torch.bincount(tokens, minlength=17).double() / len(tokens)
    assert (observed[expected == 0] == 0).all()  # nothing outside the nucleus
    assert 0.5 * (observed - expected).abs().sum() < 0.05  # total variation over 4000 draws


@settings(max_examples=200, deadline=None)
@given(temperature=st.one_of(st.just(0.0), st.floats(min_value=1e-300, max_value=2.0)),
       top_p=st.one_of(st.just(1e-300), st.floats(min_value=1e-300, max_value=1.0, exclude_min=False)),
       scale=st.sampled_from([1e-3, 1.0, 1e4, 1e30]), seed=st.integers(0, 2**64 - 1))
def test_no_valid_setting_can_fail(temperature, top_p, scale, seed):
    logits = (torch.randn(3, 33) * scale).to(torch.bfloat16)
    params = SamplingParams(4, temperature, top_p, seed)
    generators = [make_generator(seed) for _ in range(3)]
    tokens = sample(logits, [params.temperature] * 3, [params.top_p] * 3, generators)
    assert all(0 <= t < 33 for t in tokens)
    if temperature < SAMPLING_EPS or top_p < 1e-30:  # greedy, or a nucleus of one token
        assert tokens == torch.argmax(logits.float(), dim=-1).tolist()


def test_a_row_of_bad_logits_fails_alone():
    logits = torch.randn(4, 9)
    logits[1, 3] = math.nan
    logits[2, 0] = math.inf
    greedy = torch.argmax(logits, dim=-1)
    tokens = sample(logits, [0.0, 1.0, 1.0, 0.0], [1.0] * 4, [None, make_generator(1), make_generator(2), None])
    assert tokens[1] == FAILED and tokens[2] == FAILED
    assert tokens[0] == greedy[0] and tokens[3] == greedy[3]
    all_masked = torch.full((1, 9), -math.inf)
    assert sample(all_masked, [0.0], [1.0], [None]) == [FAILED]


def test_a_request_samples_the_same_tokens_whatever_its_batch():
    logits = torch.randn(5, 40)
    alone = sample(logits[2:3], [0.8], [0.9], [make_generator(7)])
    together = sample(logits, [0.0, 1.2, 0.8, 0.5, 1.0], [1.0, 0.3, 0.9, 1.0, 0.7],
                      [None, make_generator(1), make_generator(7), make_generator(3), make_generator(4)])
    assert together[2] == alone[0]


@pytest.mark.parametrize("fields, message", [
    ({"temperature": math.nan}, "temperature must be a finite number >= 0"),
    ({"temperature": math.inf}, "temperature must be a finite number >= 0"),
    ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
    ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]"),
    ({"top_p": math.nan}, r"top_p must be a number in \(0, 1\]"),
    ({"top_p": True}, r"top_p must be a number in \(0, 1\]"),
    ({"seed": 2**80}, r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\]"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer >= 1"),
    ({"stop": [""]}, "empty string"),
    ({"stop": [-1]}, "token ids >= 0"),
    ({"stop": [1.5]}, "strings or token ids"),
])
def test_bad_settings_are_refused_with_what_is_allowed(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
