"""tools/bench_sparse.py on a context just past the selection's reach: the sparse step reads the
indexer's 512 CSA entries a layer, the dense one every entry, on the same sequence."""

import json

import pytest

from writescope.models.deepseek_v4 import CSA
from writescope.models.presets import SPARSE_PRESETS
from writescope.tools import bench_sparse

CONTEXT = 2600  # 650 CSA entries: more than the 512 the indexer keeps


def test_sparse_reads_the_selection_and_dense_every_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    out = tmp_path / "sparse.json"
    bench_sparse.main(["--contexts", str(CONTEXT), "--steps", "2", "--warmup", "0", "--dtype", "float32",
                       "--out", str(out)])
    result = json.loads(out.read_text())["results"][0]
    preset = SPARSE_PRESETS["tiny-deepseek-v4"]
    csa_layers = preset["layer_types"].count(CSA)
    sparse, dense = result["sparse"], result["dense"]
    assert sparse["csa_entries_cpu"] + sparse["csa_entries_device"] == csa_layers * preset["index_topk"]
    dense_entries = dense["csa_entries_cpu"] + dense["csa_entries_device"]
    assert csa_layers * (CONTEXT // 4) <= dense_entries <= csa_layers * (CONTEXT + 6) // 4
    assert sparse["csa_entries_cpu"] > 0 and sparse["csa_entries_device"] > 0  # fixed_half: both sides
    assert sparse["kv_read_bytes"] < dense["kv_read_bytes"]
    assert result["prefill_tok_s"] > 0 and sparse["tok_s"] > 0


@pytest.mark.ray
def test_the_executors_decode_the_same_selection(ray_cluster, tmp_path, monkeypatch):
    """--compare-executors: the sequence decoded in process and on Ray, each attending the indexer's
    512 entries a CSA layer, split between the CPU and the device side alike (the same placement and
    the same selections: the same greedy tokens)."""
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    out = tmp_path / "executors.json"
    bench_sparse.main(["--compare-executors", "--contexts", str(CONTEXT), "--steps", "2", "--warmup", "0",
                       "--dtype", "float32", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["executor"] for r in rows] == ["local", "ray"]
    csa_layers = SPARSE_PRESETS["tiny-deepseek-v4"]["layer_types"].count(CSA)
    for row in rows:
        assert row["csa_entries_cpu"] > 0 and row["csa_entries_device"] > 0
        assert row["csa_entries_cpu"] + row["csa_entries_device"] == csa_layers * 512
        assert row["tok_s"] > 0
    local, ray = rows
    assert (local["csa_entries_cpu"], local["csa_entries_device"]) == (ray["csa_entries_cpu"],
                                                                        ray["csa_entries_device"])
