"""The roofline model, its online correction and the policies' routing."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from writescope.perf_model import MIN_BALANCE_GAIN, TIE_TOLERANCE, OnlineEstimator, PerfModel
from writescope.policies import POLICY_NAMES, Region, make_policy

rates = st.floats(1e-9, 1e-5)
fixed = st.floats(0, 1e-3)


@settings(max_examples=200, deadline=None)
@given(a=rates, b=rates, c_cpu=fixed, c_gpu=fixed, num_tokens=st.integers(1, 2_000_000),
       overlap=st.one_of(st.just(0.0), st.just(1.0), st.floats(0, 1)))
def test_optimal_share_is_the_argmin_of_the_step_time(a, b, c_cpu, c_gpu, num_tokens, overlap):
    model = PerfModel(a, b, c_cpu, c_gpu, overlap)
    share = model.optimal_share(num_tokens)
    assert 0 <= share <= 1
    grid = [i / 2000 for i in range(2001)]
    best = min(model.step_time_s(r, num_tokens) for r in grid)
    # r* is the exact minimiser; the grid can only do as well, to within one grid step of slope.
    slope = num_tokens * max(a, b)
    # Apart from a shared host's deliberate preferences: the CPU end within TIE_TOLERANCE of the other
    # end, an end within MIN_BALANCE_GAIN of the balance point.
    tie = (TIE_TOLERANCE + MIN_BALANCE_GAIN) * best * 1.2 if model.shares_host else 0
    assert model.step_time_s(share, num_tokens) <= best + 1e-12 + slope / 2000 + tie


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


@pytest.mark.parametrize("side", ["cpu", "transfer"])
@pytest.mark.parametrize("factor", [3.0, 0.5])
def test_estimator_follows_a_step_change_in_either_rate_within_ten_steps(side, factor):
    """A contention change (another tenant on the CPU's memory, or on the link) at a steady length."""
    calibrated = PerfModel(1e-7, 2e-7, 1e-5, 2e-5)
    estimator = OnlineEstimator(calibrated, alpha=0.3)
    field = "cpu_s_per_token" if side == "cpu" else "transfer_s_per_token"
    fixed_s = 1e-5 if side == "cpu" else 2e-5
    true_rate = getattr(calibrated, field) * factor
    observe = estimator.observe_cpu if side == "cpu" else estimator.observe_transfer
    steps = 0
    while abs(getattr(estimator.model, field) - true_rate) > 0.05 * true_rate:
        observe(10_000, true_rate * 10_000 + fixed_s)
        steps += 1
        assert steps <= 10, estimator.model
    other = "transfer_s_per_token" if side == "cpu" else "cpu_s_per_token"
    assert getattr(estimator.model, other) == getattr(calibrated, other)  # the other side saw nothing


def test_estimator_refits_rate_and_fixed_cost_from_varying_lengths():
    estimator = OnlineEstimator(PerfModel(1e-7, 1e-7, 0.0, 0.0), alpha=0.3)
    for step in range(40):
        tokens = (4_000, 16_000, 64_000)[step % 3]
        estimator.observe_transfer(tokens, 3e-7 * tokens + 2e-4)
    assert math.isclose(estimator.model.transfer_s_per_token, 3e-7, rel_tol=0.02)
    assert 0 < estimator.model.gpu_fixed_s <= 2e-4  # moved towards the truth from the calibrated 0


def test_estimator_averages_a_steps_layers_into_one_pair():
    """Forgetting counts steps: 48 layers of one step weigh as much as 2 layers of another."""
    per_layer = OnlineEstimator(PerfModel(1e-7, 1e-7), alpha=0.3)
    for _ in range(48):
        per_layer.observe_layer(10_000, 2e-3, 10_000, 1e-3)
    per_layer.end_step()
    one_layer = OnlineEstimator(PerfModel(1e-7, 1e-7), alpha=0.3)
    one_layer.observe_layer(10_000, 2e-3, 10_000, 1e-3)
    one_layer.end_step()
    for field in ("cpu_s_per_token", "transfer_s_per_token", "cpu_fixed_s", "gpu_fixed_s"):
        assert math.isclose(getattr(per_layer.model, field), getattr(one_layer.model, field), rel_tol=1e-9,
                            abs_tol=1e-15)
    assert per_layer.model.cpu_s_per_token > 1e-7


def test_estimator_ignores_empty_and_invalid_samples():
    estimator = OnlineEstimator(PerfModel(1e-7, 1e-7, 1e-5, 1e-5), alpha=0.3)
    estimator.observe_layer(0, 0.0, 0, 0.0)  # a layer with nothing outside the window
    estimator.observe_cpu(1000, math.nan)
    estimator.observe_transfer(1000, -1.0)
    estimator.end_step()
    assert estimator.model == PerfModel(1e-7, 1e-7, 1e-5, 1e-5)


def test_when_the_sides_share_the_cores_the_layer_costs_their_sum_and_r_star_is_a_side():
    shared = PerfModel(1e-7, 1.5e-7, 1e-5, 2e-5, overlap=0.0)
    layer_s = shared.cpu_time_s(0.3, 10_000) + shared.gpu_time_s(0.3, 10_000)
    assert math.isclose(shared.step_time_s(0.3, 10_000), layer_s)
    assert shared.optimal_share(10_000) == 1.0  # the CPU partial is cheaper per token
    assert PerfModel(2e-7, 1e-7, overlap=0.0).optimal_share(10_000) == 0.0
    # within TIE_TOLERANCE the CPU side wins: a difference that small is noise, and r = 1 needs no copies
    assert PerfModel(1.1e-7, 1e-7, overlap=0.0).optimal_share(10_000) == 1.0
    assert PerfModel(1e-7, 1e-7).optimal_share(10_000) == 0.5  # overlapped: balanced


@settings(max_examples=300, deadline=None)
@given(a=rates, b=rates, c_cpu=fixed, c_gpu=fixed, num_tokens=st.integers(1, 2_000_000),
       load=st.floats(0.2, 20))
def test_on_a_shared_host_a_load_on_both_rates_does_not_move_the_end(a, b, c_cpu, c_gpu, num_tokens, load):
    """With no overlap the end is the cheaper side per token, within TIE_TOLERANCE, whatever the fixed
    costs: contention that scales both rates alike (the estimator's cross-scaling) keeps it. A
    tolerance on the whole layer would not: fixed costs as large as the work hid A = 1.3 B from it,
    until a load doubled the work."""
    calm = PerfModel(a, b, c_cpu, c_gpu, overlap=0.0)
    loaded = PerfModel(a * load, b * load, c_cpu, c_gpu, overlap=0.0)
    expected = "cpu" if a <= b * (1 + TIE_TOLERANCE) else "device"
    assert calm.choice(num_tokens) == loaded.choice(num_tokens) == expected


def test_a_partial_overlap_balances_the_sides_when_hiding_pays():
    """With A = B the kink at r = 0.5 costs 1 - overlap / 2 of an end: 0.8 at overlap 0.4, 0.935 at
    0.13 (the balance, r* = 0.5); at 0.04 (noise) it saves 2%, under MIN_BALANCE_GAIN: r* = 1."""
    assert PerfModel(1e-7, 1e-7, overlap=0.4).optimal_share(100_000) == pytest.approx(0.5)
    assert PerfModel(1e-7, 1e-7, overlap=0.13).optimal_share(100_000) == pytest.approx(0.5)
    assert PerfModel(1e-7, 1e-7, overlap=0.04).optimal_share(100_000) == 1.0
    partial = PerfModel(1e-7, 1e-7, overlap=0.4)
    assert partial.step_time_s(0.5, 100_000) == pytest.approx(0.8 * partial.step_time_s(1.0, 100_000))


@pytest.mark.parametrize("values,message", [({"overlap": 1.5}, "overlap must be in"),
                                            ({"cpu_dispatch_s": 1.0}, "is part of cpu_fixed_s")])
def test_model_rejects_bad_overlap_and_dispatch(values, message):
    with pytest.raises(ValueError, match=message):
        PerfModel(1e-7, 1e-7, **values)


def test_the_cpu_dispatch_stays_in_the_model_while_observations_leave_it_out():
    """A channel's round trip is in the calibrated C_cpu, not in the kernel seconds the steps report."""
    estimator = OnlineEstimator(PerfModel(1e-7, 1e-7, cpu_fixed_s=3e-5, cpu_dispatch_s=2e-5), alpha=0.3)
    for _ in range(20):
        estimator.observe_cpu(10_000, 1e-7 * 10_000 + 1e-5)  # the kernel alone: its own fixed cost 1e-5
    assert estimator.model.cpu_fixed_s == pytest.approx(3e-5, rel=1e-6)
    assert estimator.model.cpu_s_per_token == pytest.approx(1e-7, rel=1e-6)


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
        policy.end_step()
    assert policy.share(100_000) < before
    assert abs(policy.model.cpu_s_per_token - 4e-7) < 0.01 * 4e-7
    fixed = make_policy("fixed_half")
    fixed.observe_step(50_000, 1.0, 50_000, 1.0)
    fixed.end_step()
    assert fixed.share(100_000) == 0.5


@pytest.mark.parametrize("name,share", [("share:0", 0.0), ("share:0.3", 0.3), ("share:1", 1.0)])
def test_share_policies_route_any_fixed_share(name, share):
    regions = make_policy(name).route_blocks(0, 0, [16] * 100, 1600)
    assert sum(r is Region.CPU_COMPUTE for r in regions) == round(share * 100)


@pytest.mark.parametrize("name", ["share:", "share:1.5", "share:-0.1", "share:nan", "share:abc", "shares:0.5"])
def test_bad_share_policies_say_what_is_allowed(name):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        make_policy(name)


def test_on_a_shared_host_a_slowdown_seen_on_one_side_moves_both_and_r_star_stays():
    """The device is the CPU: a memory-bandwidth hog slows the CPU partial (all the KV is there,
    r* = 1). A follows within ten steps; B, which no step measures, moves by the same factor, so
    r* stays 1 rather than sending new blocks to a device path the hog slows just as much."""
    calibrated = PerfModel(1e-7, 1.05e-7, 1e-5, 2e-5, overlap=0.0)
    policy = make_policy("writescope", calibrated)
    assert policy.share(100_000) == 1.0
    for step in range(1, 11):
        for _ in range(4):  # layers
            policy.observe_step(100_000, 2e-7 * 100_000 + 1e-5, 0, 0.0)
        policy.end_step()
        assert policy.share(100_000) == 1.0, step
    assert math.isclose(policy.model.cpu_s_per_token, 2e-7, rel_tol=0.05)
    assert math.isclose(policy.model.transfer_s_per_token / policy.model.cpu_s_per_token, 1.05, rel_tol=1e-6)


def test_where_the_sides_overlap_an_unseen_side_keeps_its_rate():
    policy = make_policy("writescope", PerfModel(1e-7, 1e-7, 0.0, 0.0, overlap=1.0))
    for _ in range(10):
        policy.observe_step(100_000, 2e-7 * 100_000, 0, 0.0)  # a GPU's copy engine is not the CPU's memory
        policy.end_step()
    assert policy.model.transfer_s_per_token == 1e-7
    assert policy.share(100_000) == pytest.approx(1 / 3, rel=0.05)  # balanced against the slower CPU


def test_on_a_shared_host_noise_does_not_flip_r_star_but_a_real_change_does():
    """A partly shared host: overlap 0.13, the balance ~6% cheaper than the CPU end.
    Estimates that wander by a few percent leave the choice where it is; a CPU made 2x slower
    (the balance then costs far more than the device end) moves it."""
    policy = make_policy("writescope", PerfModel(1e-7, 1e-7, 1e-5, 1e-5, overlap=0.13))
    first = policy.share(100_000)
    assert first == pytest.approx(0.5, abs=0.01)
    for step in range(30):  # +-4% on the CPU side, alternating
        policy.observe_step(50_000, (1.04 if step % 2 else 0.96) * (1e-7 * 50_000 + 1e-5), 50_000,
                            1e-7 * 50_000 + 1e-5)
        policy.end_step()
        assert policy.share(100_000) == pytest.approx(first, abs=0.05), step
    for _ in range(10):
        policy.observe_step(50_000, 2 * (1e-7 * 50_000) + 1e-5, 50_000, 1e-7 * 50_000 + 1e-5)
        policy.end_step()
    assert policy.share(100_000) < 0.4


def test_previewing_the_share_does_not_steer_the_next_choice():
    """Reports (the GPU worker's state, placement) ask the policy for its share; on a shared host
    share() keeps its last choice unless a new one saves SWITCH_GAIN, so a report that called it
    would change where the next blocks go. preview_share answers the same without choosing."""
    model = PerfModel(9.8e-8, 7.9e-8, 9.0e-5, 2.3e-4, overlap=0.1)  # device end at 16K, CPU end at 1K
    assert model.shares_host and model.choice(16_000) == "device" and model.choice(1_000) == "cpu"
    steered = make_policy("writescope", model)
    steered.share(16_000)
    kept = steered.share(1_000)  # the device end kept: the CPU end does not save enough at 1K
    assert kept == model.candidate_shares(1_000)["device"] != model.candidate_shares(1_000)["cpu"]

    previewed = make_policy("writescope", model)
    assert previewed.preview_share(16_000) == model.candidate_shares(16_000)["device"]
    assert previewed.share(1_000) == model.candidate_shares(1_000)["cpu"]  # as if never asked
    assert previewed.preview_share(16_000) == previewed.share(16_000)  # a preview says what share() takes
    assert previewed.preview_share(0) == previewed.share(0) == 0.0
