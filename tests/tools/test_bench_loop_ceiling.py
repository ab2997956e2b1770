"""tools/bench_loop_ceiling.py: the kernel's AVX2 score loop compiled bare, its scores checked
against numpy before any rate is reported."""

import copy
import json
import shutil

import pytest

from writescope.tools import bench_loop_ceiling

try:
    bench_loop_ceiling.check_host()
    HOST_ERROR = None
except ValueError as error:
    HOST_ERROR = str(error)

needs_avx2 = pytest.mark.skipif(HOST_ERROR is not None or shutil.which("g++") is None,
                                reason=HOST_ERROR or "no g++ on PATH")


@pytest.fixture(scope="module")
def one_run():
    return bench_loop_ceiling.run_loops(bench_loop_ceiling.build(), rounds=2, calls=50, l2_regions=4)


@needs_avx2
def test_every_loop_computes_the_scores_of_its_inputs(one_run):
    names = [loop["name"] for loop in one_run["loops"]]
    assert names == ["kernel", "k_once", "phased_4x3"]
    bench_loop_ceiling.check_scores(one_run)  # raises on any difference beyond rounding
    for loop in one_run["loops"]:
        expected = bench_loop_ceiling.reference_scores(one_run, loop["token_vectors"])
        assert len(loop["scores"]) == expected.size == 4 * loop["token_vectors"] * 8
        assert loop["l1_gflops"] > 0 and loop["l2_gflops"] > 0
        assert loop["l1_of_peak"] > 0 and loop["l2_of_peak"] > 0
    assert one_run["fma_peak_gflops"] > 0


@needs_avx2
def test_a_wrong_score_is_caught(one_run):
    broken = copy.deepcopy(one_run)
    broken["loops"][2]["scores"][5] += 0.5  # the 4 x 3 loop's head 0, token 5
    with pytest.raises(ValueError, match="loop phased_4x3: scores differ"):
        bench_loop_ceiling.check_scores(broken)
    # so is a loop whose K is read from the wrong block: its third token vector's inputs moved
    shifted = copy.deepcopy(one_run)
    k = shifted["k"]
    half = len(k) // 2
    shifted["k"] = k[half:] + k[:half]
    with pytest.raises(ValueError, match="scores differ"):
        bench_loop_ceiling.check_scores(shifted)


@needs_avx2
def test_the_tool_reports_a_row_per_loop(tmp_path):
    out = tmp_path / "ceiling.json"
    rows = bench_loop_ceiling.main(["--rounds", "1", "--calls", "20", "--l2-regions", "4", "--out", str(out)])
    assert [row["loop"] for row in rows] == ["kernel", "k_once", "phased_4x3"]
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["l2_regions"] == 4 and saved["fma_peak_gflops"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--calls", "0"], "--calls must be >= 1"),
    (["--l2-regions", "1"], "--l2-regions must be >= 2"),
])
def test_bad_arguments_name_what_is_allowed(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_loop_ceiling.main(argv)
    assert message in capsys.readouterr().err


def test_a_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(ValueError, match="no C\\+\\+ compiler 'no-such-compiler-here'"):
        bench_loop_ceiling.build()
