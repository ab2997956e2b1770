"""tools/bench_tile_stream.py: MLA's AMX tile loop compiled bare, one tile's scores and values
checked against numpy before any rate is reported."""

import copy
import json
import os
import shutil

import pytest

from writescope.tools import bench_tile_stream

try:
    bench_tile_stream.check_host()
    HOST_ERROR = None
except ValueError as error:
    HOST_ERROR = str(error)

needs_amx = pytest.mark.skipif(HOST_ERROR is not None or shutil.which("g++") is None,
                               reason=HOST_ERROR or "no g++ on PATH")

SMALL_REGION_MIB = 4  # 56 tiles: enough for the loop's asking and touching ahead, fast to fill


@pytest.fixture(scope="module")
def loop_results():
    executable = bench_tile_stream.build()
    config = {"name": "loop, rows", "mode": "loop", "prefetch": "rows", "pv": True}
    return bench_tile_stream.run_processes(executable, config, [min(os.sched_getaffinity(0))], SMALL_REGION_MIB)


@needs_amx
def test_the_loop_computes_the_scores_and_values_of_its_inputs(loop_results):
    (result,) = loop_results
    bench_tile_stream.check_result(result, "loop, rows")  # raises on any difference: the sums are exact
    scores, values = bench_tile_stream.reference()
    assert len(result["scores"]) == scores.size == 64 * 16
    assert len(result["values"]) == values.size == 16 * 512
    assert result["gbps"] > 0 and result["tile_us"] > 0


@needs_amx
def test_a_wrong_score_or_value_is_caught(loop_results):
    broken = copy.deepcopy(loop_results[0])
    broken["scores"][17] += 0.0078125  # token 1, head 1: one step of the inputs' grid
    with pytest.raises(ValueError, match="loop, rows: tile 0's scores differ"):
        bench_tile_stream.check_result(broken, "loop, rows")
    swapped = copy.deepcopy(loop_results[0])
    values = swapped["values"]
    values[:16], values[16:32] = values[16:32], values[:16]  # head 0's first chunk: even and odd dims swapped
    with pytest.raises(ValueError, match="tile 0's values differ"):
        bench_tile_stream.check_result(swapped, "loop, rows")


@needs_amx
def test_the_tool_reports_each_configuration_against_the_plain_read(tmp_path):
    out = tmp_path / "tile_stream.json"
    rows = bench_tile_stream.main(["--prefetch", "rows", "none", "--pv", "on", "--processes", "1",
                                   "--region-mib", str(SMALL_REGION_MIB), "--rounds", "2", "--out", str(out)])
    assert [row["config"] for row in rows] == ["plain read", "loop, rows", "loop, none"]
    assert rows[0]["of_plain_read"] == 1.0
    for row in rows:
        assert row["total_gbps"] > 0 and row["per_process_gbps"] == row["total_gbps"] and row["tile_us"] > 0
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["processes"] == 1 and saved["region_mib"] == SMALL_REGION_MIB


def test_configurations_put_the_plain_read_first():
    configs = bench_tile_stream.configurations(["rows", "every2"], ["on", "off"])
    assert [c["name"] for c in configs] == ["plain read", "loop, rows", "loop, rows, scores only", "loop, every2",
                                            "loop, every2, scores only"]
    assert [c["pv"] for c in configs[1:]] == [True, False, True, False]


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--processes", "0"], "--processes must be >= 1"),
    (["--processes", "100000"], "--processes must be at most the"),
    (["--region-mib", "0"], "--region-mib must be >= 1"),
    (["--prefetch", "sideways"], "invalid choice: 'sideways'"),
])
def test_bad_arguments_name_what_is_allowed(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_tile_stream.main(argv)
    assert message in capsys.readouterr().err


def test_a_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(ValueError, match="no C\\+\\+ compiler 'no-such-compiler-here'"):
        bench_tile_stream.build()


def test_a_compiler_that_fails_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "false")  # on PATH, exits 1 whatever it is given
    with pytest.raises(ValueError, match="false could not compile tile_stream_amx.cpp .*exit 1"):
        bench_tile_stream.build()
