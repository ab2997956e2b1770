"""tools/numa_scaling.py: the sweep plan and its checks (no Ray), the CSV / table / plot writers, bad
flags exiting with a message that names what is allowed, and one quick sweep end to end on a real
local Ray, run in a subprocess that starts (and stops) its own cluster, so it neither depends on nor
disturbs the session's Ray of the other test modules."""

import csv
import os
import subprocess
import sys

import pytest

from writescope.tools import numa_scaling
from writescope.topology import emulated_topology, read_topology

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPUS = len(os.sched_getaffinity(0))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
needs_two_cpus = pytest.mark.skipif(CPUS < 2, reason="two emulated nodes need two CPUs")


def expected_points(workers, threads):
    """(workers, threads) pairs that fit, from the topology module directly."""
    return [(w, t) for w in workers for t in threads if t <= min(len(n.cpus) for n in emulated_topology(w))]


def run_tool(*argv, script=False, timeout=60):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a cluster of its own, never the session's
    command = ([sys.executable, os.path.join(ROOT, "tools", "numa_scaling.py")] if script
               else [sys.executable, "-m", "writescope.tools.numa_scaling"])
    return subprocess.run([*command, *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


# ---------------------------------------------------------------------------------------- the plan
def test_plan_all_threads_uses_prefixes_of_each_node():
    points = numa_scaling.plan_sweep("emulated", [1], None)
    assert [(p.workers, p.threads) for p in points] == [(1, t) for t in range(1, CPUS + 1)]
    cpus = sorted(os.sched_getaffinity(0))
    for p in points:
        assert p.nodes[0].cpus == tuple(cpus[: p.threads]) and p.nodes[0].emulated
        assert p.total_threads == p.threads


@needs_two_cpus
def test_plan_skips_threads_that_do_not_fit_a_worker_count():
    points = numa_scaling.plan_sweep("emulated", [1, 2], [1, 2])
    assert [(p.workers, p.threads) for p in points] == expected_points([1, 2], [1, 2])
    for p in points:
        assert len(p.nodes) == p.workers and all(len(n.cpus) == p.threads for n in p.nodes)
        assert not set(p.nodes[0].cpus) & set().union(*(n.cpus for n in p.nodes[1:]))  # disjoint nodes


def test_plan_real_nodes_are_the_hosts():
    (point,) = numa_scaling.plan_sweep("real", [1], [1])
    assert point.nodes[0].index == read_topology()[0].index and not point.nodes[0].emulated


@pytest.mark.parametrize("mode, workers, threads, allowed", [
    ("emulated", [CPUS + 1], None, f"allowed 1 to {CPUS}"),
    ("real", [len(read_topology()) + 1], None, f"allowed 1 to {len(read_topology())}"),
    ("emulated", [1], [CPUS + 1], f"allowed 1 to {CPUS}"),
    ("emulated", [1], [0], "allowed 1 or more"),
    ("emulated", [0], None, "allowed 1 or more"),
])
def test_plan_rejects_what_the_host_cannot_run(mode, workers, threads, allowed):
    with pytest.raises(ValueError, match=allowed):
        numa_scaling.plan_sweep(mode, workers, threads)


# ---------------------------------------------------------------------------------------- flags
@pytest.mark.parametrize("argv, message", [
    (["--workers", "0"], "--workers: 0: allowed 1 or more"),
    (["--workers", str(CPUS + 1), "--nodes", "emulated"], f"--workers {CPUS + 1} with --nodes emulated"),
    (["--nodes", "real", "--workers", str(len(read_topology()) + 1)], "--nodes emulated splits its CPUs"),
    (["--threads", "0"], "allowed 1 or more"),
    (["--threads", "two"], "allowed: integers >= 1, or 'all'"),
    (["--threads", str(CPUS + 1), "--nodes", "emulated"], f"allowed 1 to {CPUS}"),
    (["--new-tokens", "3"], "--new-tokens 3: allowed 4 or more"),
    (["--nodes", "numa"], "invalid choice"),
])
def test_bad_flags_exit_2_naming_what_is_allowed(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        numa_scaling.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_every_flag_has_help():
    actions = [a for a in numa_scaling.build_parser()._actions if a.option_strings]
    assert actions and all(a.help for a in actions)


def test_runs_as_a_script():
    """`python tools/numa_scaling.py` works (help, and a flag error before anything starts)."""
    assert "--nodes" in run_tool("--help", script=True).stdout
    result = run_tool("--nodes", "emulated", "--workers", str(CPUS + 1), script=True)
    assert result.returncode == 2
    assert f"allowed 1 to {CPUS}" in result.stderr


# ---------------------------------------------------------------------------------------- writers
def fake_rows():
    rows = []
    for w, t in [(1, 1), (1, 2), (2, 1)]:
        rows.append({"workers": w, "threads_per_worker": t, "total_threads": w * t, "attention_gbps": 10.0 * w * t,
                     "decode_tok_s": 100.0 + t, "roofline_read_gbps": 40.0, "attention_of_roofline": w * t / 4,
                     "workers_read_gbps": 30.0, "attention_of_workers_read": w * t / 3,
                     "middle_tile_us": 2.5 * t if w == 1 else None, "first_tile_in_middle_tiles": 1.5})
    return rows


def test_writers(tmp_path):
    rows = fake_rows()
    numa_scaling.write_csv(rows, str(tmp_path / "out" / "s.csv"))
    with open(tmp_path / "out" / "s.csv") as f:
        read = list(csv.DictReader(f))
    assert list(read[0]) == list(numa_scaling.CSV_COLUMNS) and len(read) == 3
    numa_scaling.plot(rows, str(tmp_path / "out" / "s.png"), 40.0, "title")
    assert (tmp_path / "out" / "s.png").read_bytes()[:8] == PNG_MAGIC
    table = numa_scaling.markdown_table(rows).splitlines()
    assert len(table) == 2 + len(rows) and table[2].startswith("| 1 | 1 | 1 | 10.0 | 0.25 |")
    assert table[2].endswith("| 2.50 | 1.50 |") and table[4].endswith("| - | 1.50 |")
    assert read[2]["middle_tile_us"] == ""  # no middle tile: an empty cell, not a zero


def test_tile_figures_sum_the_workers_phase_totals():
    one = {"first_tile": (2, 6e-6), "gather": (4, 0.4e-6), "scores": (4, 4e-6), "softmax": (4, 0.8e-6),
           "values": (4, 2.8e-6), "last_tile": (2, 4e-6)}
    other = {"first_tile": (2, 10e-6), "gather": (4, 0.4e-6), "scores": (4, 4e-6), "softmax": (4, 0.8e-6),
             "values": (4, 2.8e-6), "last_tile": (2, 4e-6)}
    figures = numa_scaling.tile_figures([one, other])
    assert figures["middle_tile_us"] == pytest.approx(2.0)  # 16 us over 8 middle tiles
    assert figures["first_tile_in_middle_tiles"] == pytest.approx(2.0)  # 16 us over 4 first tiles, / 2
    no_middle = {"first_tile": (3, 3e-6), "gather": (0, 0.0), "scores": (0, 0.0), "softmax": (0, 0.0),
                 "values": (0, 0.0)}
    assert numa_scaling.tile_figures([no_middle]) == {"middle_tile_us": None, "first_tile_in_middle_tiles": None}


# ---------------------------------------------------------------------------------------- end to end
@pytest.mark.ray
@needs_two_cpus
def test_quick_sweep_end_to_end(tmp_path):
    csv_path, png_path = tmp_path / "numa.csv", tmp_path / "numa.png"
    result = run_tool("--quick", "--nodes", "emulated", "--workers", "1", "2", "--threads", "1", "2",
                      "--no-progress", "--csv", str(csv_path), "--png", str(png_path), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["workers"]), int(r["threads_per_worker"])) for r in rows] == expected_points([1, 2], [1, 2])
    for r in rows:
        assert int(r["total_threads"]) == int(r["workers"]) * int(r["threads_per_worker"])
        for key in ("attention_gbps", "decode_tok_s", "roofline_read_gbps", "workers_read_gbps"):
            assert float(r[key]) > 0, (key, r)
        assert float(r["attention_of_roofline"]) == pytest.approx(
            float(r["attention_gbps"]) / float(r["roofline_read_gbps"]), rel=1e-2)
        assert float(r["middle_tile_us"]) > 0 and float(r["first_tile_in_middle_tiles"]) > 0, r
    assert png_path.read_bytes()[:8] == PNG_MAGIC
    assert "| workers | threads/worker | total threads | attention GB/s |" in result.stdout
    assert "Machine read roofline" in result.stdout
