"""Hardware profiles and the policy simulator (tools/simulate_policies.py): pure Python, no GPU."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from writescope.hardware_profiles import (
    KINDS,
    PROFILES_PATH,
    Figure,
    known_models,
    known_profiles,
    kv_bytes_per_token_per_layer,
    load_model_shape,
    load_profile,
)
from writescope.perf_model import PerfModel
from writescope.policies import POLICY_NAMES

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ("a100-pcie-gen4", "v100-pcie-gen3", "h200-pcie-gen5")
MODELS = ("deepseek-v2-lite", "qwen3-30b-a3b", "mixtral-8x7b")


def _load_tool():
    name = "simulate_policies_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "simulate_policies.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve their module while the file executes
        spec.loader.exec_module(module)
    return sys.modules[name]


sim = _load_tool()


# ---------------------------------------------------------------- profiles


def test_the_three_profiles_and_models_are_known():
    assert set(PROFILES) <= set(known_profiles())
    assert set(MODELS) <= set(known_models())


@pytest.mark.parametrize("name", PROFILES)
def test_profile_loads_with_sourced_figures(name):
    p = load_profile(name)
    assert p.name == name and p.gpu and p.link and p.cpu
    for key, fig in p.figures().items():
        assert isinstance(fig, Figure), key
        assert fig.kind in KINDS and fig.source.strip() and fig.value > 0, key
    # pageable is slower than pinned, contention slows both, the link stays under its theoretical peak
    assert p.h2d_gbps(pageable=True) == pytest.approx(p.h2d_pinned_gbps.value * p.pageable_ratio.value)
    assert p.h2d_gbps(pageable=True) < p.h2d_gbps() <= p.link_theoretical_gbps.value
    assert p.h2d_gbps(contended=True) == pytest.approx(p.h2d_gbps() * 14.9 / 25.4, rel=1e-3)
    assert p.cpu_effective_gbps == pytest.approx(188.0 * p.cpu_attention_fraction.value)
    assert p.pageable_ratio.kind == "assumption" and p.cpu_attention_fraction.kind == "assumption"
    assert p.gpu_fixed_us.kind == "assumption" and 10 <= p.gpu_fixed_us.value <= 50
    assert p.cpu_fixed_us.kind == "assumption" and 10 <= p.cpu_fixed_us.value <= 50


def test_profile_figures_match_hardware_md():
    a100, v100, h200 = (load_profile(n) for n in PROFILES)
    assert (a100.hbm_gbps.value, a100.h2d_pinned_gbps.value, a100.link_theoretical_gbps.value) == (1940, 25.1, 31.5)
    assert (v100.hbm_gbps.value, v100.h2d_pinned_gbps.value, v100.link_theoretical_gbps.value) == (900, 12, 15.75)
    assert (h200.hbm_gbps.value, h200.h2d_pinned_gbps.value, h200.link_theoretical_gbps.value) == (4800, 35, 63)
    assert a100.cpu_memory_gbps.kind == "spec" and a100.cpu_memory_gbps.value == 188
    assert a100.contention_ratio.kind == "paper"


def test_every_figure_in_the_json_carries_kind_and_source():
    data = json.loads(PROFILES_PATH.read_text())

    def walk(node, path):
        if isinstance(node, dict):
            if "value" in node:
                assert node["kind"] in KINDS, path
                assert node["source"].strip(), path
            if "kind" in node:
                assert node["kind"] in KINDS, path
            for key, child in node.items():
                walk(child, f"{path}.{key}")

    walk(data, "")


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown hardware profile 'b200'") as err:
        load_profile("b200")
    for name in PROFILES:
        assert name in str(err.value)


def test_unknown_model_names_the_known_ones():
    with pytest.raises(ValueError, match="qwen3-30b-a3b"):
        load_model_shape("llama")


@pytest.mark.parametrize("name", PROFILES)
@pytest.mark.parametrize("model", MODELS)
def test_perf_model_is_bytes_over_bandwidth(name, model):
    p, shape = load_profile(name), load_model_shape(model)
    kv = shape["kv_cache_bytes_per_token_per_layer_bf16"]
    m = p.perf_model(shape)
    assert isinstance(m, PerfModel)
    assert m.cpu_s_per_token > 0 and m.transfer_s_per_token > 0
    assert m.cpu_s_per_token == pytest.approx(kv / (p.cpu_effective_gbps * 1e9))
    assert m.transfer_s_per_token == pytest.approx(kv / (p.h2d_pinned_gbps.value * 1e9))
    assert m.cpu_fixed_s == pytest.approx(p.cpu_fixed_us.value * 1e-6)
    assert m.gpu_fixed_s == pytest.approx(p.gpu_fixed_us.value * 1e-6)
    assert p.pageable_s_per_token(shape) == pytest.approx(m.transfer_s_per_token / p.pageable_ratio.value)
    contended = p.perf_model(shape, contended=True)
    assert contended.transfer_s_per_token == pytest.approx(m.transfer_s_per_token / p.contention_ratio.value)
    assert contended.cpu_s_per_token == m.cpu_s_per_token
    # an int shape (bytes per token per layer) gives the same model
    assert p.perf_model(kv) == m


def test_calibrated_cpu_rate_overrides_a_only():
    p, shape = load_profile("a100-pcie-gen4"), load_model_shape("qwen3-30b-a3b")
    m = p.perf_model(shape, cpu_s_per_token=3e-8)
    base = p.perf_model(shape)
    assert m.cpu_s_per_token == 3e-8
    assert (m.transfer_s_per_token, m.cpu_fixed_s, m.gpu_fixed_s) == (
        base.transfer_s_per_token, base.cpu_fixed_s, base.gpu_fixed_s)


@pytest.mark.parametrize("bad", [{}, {"kv_cache_bytes_per_token_per_layer_bf16": 0}, -1, 1.5, True])
def test_bad_shapes_are_rejected(bad):
    with pytest.raises(ValueError):
        kv_bytes_per_token_per_layer(bad)


# ---------------------------------------------------------------- simulation


def _costs(profile="a100-pcie-gen4", model="qwen3-30b-a3b", **kwargs):
    return sim.costs_for(load_profile(profile), load_model_shape(model), **kwargs)


def test_step_accounting_matches_a_hand_computation():
    # 2 layers, A = 1 us, B = 2 us, no fixed costs; 1 sequence, prompt 32, 64 decode steps, window 32.
    costs = sim.Costs(PerfModel(1e-6, 2e-6), pageable_s_per_token=4e-6, num_layers=2)
    w = sim.Workload(batch=1, prompt_tokens=32, final_tokens=96, block_tokens=16, window_tokens=32)
    # 32 steps over 32 spilled tokens, flush, 32 steps over 64
    expect = {
        "all_transfer": (2 * 32 * 2e-6 + 2 * 64 * 2e-6) / 2,
        "all_cpu": (2 * 32 * 1e-6 + 2 * 64 * 1e-6) / 2,
        "monolithic": (2 * 32 * 4e-6 + 2 * 64 * 4e-6) / 2,
        # r = 0.5 places block by block: one block on each side at every write
        "fixed_half": (2 * 16 * 2e-6 + 2 * 32 * 2e-6) / 2,
    }
    for policy, mean in expect.items():
        result = sim.simulate(policy, costs, w, record_curve=True)
        assert result.mean_step_s == pytest.approx(mean), policy
        assert result.steps == 64 and result.final_cpu_tokens + result.final_transfer_tokens == 96
        assert [x for x, _ in result.curve] == [32, 64]


@pytest.mark.parametrize("profile", ["a100-pcie-gen4", "v100-pcie-gen3"])
@pytest.mark.parametrize("model", MODELS)
def test_writescope_beats_the_fixed_shares_and_monolithic_is_slowest(profile, model):
    costs = _costs(profile, model)
    w = sim.Workload(batch=4, prompt_tokens=2048, final_tokens=8192)
    results = sim.simulate_config(costs, w)
    ws = results["writescope"].mean_step_s
    for name in ("all_transfer", "all_cpu", "fixed_half"):
        assert ws <= results[name].mean_step_s * 1.01, name  # 1%: placement granularity (blocks of 16)
    slowest = max(results.values(), key=lambda r: r.mean_step_s)
    assert slowest.policy == "monolithic"
    speedups = sim.speedups(results)
    assert set(speedups) == set(POLICY_NAMES) - {"writescope"}
    assert all(s >= 0.99 for s in speedups.values())


def test_writescope_is_near_the_continuous_optimum():
    """Its placed share tracks r*, so its step time is close to the PerfModel's balanced time."""
    costs = _costs()
    w = sim.Workload(batch=4, prompt_tokens=2048, final_tokens=8192)
    result = sim.simulate("writescope", costs, w)
    spilled = result.final_cpu_tokens + result.final_transfer_tokens
    r_star = costs.model.optimal_share(spilled)
    assert abs(result.placed_cpu_share - r_star) <= w.batch * w.block_tokens / spilled
    # the last decode steps attend all but the final window, which is flushed after the last step
    attended = spilled - w.batch * w.window_tokens
    balanced = costs.num_layers * costs.model.step_time_s(costs.model.optimal_share(attended), attended)
    last = sim.simulate("writescope", costs, w, record_curve=True).curve[-1][1]
    assert balanced <= last <= balanced * 1.01


def test_fixed_policies_place_their_share():
    costs = _costs()
    w = sim.Workload(batch=3, prompt_tokens=2048, final_tokens=4096)
    shares = {name: sim.simulate(name, costs, w).placed_cpu_share
              for name in ("all_transfer", "all_cpu", "fixed_half", "monolithic")}
    assert shares["all_transfer"] == 0 and shares["all_cpu"] == 1 and shares["monolithic"] == 1
    assert shares["fixed_half"] == pytest.approx(0.5, abs=16 / 4096)


def test_spilled_tokens_follow_prefill_and_window_flushes():
    costs = _costs()
    w = sim.Workload(batch=2, prompt_tokens=2050, final_tokens=3000, block_tokens=16, window_tokens=256)
    r = sim.simulate("writescope", costs, w)
    # prompt: 128 full blocks spilled, 2 tokens stay in the window; 950 decode steps flush 3 windows of 256
    assert r.final_cpu_tokens + r.final_transfer_tokens == 2 * (2048 + 3 * 256)


def test_simulation_is_deterministic():
    costs = _costs("v100-pcie-gen3", "mixtral-8x7b")
    w = sim.Workload(batch=4, prompt_tokens=2048, final_tokens=4096)
    first = sim.simulate_config(costs, w, record_curve=True)
    second = sim.simulate_config(costs, w, record_curve=True)
    assert first == second


def test_invalid_workloads_are_rejected():
    with pytest.raises(ValueError):
        sim.Workload(batch=1, window_tokens=100)  # not a multiple of the block
    with pytest.raises(ValueError):
        sim.Workload(batch=1, prompt_tokens=4096, final_tokens=4096)


def test_sweep_summary_and_reports(tmp_path):
    out, md, png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    result = sim.main(["--profiles", "a100-pcie-gen4", "--models", "deepseek-v2-lite", "qwen3-30b-a3b",
                       "--batches", "4", "--final-tokens", "4096", "--curve-batch", "4", "--no-sensitivity",
                       "--out", str(out), "--md", str(md), "--png", str(png), "--log-level", "WARNING"])
    rows = result["main"]["rows"]
    assert len(rows) == 2
    summary = result["main"]["summary"]["a100-pcie-gen4"]
    for b in sim.BASELINES:
        values = [r["speedup"][b] for r in rows]
        assert summary["baselines"][b]["geomean"] == pytest.approx(math.sqrt(values[0] * values[1]))
    assert json.loads(out.read_text())["main"]["rows"] == json.loads(json.dumps(rows))
    text = md.read_text()
    assert "1.52-2.51x" in text and "a100-pcie-gen4" in text and "writescope_frozen" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 300_000


def test_calibrated_cpu_bandwidth_flows_into_the_sweep():
    spec = sim.SweepSpec(profiles=("a100-pcie-gen4",), models=("mixtral-8x7b",), batches=(4,),
                         final_tokens=(4096,), cpu_gbps=40.0)
    row = sim.run_sweep(spec)["rows"][0]
    assert row["cpu_s_per_token"] == pytest.approx(4096 / 40e9)
    slower_cpu = row["r_star_final"]
    default = sim.run_sweep(sim.SweepSpec(profiles=("a100-pcie-gen4",), models=("mixtral-8x7b",), batches=(4,),
                                          final_tokens=(4096,)))["rows"][0]["r_star_final"]
    assert slower_cpu < default


# ---------------------------------------------------------------- contention mid-run


@pytest.mark.parametrize("side,factor", [("link", 25.4 / 14.9), ("cpu", 2.0)])
def test_writescope_rebalances_within_ten_steps_and_beats_its_frozen_share(side, factor):
    """The paper's two-tenant case on the A100 profile, through the real policy and estimator."""
    costs = sim.costs_for(load_profile("a100-pcie-gen4"), load_model_shape("qwen3-30b-a3b"))
    contention = sim.Contention(at_step=1024, side=side, factor=factor)
    results = sim.simulate_contention(costs, sim.Workload(8, 2048, 8192), contention)
    ws, frozen = results["writescope"], results["writescope_frozen"]
    assert ws["mean_step_ms_before"] == pytest.approx(frozen["mean_step_ms_before"])  # the same until the change
    assert ws["r_star_steps_to_converge"] is not None and ws["r_star_steps_to_converge"] <= 10
    assert ws["mean_step_ms_after"] < frozen["mean_step_ms_after"]
    moved = ws["share_final"] - ws["share_before"]
    assert moved > 0 if side == "link" else moved < 0  # a slower link: more on the CPU; a slower CPU: less
    for baseline in sim.BASELINES:
        assert ws["mean_step_ms_after"] <= results[baseline]["mean_step_ms_after"]


def test_contention_arguments_are_checked():
    with pytest.raises(ValueError, match="side link|cpu"):
        sim.Contention(at_step=10, side="disk")
    with pytest.raises(ValueError, match="--contention-step"):
        sim.run_contention("a100-pcie-gen4", "qwen3-30b-a3b", 4, 10**9)
