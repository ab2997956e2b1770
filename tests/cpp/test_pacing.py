"""Pacing of the paired kernel's loops (cpp/include/writescope/pacing.h): the search that picks each
thread's delay, fed cost curves of known shape; the switch and its environment variable; and that a
paced kernel returns the unpaced kernel's results bit for bit (the delay touches no data), whatever
level each item ran at."""

import os
import random
import subprocess
import sys

import pytest
import torch

from tests.cpp.test_paired_layout import as_paired, paged
from writescope import _cpu, ops

LEVELS = 16


def settled_level(costs, items=400):
    """The level the search runs most of its last 100 items at (three in four run at the best)."""
    levels = _cpu.simulate_pacing(costs, items)[-100:]
    return max(set(levels), key=levels.count)


@pytest.mark.parametrize("optimum", [0, 3, 6, 9, 15])
def test_the_search_climbs_to_the_cheapest_level_of_a_valley(optimum):
    # like MHA from DRAM: cheaper by 4% a level up to the optimum, dearer by 6% a level past it
    costs = [1.0 - 0.04 * min(level, optimum) + 0.06 * max(0, level - optimum) for level in range(LEVELS)]
    assert settled_level(costs) == optimum


def test_a_compute_bound_shape_stays_unpaced_and_tries_level_one_in_eight_items():
    costs = [1.0 + 0.03 * level for level in range(LEVELS)]  # every delay is a loss
    levels = _cpu.simulate_pacing(costs, 800)
    assert levels.count(0) >= 0.85 * len(levels)
    assert set(levels) == {0, 1}


def test_a_flat_stretch_below_the_margin_does_not_move_the_search():
    costs = [1.0 - 0.005 * level for level in range(LEVELS)]  # 0.5% a level: under the 2% margin
    assert settled_level(costs) == 0


def test_the_search_takes_a_cheaper_level_however_far_it_is_from_the_first_guess():
    costs = [1.0] * LEVELS
    costs[1] = 0.9
    costs[2] = 0.8  # reached only through level 1
    assert settled_level(costs) == 2


def test_a_cold_first_item_in_every_call_does_not_walk_the_search_up_a_flat_curve():
    # the tile products from DRAM: every level costs about the same, and the first of a thread's 32
    # items in each call starts cold (40% dearer): it must not make every neighbour look cheaper
    costs = [1.0 + 0.003 * level for level in range(LEVELS)]
    factors = [1.4 if item % 32 == 0 else 1.0 for item in range(4000)]
    levels = _cpu.simulate_pacing(costs, 4000, factors)[-2000:]
    assert sum(levels) / len(levels) <= 2.0
    assert max(set(levels), key=levels.count) == 0


@pytest.mark.parametrize("noise", [0.05, 0.10])
@pytest.mark.parametrize("optimum", [4, 9])
def test_the_search_finds_the_valley_through_noisy_item_costs(noise, optimum):
    # like Mixtral from DRAM on a 2-vCPU Zen 4: 5% cheaper a level up to the optimum, 3% dearer past it
    costs = [1.0 - 0.05 * min(level, optimum) + 0.03 * max(0, level - optimum) for level in range(LEVELS)]
    rng = random.Random(optimum)
    factors = [1.0 + noise * rng.gauss(0.0, 1.0) for _ in range(4000)]
    levels = _cpu.simulate_pacing(costs, 4000, factors)[-2000:]
    assert abs(max(set(levels), key=levels.count) - optimum) <= 1
    assert abs(sum(levels) / len(levels) - optimum) <= 1.0


def heavy_tailed_factors(items, seed):
    """Item cost factors as measured from DRAM: 5% noise, and one item in twenty 2-10 times the rest."""
    rng = random.Random(seed)
    return [(1.0 + 0.05 * rng.gauss(0.0, 1.0)) * (rng.uniform(2.0, 10.0) if rng.random() < 0.05 else 1.0)
            for _ in range(items)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rare_items_many_times_dearer_do_not_walk_a_compute_bound_search_up(seed):
    costs = [1.0 + 0.03 * level for level in range(LEVELS)]
    levels = _cpu.simulate_pacing(costs, 4000, heavy_tailed_factors(4000, seed))[-2000:]
    assert sum(levels) / len(levels) <= 1.0


@pytest.mark.parametrize("optimum", [4, 9])
def test_the_search_finds_the_valley_through_heavy_tailed_item_costs(optimum):
    costs = [1.0 - 0.05 * min(level, optimum) + 0.03 * max(0, level - optimum) for level in range(LEVELS)]
    levels = _cpu.simulate_pacing(costs, 4000, heavy_tailed_factors(4000, optimum))[-2000:]
    assert abs(max(set(levels), key=levels.count) - optimum) <= 1


@pytest.mark.parametrize("costs, items, message", [
    ([1.0] * (LEVELS - 1), 10, "cost_per_level must hold 16 costs"),
    ([1.0] * LEVELS, -1, "items must be >= 0"),
])
def test_simulate_refuses_bad_arguments_by_name(costs, items, message):
    with pytest.raises(ValueError, match=message):
        _cpu.simulate_pacing(costs, items)


def test_simulate_refuses_item_factors_of_the_wrong_length_by_name():
    with pytest.raises(ValueError, match="item_factors must hold one factor per item \\(10\\), got 9"):
        _cpu.simulate_pacing([1.0] * LEVELS, 10, [1.0] * 9)


def test_pacing_is_on_by_default_and_switches():
    before = _cpu.pacing()
    assert before is (os.environ.get("WRITESCOPE_CPU_PACING", "auto") != "off")
    try:
        _cpu.set_pacing(False)
        assert _cpu.pacing() is False
        _cpu.set_pacing(True)
        assert _cpu.pacing() is True
    finally:
        _cpu.set_pacing(before)


@pytest.mark.parametrize("value, expected", [("off", "False"), ("auto", "True")])
def test_pacing_from_the_environment(value, expected):
    result = subprocess.run([sys.executable, "-c", "from writescope import _cpu; print(_cpu.pacing())"],
                            capture_output=True, text=True, env={**os.environ, "WRITESCOPE_CPU_PACING": value})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


@pytest.mark.parametrize("value", ["on", "1", "AUTO", "fast"])
def test_a_bad_pacing_in_the_environment_fails_the_import_by_name(value):
    result = subprocess.run([sys.executable, "-c", "import writescope._cpu"], capture_output=True, text=True,
                            env={**os.environ, "WRITESCOPE_CPU_PACING": value})
    assert result.returncode != 0
    assert f"WRITESCOPE_CPU_PACING must be 'auto' or 'off', got '{value}'" in result.stderr


@pytest.mark.parametrize("group", [1, 4, 8])
def test_paced_and_unpaced_results_are_identical(group):
    """Many calls, so the search has run items at several levels by the last ones."""
    q, source = paged([4099, 1500], 16, group=group, num_kv_heads=2)
    source = as_paired(source)
    scale = source.k_cache.shape[-1] ** -0.5
    before = _cpu.pacing()
    try:
        _cpu.set_pacing(False)
        out, lse, _ = ops.cpu_paged_attention_timed(q, source, scale)
        _cpu.set_pacing(True)
        for _ in range(40):
            paced_out, paced_lse, _ = ops.cpu_paged_attention_timed(q, source, scale)
            assert torch.equal(paced_out, out) and torch.equal(paced_lse, lse)
    finally:
        _cpu.set_pacing(before)
