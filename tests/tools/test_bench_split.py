"""bench split: every fixed share and named policy decodes on the same model in one run; the random
KV its engines write is placed by each policy as a prefill's would be, and the steps are the engine's."""

import json

import pytest
import torch

from writescope.engine import Engine, placement
from writescope.models.moe_model import MoEModel
from writescope.models.presets import byte_level_tokenizer, preset_config, preset_weights
from writescope.tools import bench_split


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path / "calibration"))


def test_the_sweep_writes_every_point_and_the_table(tmp_path, capsys, monkeypatch):
    # its own calibration, not one an earlier test of the session cached for the same setup (the
    # session shares one cache dir, and its load differs): the overlap asserted below is measured here
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path / "calibration"))
    out, png = tmp_path / "split.json", tmp_path / "split.png"
    assert bench_split.main(["--contexts", "512", "1024", "--batches", "2", "--new-tokens", "5", "--rounds", "1",
                             "--out", str(out), "--png", str(png)]) == 0
    result = json.loads(out.read_text())
    assert result["host"]["cpu_variant"] and result["host"]["cpus"] >= 1
    points = result["points"]
    assert len(points) == 2 * (len(bench_split.SHARES) + 5) and bench_split.shares(0.1) == bench_split.SHARES
    for point in points:
        assert point["step_s"] > 0
        if point["policy"].startswith("share:"):
            assert point["share"] == float(point["policy"].split(":")[1])
    (ws,) = [p for p in points if p["policy"] == "writescope" and p["context"] == 1024]
    # the device is this CPU: no overlap, so r* is an end. Which end is the calibration's (on this host
    # the two sides run the same kernel, A and B within noise of each other): not asserted
    assert ws["model"]["overlap"] < 0.5 and ws["share"] in (0.0, 1.0)
    rows = result["rows"]
    assert [(r["context"], r["batch"]) for r in rows] == [(512, 2), (1024, 2)]
    for row in rows:
        fixed = [p["step_s"] for p in points if p["context"] == row["context"] and p["policy"].startswith("share:")]
        assert row["best_step_s"] == min(fixed)
    table = capsys.readouterr().out
    assert "| 1K | 2 |" in table and "ws / best fixed" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_random_kv_is_placed_by_the_policy_as_a_prefill_would_place_it():
    config = preset_config("tiny-qwen3-moe")
    model = MoEModel(config, preset_weights(config, torch.float32), device="cpu")
    for policy, cpu_share in (("share:0.3", 0.3), ("all_transfer", 0.0)):
        engine = bench_split.RandomKVEngine.from_model(model, byte_level_tokenizer(), torch.float32, policy=policy,
                                                       max_batch_size=1, max_seq_len=1100, window_tokens=64)
        try:
            steps = engine.generate_stream([[5] * 1024], max_new_tokens=3)
            next(steps)  # prefilled: every block placed, nothing left in the window
            placed = placement(engine)["placed_tokens"]
            assert placed["cpu_compute"] + placed["cpu_transfer"] == 1024
            assert placed["cpu_compute"] == pytest.approx(cpu_share * 1024, abs=16)
            for layer in range(config.num_layers):  # the same random KV in every layer, as written
                stored = engine.cache.sequence_kv(next(iter(engine.cache.seqs)), layer)
                assert torch.equal(stored[0], engine._random_kv[0][:, :1024])
            list(steps)
        finally:
            engine.shutdown()
    assert isinstance(engine, Engine)


@pytest.mark.parametrize("flags,message", [(["--contexts", "1000"], "multiples of --block-size"),
                                           (["--new-tokens", "2"], "--new-tokens must be"),
                                           (["--rounds", "0"], "--rounds must be"),
                                           (["--share-step", "0.3"], "--share-step must be")])
def test_bad_flags_say_what_is_allowed(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_split.parse_args(flags)
    assert message in capsys.readouterr().err
