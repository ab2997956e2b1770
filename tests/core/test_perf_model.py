"""The roofline model, its online correction and the policies' routing."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from writescope.perf_model import OnlineEstimator, PerfModel
from writescope.policies import POLICY_NAMES, Region, make_policy

rates = st.floats(1e-9, 1e-5)
fixed = st.floats(0, 1e-3)


@settings(max_examples=200, deadline=None)
@given(a=rates, b=rates, c_cpu=fixed, c_gpu=fixed, num_tokens=st.integers(1, 2_000_000))
def test_optimal_share_is_the_argmin_of_the_step_time(a, b, c_cpu, c_gpu, num_tokens):
    model = PerfModel(a, b, c_cpu, c_gpu)
    share = model.optimal_share(num_tokens)
    assert 0 <= share <= 1
    grid = [i / 2000 for i in range(2001)]
    best = min(model.step_time_s(r, num_tokens) for r in grid)
    # r* is the exact minimiser; the grid can only do as well, to within one grid step of slope.
    slope = num_tokens * max(a, b)
    assert model.step_time_s(share, num_tokens) <= best + 1e-12 + slope / 2000


def test_optimal_share_balances_both_sides_when_inside_the_interval():
    model = PerfModel(2e-7, 1e-7, 3e-5, 1e-5)
    share = model.optimal_share(100_000)
    assert 0 < share < 1
    assert math.isclose(model.cpu_time_s(share, 100_000), model.gpu_time_s(share, 100_000), rel_tol=1e-12)


def test_share_is_clipped_and_zero_without_tokens():
    assert PerfModel(1e-7, 1e-7, 1.0, 0.0).optimal_share(10) == 0.0  # CPU fixed cost dominates
    assert PerfModel(1e-7, 1e-7, 0.0, 1.0).optimal_share(10) == 1.0  # GPU fixed cost dominates
    assert PerfModel(1e-7, 1e-7).optimal_share(0) == 0.0


@pytest.mark.parametrize("field", ["cpu_s_per_token", "transfer_s_per_token", "cpu_fixed_s", "gpu_fixed_s"])
def test_model_rejects_negative_figures(field):
    values = {"cpu_s_per_token": 1e-7, "transfer_s_per_token": 1e-7, field: -1.0}
    with pytest.raises(ValueError, match=field):
        PerfModel(**values)


def test_ewma_converges_after_a_step_change_in_cpu_rate():
    estimator = OnlineEstimator(PerfModel(1e-7, 1e-7, 1e-5, 0.0), alpha=0.3)
    true_a = 3e-7  # the CPU got 3x slower (e.g. another tenant)
    steps = 0
    while abs(estimator.model.cpu_s_per_token - true_a) > 0.05 * abs(true_a - 1e-7):
        estimator.observe_cpu(10_000, true_a * 10_000 + 1e-5)
        steps += 1
    assert steps <= 9  # (1 - 0.3)^9 < 0.05: the bound stated in OnlineEstimator's docstring
    assert estimator.model.transfer_s_per_token == 1e-7


def test_transfer_rate_changes_only_on_contention():
    estimator = OnlineEstimator(PerfModel(1e-7, 1e-7), alpha=0.5, slowdown_threshold=0.15)
    estimator.observe_transfer(1000, 1.1e-4)  # 10% slower: noise, ignored
    assert estimator.model.transfer_s_per_token == 1e-7
    for _ in range(12):
        estimator.observe_transfer(1000, 1.7e-4)  # 70% slower: expert traffic on the link
    assert math.isclose(estimator.model.transfer_s_per_token, 1.7e-7, rel_tol=0.02)
    for _ in range(12):
        estimator.observe_transfer(1000, 1.0e-4)  # contention gone
    assert math.isclose(estimator.model.transfer_s_per_token, 1.0e-7, rel_tol=0.2)


def test_placed_share_tracks_r_star_within_one_block_as_the_sequence_grows():
    model = PerfModel(2e-7, 1e-7, 2e-4, 1e-5)  # r* grows with L from 0 towards 1/3
    policy = make_policy("writescope", model)
    block, cpu_tokens, total_tokens = 16, 0, 0
    for _ in range(4000):
        region = policy.route_blocks(cpu_tokens, total_tokens, [block], total_tokens + block)[0]
        total_tokens += block
        cpu_tokens += block if region is Region.CPU_COMPUTE else 0
        target = model.optimal_share(total_tokens) * total_tokens
        assert abs(cpu_tokens - target) <= block, (total_tokens, cpu_tokens, target)


@pytest.mark.parametrize("name,share", [("all_transfer", 0.0), ("all_cpu", 1.0), ("fixed_half", 0.5)])
def test_fixed_policies_route_their_share(name, share):
    policy = make_policy(name)
    regions = policy.route_blocks(0, 0, [16] * 100, 1600)
    assert sum(r is Region.CPU_COMPUTE for r in regions) == round(share * 100)


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError, match="known: " + ", ".join(POLICY_NAMES)):
        make_policy("round_robin")
    with pytest.raises(ValueError, match="needs a PerfModel"):
        make_policy("writescope")


def test_writescope_policy_learns_from_observed_steps_and_fixed_ones_do_not():
    model = PerfModel(1e-7, 1e-7)
    policy = make_policy("writescope", model)
    before = policy.share(100_000)
    for _ in range(20):
        policy.observe_step(50_000, 50_000 * 4e-7, 50_000, 50_000 * 1e-7)  # the CPU is 4x slower than thought
    assert policy.share(100_000) < before
    assert abs(policy.model.cpu_s_per_token - 4e-7) < 0.01 * 4e-7
    fixed = make_policy("fixed_half")
    fixed.observe_step(50_000, 1.0, 50_000, 1.0)
    assert fixed.share(100_000) == 0.5
