"""tools/bench_executors.py: both executors' decode steps, taking turns on a real local Ray, and
what the tool derives from /proc/stat and from the engines' own step times."""

import json

import pytest

from writescope.tools import bench_executors

ROUNDS, NEW_TOKENS = 2, 8


def test_both_executors_report_their_steps_split_into_attention_kernel_and_rest(ray_cluster, tmp_path):
    out = tmp_path / "executors.json"
    assert bench_executors.main(["--context", "1024", "--batch", "2", "--new-tokens", str(NEW_TOKENS),
                                 "--rounds", str(ROUNDS), "--max-steal", "1", "--dtype", "float32",
                                 "--out", str(out)]) == 0
    rows = {row["executor"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"local", "ray"}
    for row in rows.values():
        # the first token comes from the prefill; each round's first decode steps are warm-up
        assert row["steps"] == ROUNDS * (NEW_TOKENS - 1 - bench_executors.WARMUP_STEPS)
        assert row["rounds_left_out"] == 0
        assert 0 < row["cpu_kernel_ms"] < row["attention_ms"] < row["step_ms"]  # the kernel runs inside the span
        assert row["rest_ms"] > 0 and 0 < row["kernel_share"] < 1
    assert rows["local"]["step_over_local"] == 1.0
    assert rows["ray"]["step_over_local"] == pytest.approx(rows["ray"]["step_ms"] / rows["local"]["step_ms"])


def test_steal_is_the_share_of_the_cpus_time_the_hypervisor_took():
    before = [100, 0, 50, 800, 0, 0, 0, 50, 0, 0]
    after = [300, 0, 100, 1200, 0, 0, 0, 250, 0, 0]  # 850 ticks in all, 200 of them stolen
    assert bench_executors.steal_share(before, after) == pytest.approx(200 / 850)
    readings = bench_executors.cpu_times()
    assert len(readings) >= 8 and bench_executors.steal_share(readings, readings) == 0.0


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--new-tokens", "4"], "--new-tokens must be more than 4"),
    (["--max-steal", "1.5"], "--max-steal is a share of the CPUs' time in [0, 1]"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_executors.main(argv)
    assert message in capsys.readouterr().err
