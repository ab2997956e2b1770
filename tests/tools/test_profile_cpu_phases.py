"""tools/profile_cpu_phases.py: the kernel's phase timers over the benchmark's shapes, counted against
the items and tiles each call plans."""

import json

import pytest

from writescope import _cpu
from writescope.tools import profile_cpu_phases


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("phases") / "phases.json"
    results = profile_cpu_phases.main(["--shapes", "qwen3-moe", "deepseek-v2-lite-mla", "--seq-lens", "8192",
                                       "--calls", "4", "--cold-mib", "8", "--out", str(out)])
    return results, json.loads(out.read_text())


def test_each_row_counts_the_items_and_tiles_of_a_call(rows):
    results, _ = rows
    by_shape = {r["shape"]: r for r in results}
    # qwen3-moe: 4 kv heads x 8192 tokens / 64 items -> items of 512 tokens: 16 a kv head, each 8 tiles
    # (first, 6 middle, last); deepseek-v2-lite-mla: items of 2048 tokens (its output rule), 4 of 32 tiles
    for shape, items, middle_tiles, merges in (("qwen3-moe", 64, 64 * 6, 4),
                                               ("deepseek-v2-lite-mla", 4, 4 * 30, 1)):
        per_call = {p["phase"]: p["per_call"] for p in by_shape[shape]["phases"]}
        assert per_call["item_start"] == per_call["first_tile"] == per_call["last_tile"] == items
        assert per_call["item_end"] == items and per_call["merge"] == merges
        for part in profile_cpu_phases.MIDDLE_PARTS:
            assert per_call[part] == middle_tiles


def test_shares_and_ratios_are_consistent(rows):
    results, _ = rows
    for r in results:
        assert sum(p["share"] for p in r["phases"]) == pytest.approx(1.0)
        assert all(p["mean_us"] > 0 for p in r["phases"])
        assert 0 < r["covered"] <= 1.05
        middle = sum(p["mean_us"] for p in r["phases"] if p["phase"] in profile_cpu_phases.MIDDLE_PARTS)
        assert r["middle_tile_us"] == pytest.approx(middle)
        first = next(p["mean_us"] for p in r["phases"] if p["phase"] == "first_tile")
        assert r["first_tile_in_middle_tiles"] == pytest.approx(first / middle)


def test_the_json_holds_the_rows_and_the_host(rows):
    results, written = rows
    assert written["rows"] == results
    assert written["variant"] == _cpu.__cpu_variant__ and written["cpu_model"]


def test_the_timers_are_off_after_a_run(rows):
    assert all(count == 0 for count, _ in _cpu.phase_timers().values())


def test_the_table_names_the_cpu_variant_and_every_phase(rows):
    results, _ = rows
    text = profile_cpu_phases.table(results, "Some CPU", "amx")
    assert "Some CPU, variant `amx`" in text
    for phase in profile_cpu_phases.PHASES:
        assert f"| {phase} |" in text


@pytest.mark.parametrize("argv, message", [
    (["--calls", "0"], "--calls must be >= 1"),
    (["--seq-lens", "100"], "--seq-lens must be positive multiples of 16"),
    (["--cold-mib", "0"], "--cold-mib must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--shapes", "llama"], "invalid choice"),
])
def test_bad_arguments_are_named(capsys, argv, message):
    with pytest.raises(SystemExit):
        profile_cpu_phases.main(argv)
    assert message in capsys.readouterr().err
