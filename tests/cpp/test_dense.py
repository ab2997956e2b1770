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


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])  # float32: DeepSeek-V2's routing
@pytest.mark.parametrize("tokens,top_k,num_experts,hidden,intermediate",
                         [(4, 2, 8, 128, 64), (1, 2, 4, 128, 128), (3, 8, 16, 64, 40), (2, 2, 4, 512, 1536)])
def test_routed_experts_match_the_gathered_torch_path(variant, tokens, top_k, num_experts, hidden, intermediate,
                                                      weights_dtype):
    x, weights, experts, gate_up, down = experts_inputs(tokens, top_k, num_experts, hidden, intermediate)
    if weights_dtype == torch.float32:  # off the bf16 grid: the products' roundings see the difference
        weights = weights.float() * (1 + 2.0**-12)
        as_bf16 = dense.routed_experts(x, weights.to(torch.bfloat16), experts, gate_up, down)
        assert not torch.equal(dense.routed_experts(x, weights, experts, gate_up, down), as_bf16)
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
    with pytest.raises(ValueError, match=r"weights: element type 'float64'; allowed: bf16 \(as 16-bit integers\) or "
                                         "float32"):
        _cpu.moe_experts_bf16(bits(x), weights.double().numpy(), experts.numpy(), bits(gate_up), bits(down), out)


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


def separate_gqa_inputs(hidden, norm_weight, qkv_weight, q_norm, k_norm, cos, sin, num_q_heads, num_kv_heads,
                        head_dim, eps=1e-6):
    """The GQA inputs as the model computed them before the fused call: one op at a time."""
    from writescope.models import layers

    tokens = hidden.shape[0]
    x = layers.rms_norm(hidden, norm_weight, eps)
    q, k, v = dense.linear(x, qkv_weight).split([num_q_heads * head_dim, num_kv_heads * head_dim,
                                                 num_kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, num_q_heads, head_dim), k.view(tokens, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = layers.rms_norm(q, q_norm, eps), layers.rms_norm(k, k_norm, eps)
    rotated = [layers.apply_rope_rotate_half(t, cos, sin) for t in (q, k)]
    return (*rotated, v.reshape(tokens, num_kv_heads, head_dim))


def gqa_case(tokens, hidden_size, num_q_heads, num_kv_heads, head_dim, with_norms, seed=40):
    from writescope.models import layers

    outputs = (num_q_heads + 2 * num_kv_heads) * head_dim
    hidden = bf16(tokens, hidden_size, seed=seed, scale=2.0)
    weights = [bf16(hidden_size, seed=seed + 1), bf16(outputs, hidden_size, seed=seed + 2, scale=0.2)]
    norms = [bf16(head_dim, seed=seed + 3), bf16(head_dim, seed=seed + 4)] if with_norms else [None, None]
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    positions = torch.randint(0, 1 << 17, (tokens,), generator=torch.Generator().manual_seed(seed))
    cos, sin = layers.rope_rotate_half_tables(positions, inv_freq, 1.0, torch.bfloat16)  # [tokens, 1, head_dim]
    return hidden, *weights, *norms, cos, sin


# tokens, hidden_size, num_q_heads, num_kv_heads, head_dim, q/k norms: Qwen3's and Mixtral's, one token,
# a head_dim that is not a whole vector, and a product big enough for the pool.
GQA_SHAPES = [(4, 128, 8, 2, 32, True), (3, 128, 8, 2, 16, False), (1, 64, 4, 4, 8, True),
              (5, 96, 6, 3, 10, False), (2, 1024, 16, 4, 128, True)]


@pytest.mark.parametrize("tokens,hidden_size,num_q_heads,num_kv_heads,head_dim,with_norms", GQA_SHAPES)
def test_gqa_inputs_are_the_separate_ops_bit_for_bit(variant, tokens, hidden_size, num_q_heads, num_kv_heads,
                                                    head_dim, with_norms):
    case = gqa_case(tokens, hidden_size, num_q_heads, num_kv_heads, head_dim, with_norms)
    fused = dense.gqa_inputs(case[0], case[1], 1e-6, *case[2:], num_q_heads, num_kv_heads, head_dim)
    assert fused is not None
    separate = separate_gqa_inputs(*case, num_q_heads, num_kv_heads, head_dim)
    for name, a, b in zip("qkv", fused, separate, strict=True):
        assert a.shape == b.shape and torch.equal(a, b), name


def test_gqa_inputs_rope_rounds_as_torch_bf16_ops_do():
    """rope alone against torch's bf16 ops, where every value is rounded: head norms off and an
    identity projection, so q is the normalised row itself."""
    from writescope.models import layers

    hidden_size = head_dim = 32
    hidden, norm_weight, _, _, _, cos, sin = gqa_case(3, hidden_size, 1, 1, head_dim, False, seed=50)
    identity = torch.eye(head_dim, dtype=torch.bfloat16)
    q, k, v = dense.gqa_inputs(hidden, norm_weight, 1e-6, torch.cat([identity] * 3), None, None, cos, sin, 1, 1,
                               head_dim)
    normed = layers.rms_norm(hidden, norm_weight, 1e-6)[:, None, :]
    x1, x2 = normed[..., :16], normed[..., 16:]
    expected = normed * cos + torch.cat((-x2, x1), dim=-1) * sin  # torch's bf16 ops
    assert torch.equal(q, expected) and torch.equal(k, expected) and torch.equal(v, normed)


def test_gqa_inputs_leave_a_prefill_float32_and_odd_widths_to_torch():
    case = gqa_case(2, 64, 4, 2, 8, True)
    args = (4, 2, 8)
    assert dense.gqa_inputs(case[0].float(), case[1], 1e-6, *case[2:], *args) is None
    many = gqa_case(dense.MAX_DECODE_ROWS + 1, 64, 4, 2, 8, True)
    assert dense.gqa_inputs(many[0], many[1], 1e-6, *many[2:], *args) is None
    assert dense.gqa_inputs(case[0], case[1], 1e-6, *case[2:5], case[5][:1], case[6][:1], *args) is None  # tables


def test_gqa_inputs_bad_arguments_name_what_was_wrong():
    hidden, norm_weight, qkv_weight, q_norm, k_norm, cos, sin = gqa_case(2, 64, 4, 2, 8, True)
    q, k, v = (torch.empty(2, heads, 8, dtype=torch.bfloat16) for heads in (4, 2, 2))
    good = [bits(hidden), bits(norm_weight), 1e-6, bits(qkv_weight), bits(q_norm), bits(k_norm),
            bits(cos.reshape(2, 8)), bits(sin.reshape(2, 8)), bits(q), bits(k), bits(v)]
    _cpu.gqa_inputs_bf16(*good)
    cases = [
        (3, bits(qkv_weight[:-8].contiguous()), r"qkv_weight: dimension 0 \(\(num_q_heads \+ 2 \* num_kv_heads\)"),
        (6, bits(cos.reshape(2, 8)[:1].contiguous()), r"cos: dimension 0 \(tokens, as in hidden\) must be 2"),
        (4, bits(q_norm[:4].contiguous()), r"q_norm: dimension 0 \(head_dim, as in q\) must be 8"),
        (10, bits(torch.empty(2, 2, 6, dtype=torch.bfloat16)), r"v: dimension 2 \(as in k\) must be 8"),
        (2, -1.0, "eps must be finite and >= 0"),
        (0, hidden.float().numpy(), "hidden: element type 'float32' does not match"),
    ]
    for index, value, message in cases:
        with pytest.raises(ValueError, match=message):
            _cpu.gqa_inputs_bf16(*good[:index], value, *good[index + 1:])
    readonly = bits(torch.empty(2, 4, 8, dtype=torch.bfloat16))
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="q: .*writ"):
        _cpu.gqa_inputs_bf16(*good[:8], readonly, *good[9:])


OUTPUT_SHAPES = [(4, 8, 32, 128), (1, 4, 10, 66), (3, 16, 128, 512)]  # tokens, num_q_heads, head_dim, hidden_size


@pytest.mark.parametrize("tokens,num_q_heads,head_dim,hidden_size", OUTPUT_SHAPES)
def test_output_projection_is_the_separate_ops_bit_for_bit(variant, tokens, num_q_heads, head_dim, hidden_size):
    attention = torch.randn(tokens, num_q_heads, head_dim, generator=torch.Generator().manual_seed(60))
    weight, residual = bf16(hidden_size, num_q_heads * head_dim, seed=61, scale=0.1), bf16(tokens, hidden_size, seed=62)
    fused = dense.output_projection(attention, weight, residual)
    separate = residual + dense.linear(attention.to(torch.bfloat16).reshape(tokens, -1), weight)
    assert fused is not None and torch.equal(fused, separate)


def test_output_projection_leaves_other_dtypes_and_bad_shapes_to_torch():
    attention, weight, residual = torch.randn(2, 4, 8), bf16(32, 32, seed=63), bf16(2, 32, seed=64)
    assert dense.output_projection(attention, weight, residual) is not None
    assert dense.output_projection(attention.to(torch.bfloat16), weight, residual) is None
    assert dense.output_projection(attention, weight.float(), residual.float()) is None
    assert dense.output_projection(attention[:, :3], weight, residual) is None  # widths differ: torch says how
    with pytest.raises(ValueError, match=r"residual: dimension 1 \(hidden_size, as in weight\) must be 32"):
        _cpu.output_projection_bf16(attention.reshape(2, 32).numpy(), bits(weight), bits(bf16(2, 30)),
                                    bits(torch.empty(2, 32, dtype=torch.bfloat16)))


def separate_moe_feed_forward(hidden, norm_weight, router_weight, gate_up, down, top_k, normalize, eps=1e-6):
    """The MoE layer as the model computed it before the fused call, routed by torch.topk."""
    from writescope.models import layers

    x = layers.rms_norm(hidden, norm_weight, eps)
    logits = dense.linear(x, router_weight)
    weights, experts = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return hidden + dense.routed_experts(x, weights.to(torch.bfloat16), experts, gate_up, down)


def moe_case(tokens, hidden_size, num_experts, intermediate, seed):
    return (bf16(tokens, hidden_size, seed=seed, scale=2.0), bf16(hidden_size, seed=seed + 1),
            bf16(num_experts, hidden_size, seed=seed + 2, scale=0.3),
            bf16(num_experts, 2 * intermediate, hidden_size, seed=seed + 3, scale=0.1),
            bf16(num_experts, hidden_size, intermediate, seed=seed + 4, scale=0.1))


# tokens, hidden_size, num_experts, intermediate, top_k, normalize: tiny Qwen3's and Mixtral's, one
# token, Qwen3-30B's 8 of 128 at a small width, every expert.
MOE_SHAPES = [(4, 128, 8, 64, 2, True), (3, 128, 4, 128, 2, True), (1, 64, 8, 32, 2, False),
              (4, 64, 128, 16, 8, True), (2, 32, 4, 8, 4, False)]


@pytest.mark.parametrize("tokens,hidden_size,num_experts,intermediate,top_k,normalize", MOE_SHAPES)
def test_moe_feed_forward_is_the_separate_ops_bit_for_bit(variant, tokens, hidden_size, num_experts, intermediate,
                                                         top_k, normalize):
    """Over many draws: the fused layer equals the separate ops (torch's routing) wherever it does not
    decline, and declines only where torch.topk's tie order would decide."""
    compared = 0
    for seed in range(100, 140):
        case = moe_case(tokens, hidden_size, num_experts, intermediate, seed)
        fused = dense.moe_feed_forward(case[0], case[1], 1e-6, *case[2:], top_k, normalize)
        if fused is None:
            continue
        compared += 1
        assert torch.equal(fused, separate_moe_feed_forward(*case, top_k, normalize)), seed
    # a decline is a tie at the choice among bf16 logits: a few draws in forty at 8 experts, 12 at 128
    assert compared >= 20


def test_moe_feed_forward_declines_a_tie_at_the_choice_and_a_nan():
    hidden, norm_weight, router_weight, gate_up, down = moe_case(2, 32, 4, 8, seed=150)
    hidden, norm_weight = hidden.abs(), norm_weight.abs()
    tied = router_weight.clone()
    tied[1] = tied[2] = 0.5  # experts 1 and 2 share the largest logit, the rest far below it
    tied[0] = tied[3] = -0.5
    assert dense.moe_feed_forward(hidden, norm_weight, 1e-6, tied, gate_up, down, 1, True) is None  # one of two
    both = dense.moe_feed_forward(hidden, norm_weight, 1e-6, tied, gate_up, down, 2, True)  # the tie orders slots
    assert both is not None and torch.equal(both, separate_moe_feed_forward(hidden, norm_weight, tied, gate_up, down,
                                                                          2, True))
    assert dense.moe_feed_forward(hidden, norm_weight, 1e-6, tied, gate_up, down, 3, True) is None  # 0 or 3 third
    hidden[1, 3] = float("nan")
    assert dense.moe_feed_forward(hidden, norm_weight, 1e-6, router_weight, gate_up, down, 2, True) is None


def test_moe_feed_forward_bad_arguments_name_what_was_wrong():
    hidden, norm_weight, router_weight, gate_up, down = moe_case(2, 32, 4, 8, seed=160)
    out = torch.empty(2, 32, dtype=torch.bfloat16)
    good = [bits(hidden), bits(norm_weight), 1e-6, bits(router_weight), bits(gate_up), bits(down), 2, True, bits(out)]
    assert _cpu.moe_feed_forward_bf16(*good) is True
    cases = [
        (6, 0, r"top_k must be 1 to num_experts \(4\), got 0"),
        (6, 5, r"top_k must be 1 to num_experts \(4\), got 5"),
        (3, bits(router_weight[:, :30].contiguous()), r"router_weight: dimension 1 \(hidden_size, as in hidden\)"),
        (5, bits(down[:3].contiguous()), r"down: dimension 0 \(num_experts, as in router_weight\) must be 4"),
        (4, bits(gate_up[:, :14].contiguous()), r"gate_up: dimension 1 \(2 \* intermediate, intermediate as in down\)"),
        (2, float("nan"), "eps must be finite and >= 0"),
    ]
    for index, value, message in cases:
        with pytest.raises(ValueError, match=message):
            _cpu.moe_feed_forward_bf16(*good[:index], value, *good[index + 1:])
