"""bench contention on this CPU-only host: a memory-streaming process started mid-run slows the CPU
partial; the policy, fed the real per-layer times, keeps every new block on the side it chose before."""

import json

import pytest

from writescope.perf_model import PerfModel
from writescope.tools import bench_contention
from writescope.tools.bench_split import RandomKVEngine


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path / "calibration"))


def test_a_memory_hog_mid_run_leaves_the_kv_on_the_cpu(tmp_path):
    out = tmp_path / "contention.json"
    assert bench_contention.main(["--context", "4096", "--batch", "2", "--steps", "40", "--hog-step", "14",
                                  "--window-tokens", "16", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["calibrated"]["overlap"] < 0.5  # the device is this CPU
    # r* is an end (no overlap) and the hog does not move it: both sides run on this CPU and slow alike.
    # Which end is the calibration's (A and B within noise of each other here): not asserted
    share = result["share_before"]
    assert share in (0.0, 1.0) and result["share_min_during"] == result["share_max_during"] == share
    kept, other = ("cpu_compute", "cpu_transfer") if share == 1.0 else ("cpu_transfer", "cpu_compute")
    assert result["placed_end"][other] == result["placed_before"][other]
    assert result["placed_end"][kept] > result["placed_before"][kept]  # blocks placed meanwhile, all on one side
    # the side holding the spilled KV is the one whose times are followed: the CPU partial at r* = 1,
    # the device path at r* = 0
    assert result["measured_side"] == ("cpu" if share == 1.0 else "device")
    layer = f"{result['measured_side']}_layer_s"
    assert len(result["steps"]) == 40 and all(s[layer] > 0 for s in result["steps"])
    assert result["layer_ms_before"] > 0 and result["measured_slowdown"] > 0


@pytest.mark.parametrize("end,rates", [("cpu", (1e-8, 1e-7)), ("device", (1e-7, 1e-8))])
def test_either_end_chosen_keeps_every_new_block_on_its_side(end, rates, tmp_path, monkeypatch):
    """Calibration on this host may pick either end (the two sides are the same CPU); given a fit that
    picks each, the run follows the side holding the KV, and the hog does not move r*."""
    fitted = PerfModel(*rates, cpu_fixed_s=1e-4, gpu_fixed_s=1e-4, overlap=0.0)
    monkeypatch.setattr(RandomKVEngine, "calibrate", lambda self: fitted)
    out = tmp_path / "contention.json"
    assert bench_contention.main(["--context", "2048", "--batch", "2", "--steps", "32", "--hog-step", "12",
                                  "--window-tokens", "16", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    share = 1.0 if end == "cpu" else 0.0
    assert result["measured_side"] == end and result["share_before"] == share
    assert result["share_min_during"] == result["share_max_during"] == share
    kept, other = ("cpu_compute", "cpu_transfer") if end == "cpu" else ("cpu_transfer", "cpu_compute")
    assert result["placed_end"][other] == result["placed_before"][other] == 0
    assert result["placed_end"][kept] > result["placed_before"][kept]
    assert all(s[f"{end}_layer_s"] > 0 for s in result["steps"])


@pytest.mark.parametrize("flags,message", [(["--hog-step", "3"], "--hog-step must leave"),
                                           (["--hog", "h2d"], "--hog h2d needs --device cuda"),
                                           (["--context", "100"], "--context must be")])
def test_bad_flags_say_what_is_allowed(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_contention.parse_args(flags)
    assert message in capsys.readouterr().err
