"""tools/bench_moe.py times the dense paths (C++ kernels, torch gathered, torch one by one) on the same
engine's decode steps and says which is which."""

import json

import pytest

from writescope.tools import bench_moe


def test_every_path_is_timed_on_decode_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    out = tmp_path / "moe.json"
    bench_moe.main(["--batches", "2", "--context", "256", "--steps", "4", "--block", "2", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["batch"] == 2 and row["steps"] == 4
    assert all(row[f"{path}_ms"] > 0 for path in bench_moe.PATHS)
    assert row["one_by_one_over_cpu_kernels"] == pytest.approx(row["one_by_one_ms"] / row["cpu_kernels_ms"])
    assert row["separate_kernels_over_cpu_kernels"] == pytest.approx(row["separate_kernels_ms"] / row["cpu_kernels_ms"])
    assert row["gathered_over_cpu_kernels"] == pytest.approx(row["gathered_ms"] / row["cpu_kernels_ms"])


def test_the_paths_really_take_turns(monkeypatch):
    calls = {"cpu_kernels": 0, "gathered": 0}
    from writescope import dense
    from writescope.models import moe_model

    def counted(name, original):
        def call(*args):
            result = original(*args)
            calls[name] += result is not None  # the fused layer declines (None) off the kernels, or on a tie
            return result
        return call

    # a layer on the kernels is the fused MoE call, or its routed experts where the fused call declined
    monkeypatch.setattr(dense, "moe_feed_forward", counted("cpu_kernels", dense.moe_feed_forward))
    monkeypatch.setattr(dense, "routed_experts", counted("cpu_kernels", dense.routed_experts))
    monkeypatch.setattr(moe_model, "_gathered_experts", counted("gathered", moe_model._gathered_experts))
    times = bench_moe.interleaved_steps("tiny-qwen3-moe", "all_cpu", 1, 128, steps=2, block=1, dtype="bfloat16")
    assert {len(steps) for steps in times.values()} == {2} and set(times) == set(bench_moe.PATHS)
    layers = 4  # tiny-qwen3-moe: every layer MoE
    # the 4 warm-up steps and the 2 timed ones of each kernels path take the C++ experts; the torch
    # gathered path its 2 steps
    assert calls == {"cpu_kernels": (4 + 2 + 2) * layers, "gathered": 2 * layers}
    assert dense.use_cpu_kernels and dense.use_fused_layers  # restored


@pytest.mark.parametrize("flags, message", [(["--steps", "0"], "--steps"), (["--batches", "0"], "--batches"),
                                            (["--steps", "2", "--block", "4"], "at least --block")])
def test_bad_flags_are_refused_by_name(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_moe.main(flags)
    assert message in capsys.readouterr().err
