"""The MoE layer's two ways through the routed experts: every (token, expert) pair at once over the
gathered weights (a decode step's few tokens), or each chosen expert once over its tokens (a
prefill, cold experts). Both against a plain per-pair loop of torch math."""

import pytest
import torch

from writescope.loading import load_model
from writescope.models.layers import rms_norm, swiglu
from writescope.models.moe_model import MoEModel

MOE_PRESETS = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2"]


def moe_model(preset: str, hot_experts=None) -> MoEModel:
    config, weights, _, _ = load_model(preset, "float32")
    return MoEModel(config, weights, hot_experts=hot_experts)


def first_moe_layer(model: MoEModel) -> int:
    return next(layer for layer in range(model.config.num_layers) if model.config.is_moe_layer(layer))


def routed_reference(model: MoEModel, layer: int, x: torch.Tensor) -> torch.Tensor:
    """The routed experts' sum, one (token, chosen expert) pair at a time."""
    weights, experts = model._route(layer, x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            gate_up, down = (model.w[n] for n in model._expert_names(layer, int(experts[t, j])))
            out[t] += swiglu(x[t:t + 1], gate_up, down)[0] * weights[t, j]
    return out


def shared_experts(model: MoEModel, layer: int, x: torch.Tensor) -> torch.Tensor:
    if not model.config.n_shared_experts:
        return torch.zeros_like(x)
    p = f"model.layers.{layer}.mlp.shared_experts."
    return swiglu(x, model.w[p + "gate_up_proj.weight"], model.w[p + "down_proj.weight"])


@pytest.mark.parametrize("preset", MOE_PRESETS)
@pytest.mark.parametrize("tokens", [1, 2, 64])
def test_the_routed_experts_match_a_per_pair_loop(preset, tokens):
    model = moe_model(preset)
    layer = first_moe_layer(model)
    x = torch.randn(tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(tokens))
    expected = routed_reference(model, layer, x) + shared_experts(model, layer, x)
    torch.testing.assert_close(model._moe(layer, x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_a_decode_step_takes_the_gathered_path_and_a_prefill_the_per_expert_one(preset, monkeypatch):
    model = moe_model(preset)
    layer = first_moe_layer(model)
    one_by_one = []
    original = model._experts_one_by_one
    monkeypatch.setattr(model, "_experts_one_by_one", lambda *args: one_by_one.append(1) or original(*args))
    hidden = model.config.hidden_size
    model._moe(layer, torch.randn(1, hidden))  # 1 x top_k pairs <= num_experts
    assert one_by_one == []
    model._moe(layer, torch.randn(model.config.num_experts, hidden))  # more pairs than experts
    assert one_by_one == [1]


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_stacked_experts_hold_each_weight_once(preset):
    model = moe_model(preset)
    for layer, (gate_up, down) in model.stacked_experts.items():
        for e in range(model.config.num_experts):
            gate_up_name, down_name = model._expert_names(layer, e)
            assert model.w[gate_up_name].data_ptr() == gate_up[e].data_ptr()
            assert model.w[down_name].data_ptr() == down[e].data_ptr()
    moe_layers = [layer for layer in range(model.config.num_layers) if model.config.is_moe_layer(layer)]
    assert sorted(model.stacked_experts) == moe_layers


def test_cold_experts_on_the_engines_device_give_the_same_result():
    # a CPU engine's cold experts are on its device too: the layer is stacked all the same
    hot, mixed = moe_model("tiny-mixtral"), moe_model("tiny-mixtral", hot_experts=2)
    assert sorted(mixed.stacked_experts) == sorted(hot.stacked_experts) == [0, 1, 2, 3]
    layer = first_moe_layer(hot)
    x = torch.randn(2, hot.config.hidden_size, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(hot._moe(layer, x), mixed._moe(layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_cold_experts_beside_a_gpu_are_not_stacked_and_give_the_same_result():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    config, weights, _, _ = load_model("tiny-mixtral", "float32")
    results = []
    for hot_experts in (None, 2):
        on_device = {name: tensor.to("cuda") for name, tensor in weights.items()}
        model = MoEModel(config, on_device, device="cuda", hot_experts=hot_experts)
        assert bool(model.stacked_experts) == (hot_experts is None)
        x = torch.randn(2, config.hidden_size, generator=torch.Generator().manual_seed(1)).to("cuda")
        results.append(model._moe(first_moe_layer(model), x).cpu())
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 4, 33])
def test_the_absorbed_mla_query_and_output_are_the_float64_math_rounded_once(tokens):
    """On a CPU W_UK and W_UV are kept in float32 (torch's bf16 batched matmul there is a plain loop):
    the absorbed query and the per-head values are the exact products of the bf16 operands, rounded to
    bf16 once."""
    config, weights, _, _ = load_model("tiny-deepseek-v2", "bfloat16")
    model = MoEModel(config, weights)
    assert model.w["absorbed.0.w_uk"].dtype == model.w["absorbed.0.w_uv"].dtype == torch.float32
    kv_b = weights["model.layers.0.self_attn.kv_b_proj.weight"].double().view(
        config.num_q_heads, config.qk_nope_head_dim + config.v_head_dim, config.kv_lora_rank)
    w_uk, w_uv = kv_b[:, : config.qk_nope_head_dim], kv_b[:, config.qk_nope_head_dim:]
    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, config.hidden_size, generator=generator).to(torch.bfloat16)
    rope = model.rope(torch.arange(tokens))
    q, _ = model.attention_inputs(0, hidden, rope)
    x = rms_norm(hidden, model.w["model.layers.0.input_layernorm.weight"], config.rms_norm_eps)
    q_full = (x.double() @ weights["model.layers.0.self_attn.q_proj.weight"].double().T).to(torch.bfloat16)
    q_nope = q_full.view(tokens, config.num_q_heads, -1)[..., : config.qk_nope_head_dim]
    expected_latent = torch.einsum("thn,hnc->thc", q_nope.double(), w_uk).to(torch.bfloat16)
    assert torch.equal(q[..., : config.kv_lora_rank], expected_latent)

    attention = torch.randn(tokens, config.num_q_heads, config.kv_lora_rank, generator=generator)
    values = torch.einsum("thc,hvc->thv", attention.to(torch.bfloat16).double(), w_uv).to(torch.bfloat16)
    o_proj = weights["model.layers.0.self_attn.o_proj.weight"]
    expected_out = hidden + (values.reshape(tokens, -1).double() @ o_proj.double().T).to(torch.bfloat16)
    torch.testing.assert_close(model.attention_output(0, attention, hidden), expected_out, rtol=0, atol=0)


def test_a_deepseek_v2_decode_step_routes_its_float32_weights_through_the_cpu_kernel(monkeypatch):
    """DeepSeek-V2 keeps its routing weights in float32; on a CPU its decode MoE runs the C++ routed
    experts with them (the torch gathered path's bf16 batched matmuls were 16x slower at V2-Lite's
    shape), to within one bf16 rounding of that path."""
    from writescope import dense
    from writescope.models.moe_model import _gathered_experts

    config, weights, _, _ = load_model("tiny-deepseek-v2", "bfloat16")
    model = MoEModel(config, weights)
    layer = first_moe_layer(model)
    x = torch.randn(2, config.hidden_size, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    calls = []
    original = dense.routed_experts
    monkeypatch.setattr(dense, "routed_experts", lambda *args: calls.append(args[1].dtype) or original(*args))
    out = model._moe(layer, x)
    assert calls == [torch.float32]
    route_weights, experts = model._route(layer, x)
    expected = _gathered_experts(x, route_weights, experts, *model.stacked_experts[layer]) + shared_experts(
        model, layer, x)
    assert (out.float() - expected.float()).abs().max() <= expected.float().abs().max() * 2.0**-7
