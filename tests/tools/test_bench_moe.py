"""tools/bench_moe.py times both MoE paths on the same engine's decode steps and says which is which."""

import json

import pytest

from writescope.tools import bench_moe


def test_both_paths_are_timed_on_decode_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    out = tmp_path / "moe.json"
    bench_moe.main(["--batches", "2", "--context", "256", "--steps", "4", "--block", "2", "--dtype", "float32",
                    "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["batch"] == 2 and row["steps"] == 4
    assert row["gathered_ms"] > 0 and row["one_by_one_ms"] > 0
    assert row["one_by_one_over_gathered"] == pytest.approx(row["one_by_one_ms"] / row["gathered_ms"])


def test_the_paths_really_alternate(monkeypatch):
    calls = []
    from writescope.models import moe_model

    original = moe_model._gathered_experts
    monkeypatch.setattr(moe_model, "_gathered_experts", lambda *args: calls.append(1) or original(*args))
    times = bench_moe.interleaved_steps("tiny-qwen3-moe", "all_cpu", 1, 128, steps=2, block=1, dtype="float32")
    assert len(times["gathered"]) == len(times["one_by_one"]) == 2
    layers = 4  # tiny-qwen3-moe: every layer MoE
    assert len(calls) == (4 + 2) * layers  # the 4 warm-up steps and the 2 gathered ones, not the other 2


@pytest.mark.parametrize("flags, message", [(["--steps", "0"], "--steps"), (["--batches", "0"], "--batches"),
                                            (["--steps", "2", "--block", "4"], "at least --block")])
def test_bad_flags_are_refused_by_name(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_moe.main(flags)
    assert message in capsys.readouterr().err
