"""The building blocks, as functions over weight tensors (shapes in comments; T = tokens)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x, weight, eps):
    # x [..., dim]: normalised in float32, scaled in x's dtype (as the reference models do)
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def rope_rotate_half(x, positions, inv_freq):
    # x [T, heads, dim], positions [T]: the halves (x1, x2) rotate together (Llama / Qwen / Mixtral)
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_interleaved(x, positions, inv_freq):
    # x [T, heads, dim]: consecutive pairs (x[2i], x[2i+1]) rotate as complex numbers (DeepSeek-V2)
    freqs = positions[:, None].float() * inv_freq[None, :]
    rotation = torch.polar(torch.ones_like(freqs), freqs)[:, None, :]
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def swiglu(x, gate, up, down):
    # x [T, hidden]; gate/up [inter, hidden]; down [hidden, inter]
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def causal_attention(q, k, v, scale):
    """Prefill attention over one sequence. q [T, Hq, Dqk], k [T, Hkv, Dqk], v [T, Hkv, Dv] ->
    [T, Hq, Dv], in float32, through torch's fused SDPA (memory linear in T). V narrower than K (MLA's
    latent) is zero-padded to K's width so the fused kernel applies; the padding adds zeros only."""
    dim_v = v.shape[-1]
    if dim_v < k.shape[-1]:
        v = F.pad(v, (0, k.shape[-1] - dim_v))
    q32, k32, v32 = (t.float().transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, T, dim]
    out = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)[..., :dim_v]
