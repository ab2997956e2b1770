"""The sampler against a float64 torch reference: it cannot fail on any valid setting, draws from
the temperature-scaled distribution restricted by min_p, top_k and top_p, is greedy below
SAMPLING_EPS, applies vLLM's penalties, gives the model's log-probabilities, and fails a row whose
logits are not finite without touching the other rows."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from writescope.sampling import FAILED, SAMPLING_EPS, SamplerRow, SamplingParams, make_generator, sample


def rows(temperatures, top_ps, generators, vocab=64, **fields) -> list[SamplerRow]:
    return [SamplerRow(SamplingParams(4, t, p, **fields), g, [], vocab)
            for t, p, g in zip(temperatures, top_ps, generators, strict=True)]


def draw(logits, temperatures, top_ps, generators, **fields) -> list[int]:
    return sample(logits, rows(temperatures, top_ps, generators, logits.shape[-1], **fields)).tokens


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
    tokens = torch.tensor(draw(batch, [temperature] * len(generators), [top_p] * len(generators), generators))
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
    tokens = draw(logits, [params.temperature] * 3, [params.top_p] * 3, generators)
    assert all(0 <= t < 33 for t in tokens)
    if temperature < SAMPLING_EPS or top_p < 1e-30:  # greedy, or a nucleus of one token
        assert tokens == torch.argmax(logits.float(), dim=-1).tolist()


def test_a_row_of_bad_logits_fails_alone():
    logits = torch.randn(4, 9)
    logits[1, 3] = math.nan
    logits[2, 0] = math.inf
    greedy = torch.argmax(logits, dim=-1)
    tokens = draw(logits, [0.0, 1.0, 1.0, 0.0], [1.0] * 4, [None, make_generator(1), make_generator(2), None])
    assert tokens[1] == FAILED and tokens[2] == FAILED
    assert tokens[0] == greedy[0] and tokens[3] == greedy[3]
    all_masked = torch.full((1, 9), -math.inf)
    assert draw(all_masked, [0.0], [1.0], [None]) == [FAILED]


def test_greedy_takes_torchs_argmax_and_fails_only_rows_without_a_finite_max():
    """At a real model's vocabulary: ties go to the first index, as torch.argmax; a row that is
    partly -inf (masked) still decodes; NaN, +inf or a row masked whole fails."""
    vocab = 151936
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, [7, 90000, 151935]] = 9.0  # a three-way tie
    logits[1, : vocab // 2] = -math.inf  # masked in part
    logits[1, vocab - 1] = 8.0
    logits[2, 100] = math.nan
    logits[3, 5] = math.inf
    logits[4] = -math.inf
    logits[5] = -1.0
    logits[5, 3], logits[5, 10] = -0.0, 0.0  # equal: the first wins
    tokens = draw(logits, [0.0] * 6, [1.0] * 6, [None] * 6)
    expected = torch.argmax(logits, dim=-1).tolist()
    assert tokens[0] == expected[0] == 7
    assert tokens[1] == expected[1] == vocab - 1
    assert tokens[2:5] == [FAILED] * 3
    assert tokens[5] == expected[5] == 3


def test_a_request_samples_the_same_tokens_whatever_its_batch():
    logits = torch.randn(5, 40)
    alone = draw(logits[2:3], [0.8], [0.9], [make_generator(7)])
    together = draw(logits, [0.0, 1.2, 0.8, 0.5, 1.0], [1.0, 0.3, 0.9, 1.0, 0.7],
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
    ({"top_k": -2}, "top_k must be an integer >= 1, or 0 or -1"),
    ({"min_p": 1.5}, r"min_p must be a number in \[0, 1\]"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
    ({"frequency_penalty": math.nan}, r"frequency_penalty must be a number in \[-2, 2\]"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be a number in \(0, 100"),
    ({"ignore_eos": 1}, "ignore_eos must be true or false"),
    ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\]"),
])
def test_bad_settings_are_refused_with_what_is_allowed(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def restricted_reference(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                         min_p: float) -> torch.Tensor:
    """vLLM's order in float64: softmax(logits / T); keep tokens >= min_p x the most likely; the top_k
    most likely; renormalise; the top_p nucleus of that; renormalise."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True)
    ranked = probs[order]
    keep = ranked >= min_p * ranked[0]
    if top_k > 0:
        keep &= torch.arange(len(ranked)) < top_k
    kept = torch.where(keep, ranked, torch.zeros_like(ranked))
    kept = kept / kept.sum()
    keep &= (torch.cumsum(kept, 0) - kept) < top_p
    keep[0] = True
    result = torch.zeros_like(probs)
    result[order[keep]] = probs[order[keep]]
    return result / result.sum()


@pytest.mark.parametrize("temperature, top_p, top_k, min_p", [
    (1.0, 1.0, 5, 0.0), (0.8, 1.0, 0, 0.2), (1.3, 0.7, 6, 0.05), (1.0, 1.0, 1, 0.0), (1.0, 1.0, -1, 0.0)])
def test_top_k_and_min_p_draw_from_the_reference_distribution(temperature, top_p, top_k, min_p):
    torch.manual_seed(3)
    logits = torch.randn(17) * 2
    expected = restricted_reference(logits, temperature, top_p, top_k, min_p)
    generators = [make_generator(seed) for seed in range(4000)]
    tokens = torch.tensor(draw(logits.expand(len(generators), -1), [temperature] * 4000, [top_p] * 4000, generators,
                               top_k=top_k, min_p=min_p))
    observed = torch.bincount(tokens, minlength=17).double() / len(tokens)
    assert (observed[expected == 0] == 0).all()
    assert 0.5 * (observed - expected).abs().sum() < 0.05


def penalised_reference(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float,
                        frequency: float, repetition: float) -> torch.Tensor:
    """vLLM's penalties written out token by token."""
    result = logits.clone().double()
    for token in range(len(result)):
        count = output.count(token)
        if token in prompt or count:
            result[token] = result[token] / repetition if result[token] > 0 else result[token] * repetition
        result[token] -= frequency * count + presence * (count > 0)
    return result


@pytest.mark.parametrize("presence, frequency, repetition", [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.8),
                                                             (-1.0, 0.3, 0.6), (1.2, 1.5, 1.3)])
def test_penalties_match_the_reference(presence, frequency, repetition):
    torch.manual_seed(5)
    logits = torch.randn(2, 31) * 3
    prompt, output = [1, 4, 4, 9, 30], [4, 7, 7, 7, 12]
    params = SamplingParams(8, 0.0, presence_penalty=presence, frequency_penalty=frequency,
                            repetition_penalty=repetition)
    penalised = SamplerRow(params, None, prompt, 31)
    for token in output:
        penalised.observe(token)
    plain = SamplerRow(SamplingParams(8, 0.0), None, prompt, 31)
    result = sample(logits, [penalised, plain])
    expected = penalised_reference(logits[0], prompt, output, presence, frequency, repetition)
    assert result.tokens == [int(torch.argmax(expected)), int(torch.argmax(logits[1]))]


def test_a_penalty_changes_a_greedy_choice():
    logits = torch.tensor([[0.0, 2.0, 1.9, -1.0]])
    row = SamplerRow(SamplingParams(8, 0.0, frequency_penalty=0.5), None, [], 4)
    assert sample(logits, [row]).tokens == [1]
    row.observe(1)
    assert sample(logits, [row]).tokens == [2]  # 2.0 - 0.5 < 1.9


def test_logprobs_are_the_models_log_softmax_whatever_the_settings():
    torch.manual_seed(11)
    logits = torch.randn(3, 50) * 4
    settings = [SamplingParams(4, 0.0, logprobs=5), SamplingParams(4, 0.7, top_k=3, presence_penalty=1.0, logprobs=0),
                SamplingParams(4, 1.0)]
    generators = [None, make_generator(2), make_generator(3)]
    result = sample(logits, [SamplerRow(p, g, [], 50) for p, g in zip(settings, generators, strict=True)])
    reference = torch.log_softmax(logits.double(), dim=-1)
    first, second, third = result.logprobs
    assert third is None
    assert first.logprob == pytest.approx(float(reference[0].max()), abs=1e-5)
    top = torch.topk(reference[0], 5)
    assert [i for i, _ in first.top] == top.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert second.top == ()
    assert second.logprob == pytest.approx(float(reference[1, result.tokens[1]]), abs=1e-5)
