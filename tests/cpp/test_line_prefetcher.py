"""The paired kernel's line prefetcher (cpp/include/writescope/line_prefetcher.h): the next tile's
lines are asked for at the pace the previous tile's steps set, spread evenly over them. Run on the
prefetcher's own code through `_cpu.simulate_prefetch`, against the even spread computed here."""

import math

import pytest

from writescope import _cpu

LINES_PER_BLOCK = 2 * 4096 // 64  # a block's K and V, 4 KB each


MIN_LINES_PER_FIRE = 4


def lines_per_fire(lines, expected_steps):
    return max(math.ceil(lines / expected_steps), MIN_LINES_PER_FIRE)


@pytest.mark.parametrize("blocks, previous_steps", [
    (4, 384),   # Qwen3-MoE's FMA loops: 256 score steps, 128 value steps
    (4, 1024),  # AVX2: two lines' steps for every line
    (4, 32),    # the tile products: sixteen lines a step
    (4, 500),
    (4, 513),
    (1, 7),
    (8, 1000),
    (64, 4097),
])
def test_the_lines_are_spread_evenly_over_the_previous_tiles_steps(blocks, previous_steps):
    lines = blocks * LINES_PER_BLOCK
    per_fire = lines_per_fire(lines, previous_steps)
    asked = _cpu.simulate_prefetch(blocks, previous_steps, previous_steps + 8)
    for step, count in enumerate(asked[:previous_steps], start=1):
        even = step * lines / previous_steps
        assert abs(count - even) <= per_fire, (step, count, even)
    assert asked[previous_steps - 1] == lines  # all asked for by the end of the steps expected
    assert asked[previous_steps:] == [lines] * 8  # and nothing after
    assert asked == sorted(asked)


def test_a_first_tile_with_no_previous_steps_asks_four_lines_every_fourth_step():
    lines = 4 * LINES_PER_BLOCK
    expected = [MIN_LINES_PER_FIRE * (step // MIN_LINES_PER_FIRE) for step in range(1, lines + 1)]
    assert _cpu.simulate_prefetch(4, 0, lines + 3) == expected + [lines] * 3


@pytest.mark.parametrize("blocks, previous_steps, steps, message", [
    (0, 10, 10, "blocks must be in \\[1, 64\\], got 0"),
    (65, 10, 10, "blocks must be in \\[1, 64\\], got 65"),
    (4, -1, 10, "previous_steps must be >= 0, got -1"),
    (4, 10, -1, "steps must be in \\[0, 1000000\\], got -1"),
])
def test_simulate_prefetch_refuses_bad_arguments_by_name(blocks, previous_steps, steps, message):
    with pytest.raises(ValueError, match=message):
        _cpu.simulate_prefetch(blocks, previous_steps, steps)
