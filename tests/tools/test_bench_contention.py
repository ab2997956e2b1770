"""bench contention on this CPU-only host: a memory-streaming process started mid-run slows the CPU
partial; the policy, fed the real per-layer times, keeps every new block on the CPU (r* = 1)."""

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
    assert result["share_before"] == result["share_min_during"] == result["share_max_during"] == 1.0
    assert result["placed_end"]["cpu_transfer"] == 0
    assert result["placed_end"]["cpu_compute"] > result["placed_before"]["cpu_compute"]  # blocks placed meanwhile
    assert len(result["steps"]) == 40 and all(s["cpu_layer_s"] > 0 for s in result["steps"])


@pytest.mark.parametrize("flags,message", [(["--hog-step", "3"], "--hog-step must leave"),
                                           (["--hog", "h2d"], "--hog h2d needs --device cuda"),
                                           (["--context", "100"], "--context must be")])
def test_bad_flags_say_what_is_allowed(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_contention.parse_args(flags)
    assert message in capsys.readouterr().err
