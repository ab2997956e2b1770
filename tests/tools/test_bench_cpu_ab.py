"""tools/bench_cpu_ab.py: two builds of the extension loaded side by side, timed in turns, each
checked against the torch reference inside the tool."""

import json
import shutil

import pytest

from writescope import _cpu
from writescope.tools import bench_cpu_ab


@pytest.fixture
def two_builds(tmp_path):
    """The installed extension as two files: two builds, loaded as separate modules."""
    paths = []
    for name in ("before", "after"):
        path = tmp_path / name / "_cpu.so"
        path.parent.mkdir()
        shutil.copy(_cpu.__file__, path)
        paths.append(str(path))
    return paths


def test_builds_take_turns_and_are_compared_to_the_first(two_builds, tmp_path):
    out = tmp_path / "ab.json"
    rows = bench_cpu_ab.main(["--builds", *two_builds, "--shape", "qwen3-moe", "--seq-len", "256",
                              "--cold-mib", "1", "--rounds", "2", "--out", str(out)])
    assert [row["build"] for row in rows] == two_builds
    assert rows[0]["speedup_vs_first"] == 1.0
    assert rows[0]["calls"] == rows[1]["calls"] >= 2 * 3  # every build ran in every round
    for row in rows:
        assert row["p10_ms"] <= row["median_ms"]
    assert json.loads(out.read_text())["rows"] == rows


@pytest.mark.parametrize("argv, message", [
    (["--builds", "/nonexistent/_cpu.so"], "is not a file"),
    (["--builds", "x", "--seq-len", "100"], "multiple of the block size"),
    (["--builds", "x", "--rounds", "0"], "--rounds must be >= 1"),
    (["--builds", "x", "--cold-mib", "-1"], "--cold-mib must be >= 0"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_cpu_ab.main(argv)
    assert message in capsys.readouterr().err
