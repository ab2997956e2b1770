"""A decode step's dense products (and its RMSNorms) on the CPU: the step's few rows times bf16
weights, through the C++ extension.

torch's bf16 matmul on a CPU without bf16 dot products (AVX2, AVX-512 without BF16) runs a loop of
about 3 GMAC/s (measured on a 2-vCPU Zen 3: 66 us for 4 rows x [384, 128]), so on such a host a
decode step's projections and experts cost more than they need to. The extension reads each
weight matrix once for all rows, widening bf16 to float32 in registers (`tools/bench_moe.py`
times a decode step through these kernels against torch's paths). Results are torch's to float32
rounding order: products accumulate in float32 and round to bf16 where torch's bf16 ops round.

Anything else (more rows than a decode step's, other dtypes, other devices, odd widths, autograd)
goes to torch unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from writescope import ops

# Rows above this are a prefill's: torch's blocked matmul is the better tool there.
MAX_DECODE_ROWS = 64
# A decode step's norms (its rows times the heads for q and k norms); a prefill's go to torch's
# vectorised, threaded ops.
MAX_NORM_ELEMENTS = 1 << 16
# Tests and benchmarks turn the kernels off to compare against torch on the same weights.
use_cpu_kernels = True
# ... and a layer's fused calls (gqa_inputs, output_projection, moe_feed_forward) off, to compare with
# the same kernels called one op at a time.
use_fused_layers = True


# The extension, imported on first use (ops keeps the one cached lookup).
_cpu = ops._cpu_module


def _bits(t):
    # bf16 tensor -> numpy int16 view of the same memory (numpy has no bfloat16)
    return t.detach().view(torch.int16).numpy()


def _weight_bits(weight):
    """_bits of a weight, made once and kept on the tensor (ops.kept_numpy_view): a decode step passes
    each weight every step."""
    return ops.kept_numpy_view(weight)


def _takes(x, *weights) -> bool:
    return (use_cpu_kernels and x.device.type == "cpu" and x.dtype == torch.bfloat16
            and all(w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous() for w in weights)
            and not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))))


def linear(x, weight):
    """x [..., in_features], weight [out_features, in_features] -> [..., out_features], as F.linear."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (_takes(x, weight) and weight.dim() == 2 and 0 < rows <= MAX_DECODE_ROWS and x.shape[-1] % 2 == 0):
        return F.linear(x, weight)
    x_rows = x.reshape(rows, x.shape[-1]).contiguous()
    out = torch.empty((rows, weight.shape[0]), dtype=torch.bfloat16)
    _cpu().linear_bf16(_bits(x_rows), _weight_bits(weight), _bits(out))
    return out.view(*x.shape[:-1], weight.shape[0])


def rms_norm(x, weight, eps: float):
    """x [..., dim] bf16, weight [dim] bf16 -> [..., dim]: the reference models' RMSNorm (float32
    statistics, the normalised row rounded to bf16, times the weight) in one call; None when these
    are not the C++ kernel's (the caller's torch path runs them)."""
    if not (_takes(x, weight) and weight.dim() == 1 and x.dim() >= 1 and x.shape[-1] == weight.shape[0]
            and 0 < x.numel() <= MAX_NORM_ELEMENTS):
        return None
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    _cpu().rms_norm_bf16(_bits(rows), _weight_bits(weight), float(eps), _bits(out))
    return out.view(x.shape)


def takes_routed_experts(x, weights, gate_up, down) -> bool:
    """Whether routed_experts runs these (else the caller's torch path does). The routing weights may
    be float32 (DeepSeek-V2's) as well as bf16."""
    weights_taken = (weights.dtype in (torch.bfloat16, torch.float32) and weights.device.type == "cpu"
                     and not weights.requires_grad)
    return (weights_taken and _takes(x, gate_up, down) and x.dim() == 2 and 0 < x.shape[0] <= MAX_DECODE_ROWS
            and x.shape[1] % 2 == 0 and down.shape[-1] % 2 == 0)


def routed_experts(x, weights, experts, gate_up, down):
    """x [T, hidden] bf16, weights [T, top_k] bf16 or float32, experts [T, top_k] int64, gate_up [E,
    2 * inter, hidden], down [E, hidden, inter] -> [T, hidden] bf16: sum over slots of weight x
    down(silu(gate) * up) of the slot's expert, each expert's weights read in place (no gather)."""
    out = torch.empty_like(x)
    weights = weights.detach().contiguous()
    weights = weights.numpy() if weights.dtype == torch.float32 else _bits(weights)
    _cpu().moe_experts_bf16(_bits(x.contiguous()), weights,
                            experts.to(torch.int64).contiguous().numpy(), _weight_bits(gate_up), _weight_bits(down),
                            _bits(out))
    return out


def gqa_inputs(hidden, norm_weight, eps: float, qkv_weight, q_norm, k_norm, cos, sin, num_q_heads: int,
               num_kv_heads: int, head_dim: int):
    """A GQA layer's attention inputs for a decode step in one C++ call, or None when these are not
    the kernel's (the caller's torch path runs them). hidden [T, hidden_size] bf16; norm_weight
    [hidden_size]; qkv_weight [(num_q_heads + 2 * num_kv_heads) * head_dim, hidden_size]; q_norm,
    k_norm [head_dim] or None; cos, sin [T, 1, head_dim] (the step's rope tables) -> (q [T,
    num_q_heads, head_dim], k, v [T, num_kv_heads, head_dim]) bf16, bit for bit the separate ops'.
    One call instead of about twenty torch ops a layer, each 2-20 us of dispatch on a small host."""
    norms = [w for w in (q_norm, k_norm) if w is not None]
    tokens = hidden.shape[0] if hidden.dim() == 2 else 0
    if not (use_fused_layers and _takes(hidden, norm_weight, qkv_weight, cos, sin, *norms)
            and 0 < tokens <= MAX_DECODE_ROWS and hidden.shape[1] % 2 == 0 and head_dim % 2 == 0
            and cos.shape == sin.shape == (tokens, 1, head_dim)):
        return None
    q = torch.empty((tokens, num_q_heads, head_dim), dtype=torch.bfloat16)
    k = torch.empty((tokens, num_kv_heads, head_dim), dtype=torch.bfloat16)
    v = torch.empty_like(k)
    _cpu().gqa_inputs_bf16(
        _bits(hidden.contiguous()), _weight_bits(norm_weight), float(eps), _weight_bits(qkv_weight),
        None if q_norm is None else _weight_bits(q_norm), None if k_norm is None else _weight_bits(k_norm),
        _bits(cos.reshape(tokens, head_dim)), _bits(sin.reshape(tokens, head_dim)), _bits(q), _bits(k), _bits(v))
    return q, k, v


def output_projection(attention, weight, residual):
    """residual + linear(attention.to(bf16), weight) in one C++ call, or None when these are not the
    kernel's. attention [T, num_q_heads, head_dim_v] float32, weight [hidden_size, num_q_heads *
    head_dim_v], residual [T, hidden_size] bf16 -> [T, hidden_size] bf16, bit for bit the separate ops'."""
    tokens = attention.shape[0] if attention.dim() >= 2 else 0
    if not (use_fused_layers and _takes(residual, weight) and attention.dtype == torch.float32
            and attention.device.type == "cpu" and 0 < tokens <= MAX_DECODE_ROWS and residual.dim() == 2
            and weight.dim() == 2 and attention.numel() == tokens * weight.shape[1] and weight.shape[1] % 2 == 0
            and not (torch.is_grad_enabled() and attention.requires_grad)):
        return None
    out = torch.empty((tokens, weight.shape[0]), dtype=torch.bfloat16)
    _cpu().output_projection_bf16(attention.reshape(tokens, -1).contiguous().numpy(), _weight_bits(weight),
                                  _bits(residual.contiguous()), _bits(out))
    return out


def moe_feed_forward(hidden, norm_weight, eps: float, router_weight, gate_up, down, top_k: int, normalize: bool):
    """A MoE layer without shared experts, residual included, for a decode step in one C++ call:
    hidden [T, hidden_size] bf16, norm_weight [hidden_size], router_weight [num_experts, hidden_size],
    gate_up [E, 2 * inter, hidden_size], down [E, hidden_size, inter] -> hidden + the layer's experts
    [T, hidden_size] bf16; None when these are not the kernel's, or when a token's routing meets a
    NaN or a tie between its k-th and (k+1)-th largest logits (torch.topk's tie rule then decides, so
    the caller's torch path routes the step). The experts are torch's choice; the weights are its
    softmax in float32, summed in another order (measured: the same bf16 weights in every draw of
    the tests)."""
    tokens = hidden.shape[0] if hidden.dim() == 2 else 0
    if not (use_fused_layers and _takes(hidden, norm_weight, router_weight, gate_up, down)
            and 0 < tokens <= MAX_DECODE_ROWS and hidden.shape[1] % 2 == 0 and down.dim() == 3
            and down.shape[-1] % 2 == 0):
        return None
    out = torch.empty((tokens, hidden.shape[1]), dtype=torch.bfloat16)
    routed = _cpu().moe_feed_forward_bf16(_bits(hidden.contiguous()), _weight_bits(norm_weight), float(eps),
                                          _weight_bits(router_weight), _weight_bits(gate_up), _weight_bits(down),
                                          int(top_k), bool(normalize), _bits(out))
    return out if routed else None
