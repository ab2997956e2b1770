"""tools/bench_channel.py through a real CPU worker on the session's Ray cluster: every size is
timed, the figures are consistent with each other, and the JSON holds what the table printed."""

import json

import pytest

from writescope.tools import bench_channel

pytestmark = pytest.mark.ray


def test_round_trips_through_a_real_worker_are_timed_per_size(ray_cluster, tmp_path):
    out = tmp_path / "channel.json"
    rows = bench_channel.main(["--blocks", "1", "8", "--seconds", "0.3", "--out", str(out)])
    assert [r["blocks"] for r in rows] == [1, 8]
    assert [r["tokens"] for r in rows] == [4 * 16, 4 * 8 * 16]
    for r in rows:
        assert r["calls"] >= 3
        assert 0 < r["kernel_us"] < r["wall_us"]  # the kernel's own seconds lie inside the round trip
        assert r["wall_p10_us"] <= r["wall_us"] <= r["wall_p90_us"]
        assert r["outside_kernel_us"] > 0
    assert json.loads(out.read_text())["rows"] == rows


@pytest.mark.parametrize("args", [["--blocks", "0"], ["--seconds", "0"]])
def test_bad_arguments_say_what_is_allowed(args, capsys):
    with pytest.raises(SystemExit):
        bench_channel.main(args)
    assert "--blocks must be >= 1 and --seconds > 0" in capsys.readouterr().err
