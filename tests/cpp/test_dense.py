"""The decode step's dense products and norms (writescope.dense: _cpu.linear_bf16, _cpu.moe_experts_bf16,
_cpu.rms_norm_bf16) against torch on the same bf16 inputs, on every ISA variant this CPU runs, and
their argument checks."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from writescope import _cpu, dense
from writescope.models.moe_model import _gathered_experts


@pytest.fixture(params=_cpu.available_variants())
def variant(request):
    before = _cpu.__cpu_variant__
    _cpu.set_variant(request.param)
    yield request.param
    _cpu.set_variant(before)


def bits(t):
    return t.view(torch.int16).numpy()


def bf16(*shape, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)


def assert_within_one_rounding(actual, expected):
    """bf16 results that may differ from torch's only by where a float32 sum rounds: at most one bf16
    step of the larger magnitude, on few elements."""
    actual, expected = actual.float(), expected.float()
    step = torch.maximum(actual.abs(), expected.abs()) * 2.0**-7 + 1e-30
    assert ((actual - expected).abs() <= step).all(), (actual - expected).abs().max()
    assert (actual != expected).float().mean() < 0.02


# rows x in_features x out_features: a decode step's shapes, a width that is not a whole vector
# (130 = 65 pairs), one row, more rows than one pass of four, and a product big enough for the pool.
LINEAR_SHAPES = [(4, 128, 384), (1, 128, 320), (7, 130, 33), (5, 2, 3), (4, 1024, 2048)]


@pytest.mark.parametrize("rows,in_features,out_features", LINEAR_SHAPES)
def test_linear_matches_torch_to_one_rounding(variant, rows, in_features, out_features):
    x, w = bf16(rows, in_features, seed=1), bf16(out_features, in_features, seed=2, scale=0.1)
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    _cpu.linear_bf16(bits(x), bits(w), bits(out))
    exact = x.double() @ w.double().t()
    assert_within_one_rounding(out, exact.to(torch.bfloat16))
    assert_within_one_rounding(out, F.linear(x, w))


def test_linear_keeps_nan_and_inf():
    x = bf16(2, 8, seed=3)
    x[0, 3] = float("nan")
    x[1, 0] = float("inf")
    w = bf16(4, 8, seed=4).abs()
    out = torch.empty(2, 4, dtype=torch.bfloat16)
    _cpu.linear_bf16(bits(x), bits(w), bits(out))
    assert out[0].isnan().all() and out[1].isposinf().all()


def test_dense_linear_takes_decode_rows_and_leaves_the_rest_to_torch():
    w = bf16(48, 32, seed=5)
    decode = bf16(3, 2, 32, seed=6)  # leading dims flattened, restored
    assert_within_one_rounding(dense.linear(decode, w), F.linear(decode, w))
    assert dense.linear(decode, w).shape == (3, 2, 48)
    prefill = bf16(dense.MAX_DECODE_ROWS + 1, 32, seed=7)
    assert torch.equal(dense.linear(prefill, w), F.linear(prefill, w))
    as_float = decode.float()
    assert torch.equal(dense.linear(as_float, w.float()), F.linear(as_float, w.float()))
    odd = bf16(2, 33, seed=8)
    assert torch.equal(dense.linear(odd, bf16(4, 33, seed=9)), F.linear(odd, bf16(4, 33, seed=9)))


def test_dense_linear_leaves_autograd_to_torch():
    w = bf16(8, 16, seed=10).requires_grad_()
    y = dense.linear(bf16(2, 16, seed=11), w)
    y.float().sum().backward()
    assert w.grad is not None


def experts_inputs(tokens, top_k, num_experts, hidden, intermediate, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = bf16(tokens, hidden, seed=seed + 1)
    gate_up = bf16(num_experts, 2 * intermediate, hidden, seed=seed + 2, scale=0.1)
    down = bf16(num_experts, hidden, intermediate, seed=seed + 3, scale=0.1)
    experts = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1).to(torch.bfloat16)
    return x, weights, experts, gate_up, down


@pytest.mark.parametrize("tokens,top_k,num_experts,hidden,intermediate",
                         [(4, 2, 8, 128, 64), (1, 2, 4, 128, 128), (3, 8, 16, 64, 40), (2, 2, 4, 512, 1536)])
def test_routed_experts_match_the_gathered_torch_path(variant, tokens, top_k, num_experts, hidden, intermediate):
    x, weights, experts, gate_up, down = experts_inputs(tokens, top_k, num_experts, hidden, intermediate)
    assert dense.takes_routed_experts(x, weights, gate_up, down)
    assert_within_one_rounding(dense.routed_experts(x, weights, experts, gate_up, down),
                               _gathered_experts(x, weights, experts, gate_up, down))


def test_routed_experts_against_float64():
    x, weights, experts, gate_up, down = experts_inputs(4, 2, 8, 128, 64, seed=20)
    expected = torch.zeros(4, 128, dtype=torch.float64)
    for t in range(4):
        for s in range(2):
            h = gate_up[experts[t, s]].double() @ x[t].double()
            gate, up = h.chunk(2)
            expected[t] += weights[t, s].double() * (down[experts[t, s]].double() @ (F.silu(gate) * up))
    out = dense.routed_experts(x, weights, experts, gate_up, down).double()
    # bf16 rounds at each of torch's steps: a few bf16 steps of the output's scale apart at most
    assert (out - expected).abs().max() <= expected.abs().max() * 2.0**-5


def linear_args():
    return {"x": bits(bf16(2, 8)), "w": bits(bf16(4, 8)), "out": bits(torch.empty(2, 4, dtype=torch.bfloat16))}


LINEAR_CASES = {
    "x rank": ({"x": bits(bf16(16))}, "x: expected a 2-d"),
    "w element type": ({"w": np.zeros((4, 8), np.float32)}, "w: element type"),
    "in_features differ": ({"w": bits(bf16(4, 6))}, r"w: dimension 1 \(in_features, as in x\) must be 8"),
    "out rows": ({"out": bits(torch.empty(3, 4, dtype=torch.bfloat16))}, "out: dimension 0"),
    "out columns": ({"out": bits(torch.empty(2, 5, dtype=torch.bfloat16))}, "out: dimension 1"),
    "odd in_features": ({"x": bits(bf16(2, 7)), "w": bits(bf16(4, 7))}, "in_features must be even"),
    "x not contiguous": ({"x": bits(bf16(8, 2).t())}, "x: must be C-contiguous"),
}


@pytest.mark.parametrize("case", LINEAR_CASES)
def test_linear_bad_arguments_name_what_was_wrong(case):
    change, message = LINEAR_CASES[case]
    args = {**linear_args(), **change}
    with pytest.raises(ValueError, match=message):
        _cpu.linear_bf16(args["x"], args["w"], args["out"])


def test_linear_refuses_a_readonly_output():
    out = bits(torch.empty(2, 4, dtype=torch.bfloat16)).copy()
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: must be writeable"):
        _cpu.linear_bf16(linear_args()["x"], linear_args()["w"], out)


@pytest.mark.parametrize("bad_expert", [-1, 8, 2**40])
def test_experts_out_of_range_are_refused_before_any_read(bad_expert):
    x, weights, experts, gate_up, down = experts_inputs(4, 2, 8, 16, 8)
    experts[2, 1] = bad_expert
    with pytest.raises(ValueError, match=f"experts: entry 5 is {bad_expert}; allowed: 0 to 7"):
        dense.routed_experts(x, weights, experts, gate_up, down)


def test_experts_shape_mismatches_are_refused():
    x, weights, experts, gate_up, down = experts_inputs(4, 2, 8, 16, 8)
    out = bits(torch.empty(4, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="down: dimension 0 .num_experts, as in gate_up."):
        _cpu.moe_experts_bf16(bits(x), bits(weights), experts.numpy(), bits(gate_up), bits(down[:4].contiguous()), out)
    with pytest.raises(ValueError, match="experts: expected int64"):
        _cpu.moe_experts_bf16(bits(x), bits(weights), experts.int().numpy(), bits(gate_up), bits(down), out)
    with pytest.raises(ValueError, match="weights: dimension 0 .tokens, as in x."):
        _cpu.moe_experts_bf16(bits(x), bits(weights[:3].contiguous()), experts.numpy(), bits(gate_up), bits(down), out)


@pytest.mark.parametrize("shape", [(4, 128), (4, 4, 32), (3, 1, 32), (2, 2048), (1, 6)])
def test_rms_norm_is_torch_bit_for_bit(shape):
    from writescope.models import layers

    x, weight = bf16(*shape, seed=30, scale=3.0), bf16(shape[-1], seed=31)
    fused = dense.rms_norm(x, weight, 1e-6)
    assert fused is not None and fused.shape == x.shape
    dense.use_cpu_kernels = False
    try:
        assert dense.rms_norm(x, weight, 1e-6) is None  # turned off: the caller's torch path
        reference = layers.rms_norm(x, weight, 1e-6)
    finally:
        dense.use_cpu_kernels = True
    assert torch.equal(fused, reference)


def test_rms_norm_of_a_prefill_or_another_dtype_is_left_to_torch():
    weight = bf16(32, seed=32)
    assert dense.rms_norm(bf16(dense.MAX_NORM_ELEMENTS // 32 + 1, 32), weight, 1e-6) is None
    assert dense.rms_norm(bf16(4, 32).float(), weight.float(), 1e-6) is None
    assert dense.rms_norm(bf16(4, 16), weight, 1e-6) is None  # widths differ: torch says how


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf")])
def test_rms_norm_refuses_a_bad_eps(eps):
    out = bits(torch.empty(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        _cpu.rms_norm_bf16(bits(bf16(2, 8)), bits(bf16(8)), eps, out)


def test_rms_norm_refuses_a_weight_of_another_width():
    out = bits(torch.empty(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"weight: dimension 0 \(dim, as in x\) must be 8"):
        _cpu.rms_norm_bf16(bits(bf16(2, 8)), bits(bf16(6)), 1e-6, out)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2", "tiny-deepseek-v4"])
def test_a_bf16_engine_through_the_kernels_is_as_close_to_float32_as_through_torch(preset, monkeypatch):
    """The same weights decoded in float32, and in bf16 with the decode steps' dense products through
    the kernels and through torch: the kernels' logits are as close to float32's as torch's are (each
    decode step's logits while the three runs' tokens agree; random tiny weights have near-ties, so
    the runs may part later)."""
    from writescope.engine import Engine

    calls = []
    real_cpu = dense._cpu

    class Counted:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real_cpu(), name)

    monkeypatch.setattr(dense, "_cpu", Counted)
    prompts = [torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]
    outputs = {}
    for run, dtype, kernels in (("kernels", "bfloat16", True), ("torch", "bfloat16", False),
                                ("float32", "float32", True)):
        monkeypatch.setattr(dense, "use_cpu_kernels", kernels)
        engine = Engine.from_pretrained(preset, policy="fixed_half", dtype=dtype, max_batch_size=3, max_seq_len=256,
                                        enable_prefix_caching=False)
        try:
            outputs[run] = engine.generate(prompts, max_new_tokens=8, return_logits=True)
        finally:
            engine.shutdown()
        # the bf16 decode steps took the kernels; turned off, or in float32, nothing reaches them
        assert ("linear_bf16" in calls) == (run == "kernels")
        calls.clear()
    errors = {"kernels": [], "torch": []}
    for kernels, torch_path, exact in zip(outputs["kernels"], outputs["torch"], outputs["float32"], strict=True):
        for step, tokens in enumerate(zip(kernels.token_ids, torch_path.token_ids, exact.token_ids, strict=False)):
            for run, out in (("kernels", kernels), ("torch", torch_path)):
                errors[run].append(float((out.logits[step] - exact.logits[step]).abs().max()))
            if len(set(tokens)) > 1:
                break
    assert max(errors["kernels"]) <= 2 * max(errors["torch"]) + 1e-3, errors
