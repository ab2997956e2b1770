"""tools/bench_absorb.py on a DeepSeek-V2-Lite-shaped layer: both ways are timed through the model's
own code, their outputs agree to bf16 rounding, the model is left as the engine keeps it, and bad
arguments name what is allowed."""

import json

import pytest
import torch

from writescope.tools import bench_absorb


def test_both_ways_are_timed_and_agree(tmp_path):
    out = tmp_path / "absorb.json"
    rows = bench_absorb.main(["--batches", "1", "3", "--rounds", "2", "--out", str(out)])
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["float32_ms"] > 0 and r["bf16_ms"] > 0
        assert r["speedup"] == pytest.approx(r["bf16_ms"] / r["float32_ms"])
        assert r["q_max_diff"] <= r["q_max"] * 2**-7  # one bf16 rounding apart at most
        assert r["out_max_diff"] <= r["out_max"] * 2**-7
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["model"] == "deepseek-v2-lite"


def test_the_model_keeps_float32_absorbed_weights_after_a_measure():
    model = bench_absorb.one_layer_model("deepseek-v2-lite")
    bench_absorb.measure(model, batch=1, rounds=1)
    assert model.w["absorbed.0.w_uk"].dtype == model.w["absorbed.0.w_uv"].dtype == torch.float32


@pytest.mark.parametrize(("args", "message"), [
    (["--batches", "0"], "--batches must be >= 1"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--model", "nope"], "is unknown; known:"),
    (["--model", "qwen3-30b-a3b"], "has no MLA latent; MLA models: deepseek-v2-lite"),
])
def test_bad_arguments_say_what_is_allowed(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        bench_absorb.main([*args, "--out", str(tmp_path / "x.json")])
    assert message in capsys.readouterr().err
