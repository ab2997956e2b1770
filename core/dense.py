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

# Rows above this are a prefill's: torch's blocked matmul is the better tool there.
MAX_DECODE_ROWS = 64
# A decode step's norms (its rows times the heads for q and k norms); a prefill's go to torch's
# vectorised, threaded ops.
MAX_NORM_ELEMENTS = 1 << 16
# Tests and benchmarks turn the kernels off to compare against torch on the same weights.
use_cpu_kernels = True


def _cpu():
    from writescope import _cpu

    return _cpu


def _bits(t):
    # bf16 tensor -> numpy int16 view of the same memory (numpy has no bfloat16)
    return t.detach().view(torch.int16).numpy()


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
    _cpu().linear_bf16(_bits(x_rows), _bits(weight), _bits(out))
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
    _cpu().rms_norm_bf16(_bits(rows), _bits(weight), float(eps), _bits(out))
    return out.view(x.shape)


def takes_routed_experts(x, weights, gate_up, down) -> bool:
    """Whether routed_experts runs these (else the caller's torch path does)."""
    return (_takes(x, weights, gate_up, down) and x.dim() == 2 and 0 < x.shape[0] <= MAX_DECODE_ROWS
            and x.shape[1] % 2 == 0 and down.shape[-1] % 2 == 0)


def routed_experts(x, weights, experts, gate_up, down):
    """x [T, hidden] bf16, weights [T, top_k] bf16, experts [T, top_k] int64, gate_up [E, 2 * inter,
    hidden], down [E, hidden, inter] -> [T, hidden] bf16: sum over slots of weight x down(silu(gate) *
    up) of the slot's expert, each expert's weights read in place (no gather)."""
    out = torch.empty_like(x)
    _cpu().moe_experts_bf16(_bits(x.contiguous()), _bits(weights.contiguous()),
                            experts.to(torch.int64).contiguous().numpy(), _bits(gate_up), _bits(down), _bits(out))
    return out
