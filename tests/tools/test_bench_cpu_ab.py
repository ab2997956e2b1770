"""tools/bench_cpu_ab.py: two builds of the extension loaded side by side, timed in turns, each
checked against the torch reference inside the tool."""

import json
import os
import shutil

import pytest
import torch

from writescope import _cpu, calibration, ops
from writescope.tools import bench_cpu_ab
from writescope.tools.bench_cpu_attention import SHAPES, cache_source, make_inputs


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
    result = json.loads(out.read_text())
    assert result["rows"] == rows
    assert result["cpu_model"] == calibration.cpu_model() and result["cpus"] == os.cpu_count()
    # the host's read of the same KV after every round: which stretch of a shared host the run met
    assert len(result["host_read_gbps"]) == 2 and all(gbps > 0 for gbps in result["host_read_gbps"])


def test_the_fast_third_of_the_rounds_is_the_top_third_of_the_host_reads():
    reads = [31.0, 58.0, 33.0, 55.0, 30.0, 60.0]
    assert bench_cpu_ab.fast_rounds(reads) == [1, 5]
    assert bench_cpu_ab.fast_rounds([40.0]) == [0]
    assert bench_cpu_ab.fast_rounds([]) == []
    # three calls a round: round r's calls are walls[3 r: 3 r + 3]
    walls = [float(i) for i in range(18)]
    assert bench_cpu_ab.calls_in_rounds(walls, 6, [1, 5]) == [3.0, 4.0, 5.0, 15.0, 16.0, 17.0]


def test_rows_compare_the_builds_in_the_fast_rounds_too(two_builds):
    rows = bench_cpu_ab.main(["--builds", *two_builds, "--shape", "mixtral", "--seq-len", "256",
                              "--cold-mib", "1", "--rounds", "3"])
    assert rows[0]["fast_rounds"] == rows[1]["fast_rounds"] >= 1
    assert rows[0]["fast_rounds_speedup_vs_first"] == 1.0
    assert all(row["fast_rounds_median_ms"] > 0 for row in rows)


def test_one_build_runs_once_per_variant_each_with_its_own(two_builds):
    variants = _cpu.available_variants()[-2:]  # the two lowest this CPU runs (scalar and one more, or scalar)
    rows = bench_cpu_ab.main(["--builds", two_builds[0], "--variants", *variants, "--shape", "qwen3-moe",
                              "--seq-len", "256", "--cold-mib", "1", "--rounds", "1"])
    assert [row["variant"] for row in rows] == variants  # each copy kept the variant it was given
    assert all(row["build"] == two_builds[0] for row in rows)


def test_each_copy_runs_the_variant_it_was_given(two_builds, tmp_path):
    """Two copies of one build, one set to scalar and one to this CPU's best variant: each keeps its
    own (one library loaded twice would share the selection), seen in their FMA peaks."""
    best = _cpu.available_variants()[0]
    if best == "scalar":
        pytest.skip("this CPU runs the scalar variant only")
    scalar = bench_cpu_ab.load_variant(two_builds[0], 0, "scalar", str(tmp_path))
    simd = bench_cpu_ab.load_variant(two_builds[0], 1, best, str(tmp_path))
    assert max(simd.fma_peak(200_000, 3)) > 2 * max(scalar.fma_peak(200_000, 3))
    assert (scalar.__cpu_variant__, simd.__cpu_variant__) == ("scalar", best)


def test_a_variant_this_cpu_does_not_run_is_refused_by_name(two_builds, capsys):
    with pytest.raises(SystemExit):
        bench_cpu_ab.main(["--builds", two_builds[0], "--variants", "no-such-isa"])
    assert "'no-such-isa' does not run on this CPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--builds", "/nonexistent/_cpu.so"], "is not a file"),
    (["--builds", "x", "--seq-len", "100"], "must be a multiple of every block size, not of [16]"),
    (["--builds", "x", "--seq-len", "96", "--block-sizes", "16", "64"], "not of [64]"),
    (["--builds", "x", "--block-sizes", "15"], "must be even for mixtral"),
    (["--builds", "x", "--block-sizes", "0"], "--block-sizes must each be >= 1"),
    (["--builds", "x", "--run-blocks", "0"], "--run-blocks must each be >= 1"),
    (["--builds", "x", "--chunk-tokens", "0"], "--chunk-tokens must each be >= 1"),
    (["--builds", "x", "--threads", "0"], "--threads must be >= 1"),
    (["--builds", "x", "--rounds", "0"], "--rounds must be >= 1"),
    (["--builds", "x", "--cold-mib", "-1"], "--cold-mib must be >= 0"),
    (["--builds", "x", "--pages", "1g"], "invalid choice: '1g'"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_cpu_ab.main(argv)
    assert message in capsys.readouterr().err


def test_layouts_and_work_items_are_contestants_too(two_builds):
    """One build on every combination of block size, run length and work item, in that order, each
    result checked against the reference inside the tool (a wrong layout raises there)."""
    rows = bench_cpu_ab.main(["--builds", two_builds[0], "--shape", "mixtral", "--seq-len", "256",
                              "--block-sizes", "16", "64", "--run-blocks", "1", "4", "--chunk-tokens", "64", "256",
                              "--cold-mib", "1", "--rounds", "1", "--threads", "1"])
    combos = [(row["block_size"], row["run_blocks"], row["chunk_tokens"]) for row in rows]
    assert combos == [(16, 1, 64), (16, 1, 256), (16, 4, 64), (16, 4, 256),
                      (64, 1, 64), (64, 1, 256), (64, 4, 64), (64, 4, 256)]
    for row in rows:
        assert row["threads"] == 1
        assert 0 < row["kernel_ms"] <= row["median_ms"]  # the kernel's own seconds lie inside the call's


def test_mla_takes_any_block_size(two_builds):
    # MLA's latents are token-major: an odd block size is a layout it can have
    rows = bench_cpu_ab.main(["--builds", two_builds[0], "--shape", "deepseek-v2-lite-mla", "--seq-len", "255",
                              "--block-sizes", "17", "--cold-mib", "1", "--rounds", "1"])
    assert rows[0]["block_size"] == 17 and rows[0]["kernel_ms"] > 0


@pytest.mark.parametrize("shape_name", ["mixtral", "deepseek-v2-lite-mla"])
def test_huge_page_copies_hold_the_same_kv(shape_name):
    """A source moved into huge-page-advised memory: 2 MB aligned, the same bytes in the same layout,
    so the kernel gives the same result to the bit (MLA's V stays a view inside its K)."""
    shape = next(s for s in SHAPES if s.name == shape_name)
    q, k, v = make_inputs(shape, 256)
    source = cache_source(shape, k, v, torch.Generator().manual_seed(0), 4)
    huge = bench_cpu_ab.HugePageArrays()
    moved = huge.source(shape, source)
    assert moved.k_cache.data_ptr() % (2 << 20) == 0
    assert moved.k_cache.stride() == source.k_cache.stride() and moved.v_cache.stride() == source.v_cache.stride()
    assert torch.equal(moved.k_cache, source.k_cache) and torch.equal(moved.v_cache, source.v_cache)
    assert (moved.v_cache.data_ptr() == moved.k_cache.data_ptr()) == shape.v_in_k
    scale = shape.head_dim_qk**-0.5
    out, lse, _ = ops.cpu_paged_attention_timed(q[None], source, scale)
    moved_out, moved_lse, _ = ops.cpu_paged_attention_timed(q[None], moved, scale)
    assert torch.equal(out, moved_out) and torch.equal(lse, moved_lse)


@pytest.mark.skipif(not bench_cpu_ab.huge_pages_enabled(), reason="this host gives no transparent huge pages")
def test_page_sizes_are_contestants_too(two_builds):
    rows = bench_cpu_ab.main(["--builds", two_builds[0], "--shape", "qwen3-moe", "--seq-len", "256",
                              "--pages", "4k", "2m", "--cold-mib", "1", "--rounds", "1"])
    assert [row["pages"] for row in rows] == ["4k", "2m"]
    assert all(row["kernel_ms"] > 0 for row in rows)


def test_each_round_starts_one_contestant_further_on():
    orders = [bench_cpu_ab.round_order(["a", "b", "c"], r) for r in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    # each contestant goes first once per cycle of rounds
    firsts = [order[0] for order in orders[:3]]
    assert sorted(firsts) == ["a", "b", "c"]


def test_pacing_on_and_off_are_contestants_of_one_build(two_builds):
    rows = bench_cpu_ab.main(["--builds", two_builds[0], "--pacing", "off", "on", "--shape", "mixtral",
                              "--seq-len", "256", "--cold-mib", "1", "--rounds", "2"])
    assert [row["pacing"] for row in rows] == ["off", "on"]
    assert all(row["calls"] >= 2 * 3 for row in rows)


def test_pacing_with_a_build_that_has_none_is_refused_by_name(two_builds, capsys, monkeypatch):
    monkeypatch.setattr(bench_cpu_ab, "load_build", lambda path, index: object())  # a build from before pacing
    with pytest.raises(SystemExit):
        bench_cpu_ab.main(["--builds", two_builds[0], "--pacing", "on", "--shape", "mixtral", "--seq-len", "256"])
    assert "--pacing: " in (err := capsys.readouterr().err) and "has no pacing (built before it)" in err
