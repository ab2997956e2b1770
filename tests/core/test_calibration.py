"""Calibration measures this machine once per shape, caches it, and re-measures on demand."""

import dataclasses
import json

import pytest

from writescope import calibration
from writescope.kv_format import KVFormat

SHAPE = calibration.AttentionShape(8, KVFormat(num_layers=1, num_kv_heads=2, head_dim_k=64, head_dim_v=64))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_calibration_is_cached_per_machine_and_shape(cache_dir):
    model = calibration.calibrate(SHAPE, lengths=(256, 2048), repeats=3)
    assert model.cpu_s_per_token > 0 and model.transfer_s_per_token > 0
    assert model.cpu_fixed_s >= 0 and model.gpu_fixed_s >= 0
    stored = json.loads((cache_dir / "calibration.json").read_text())
    assert len(stored) == 1
    key = next(iter(stored))
    assert key.startswith(calibration.machine_fingerprint("cpu")) and '"num_q_heads": 8' in key
    # A second call reads the cache: edit it and the edit comes back.
    stored[key]["cpu_s_per_token"] = 1.25e-7
    (cache_dir / "calibration.json").write_text(json.dumps(stored))
    assert calibration.calibrate(SHAPE).cpu_s_per_token == 1.25e-7
    # force re-measures and overwrites.
    remeasured = calibration.calibrate(SHAPE, force=True, lengths=(256, 2048), repeats=3)
    assert json.loads((cache_dir / "calibration.json").read_text())[key]["cpu_s_per_token"] == \
        remeasured.cpu_s_per_token


def test_other_shapes_get_their_own_entry(cache_dir):
    mla = calibration.AttentionShape(16, KVFormat(1, 1, 576, 512, v_in_k=True))
    calibration.calibrate(SHAPE, lengths=(256, 2048), repeats=3)
    calibration.calibrate(mla, lengths=(256, 2048), repeats=3)
    assert len(json.loads((cache_dir / "calibration.json").read_text())) == 2


def test_a_corrupt_cache_is_measured_again(cache_dir):
    (cache_dir / "calibration.json").write_text("{not json")
    model = calibration.calibrate(SHAPE, lengths=(256, 2048), repeats=3)
    stored = json.loads((cache_dir / "calibration.json").read_text())  # rewritten, valid
    assert list(stored.values()) == [dataclasses.asdict(model)]
