"""tools/bench_capacity.py in one process (a device machine has no Ray): the same figures as through
the Ray executor, the host regions' pages in memory being the KV placed."""

import json

import pytest

from writescope.tools import bench_capacity


def test_the_local_executor_reports_the_host_memory_of_the_kv_placed(tmp_path, monkeypatch):
    from writescope.actors.ray_engine import RayEngine

    def no_ray(*args, **kwargs):
        raise AssertionError("--executor local started a RayEngine")

    monkeypatch.setattr(RayEngine, "from_pretrained", no_ray)
    out = tmp_path / "capacity.json"
    assert bench_capacity.main(["--executor", "local", "--batch", "2", "--context", "1024", "--new-tokens", "4",
                                "--window-tokens", "64", "--prefill-chunk-tokens", "256", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    placed = result["placed_tokens"]
    assert placed["cpu_compute"] == 2 * 1024 and placed["cpu_transfer"] == 0  # all_cpu: every full block
    assert result["raw_kv_bytes"] == placed["cpu_compute"] * bench_capacity.kv_bytes_per_token("tiny-qwen3-moe")
    assert sorted(result["host_regions"]) == ["cpu_compute_0", "cpu_transfer"]
    assert result["host_size_bytes"] >= 2 * result["raw_kv_bytes"]  # sized for any policy
    assert 0.95 <= result["resident_over_raw"] <= 1.3, result["host_regions"]
    assert result["decode_tok_s"] > 0 and result["prefill_tok_s"] > 0
    assert result["gpu_worker_peak_rss_bytes"] is None and result["device_peak_bytes"] is None


def test_a_device_kv_cap_sets_the_window_and_the_pingpong(tmp_path, monkeypatch):
    made = {}
    original = bench_capacity.Engine.from_config
    monkeypatch.setattr(bench_capacity.Engine, "from_config",
                        lambda config: made.setdefault("config", config) and original(config))
    out = tmp_path / "capacity.json"
    bench_capacity.main(["--executor", "local", "--batch", "2", "--context", "256", "--new-tokens", "2",
                         "--device-kv-gb", "0.0005", "--prefill-chunk-tokens", "256", "--out", str(out)])
    window, pingpong_blocks = bench_capacity.device_budget("tiny-qwen3-moe", 0.0005, 16, 2)
    assert (made["config"].window_tokens, made["config"].pingpong_blocks) == (window, pingpong_blocks)
    assert window < 256  # the cap, not the default window


@pytest.mark.parametrize("flags, message", [(["--device-kv-gb", "0"], "--device-kv-gb must be > 0"),
                                            (["--executor", "mpi"], "invalid choice"),
                                            (["--batch", "0"], "--batch")])
def test_bad_flags_are_refused_by_name(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_capacity.main(flags)
    assert message in capsys.readouterr().err
