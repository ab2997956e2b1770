"""bench contention on this CPU-only host: a memory-streaming process started mid-run slows the CPU
partial; the policy, fed the real per-layer times, keeps every new block on the side it chose before."""

import json

import pytest

from writescope.tools import bench_contention


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
    assert len(result["steps"]) == 40 and all(s["cpu_layer_s"] > 0 for s in result["steps"])


@pytest.mark.parametrize("flags,message", [(["--hog-step", "3"], "--hog-step must leave"),
                                           (["--hog", "h2d"], "--hog h2d needs --device cuda"),
                                           (["--context", "100"], "--context must be")])
def test_bad_flags_say_what_is_allowed(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_contention.parse_args(flags)
    assert message in capsys.readouterr().err
