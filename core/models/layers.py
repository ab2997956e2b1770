"""The building blocks, as functions over weight tensors (shapes in comments; T = tokens)."""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from writescope import dense, ops


def rms_norm(x, weight, eps):
    # x [..., dim]: normalised in float32, scaled in x's dtype (as the reference models do)
    fused = dense.rms_norm(x, weight, eps)  # a decode step's bf16 rows on the CPU: one C++ call
    if fused is not None:
        return fused
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_frequencies(dim: int, rope) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], attention factor) of a RopeConfig: default, or YaRN (the
    interpolated and extrapolated frequencies blended by a linear ramp over the dimensions)."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _mscale(rope.factor, rope.mscale) / _mscale(rope.factor, rope.mscale_all_dim)
    else:
        attention_factor = _mscale(rope.factor)
    low, high = _correction_range(rope, dim)
    span = high - low if high > low else 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / span, 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_range(rope, dim):
    def correction_dim(rotations):
        wavelengths = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def rope_rotate_half_tables(positions, inv_freq, attention_factor, dtype):
    """positions [T] -> (cos, sin) [T, 1, dim] in dtype: made once per step (or prefill) and shared
    by every layer, whose positions are the same."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(dtype)[:, None, :], (emb.sin() * attention_factor).to(dtype)[:, None, :]


def apply_rope_rotate_half(x, cos, sin):
    # x [T, heads, dim]: the halves (x1, x2) rotate together (Llama / Qwen / Mixtral)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_interleaved_rotation(positions, inv_freq, attention_factor):
    """positions [T] -> the complex rotation [T, 1, dim / 2], shared by every layer of a step."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    return (torch.polar(torch.ones_like(freqs), freqs) * attention_factor)[:, None, :]


def apply_rope_interleaved(x, rotation):
    # x [T, heads, dim]: consecutive pairs (x[2i], x[2i+1]) rotate as complex numbers (DeepSeek-V2)
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def swiglu(x, gate_up, down):
    # x [T, hidden]; gate_up [2 * inter, hidden] (gate rows, then up rows); down [hidden, inter]
    gate, up = dense.linear(x, gate_up).chunk(2, dim=-1)
    return dense.linear(F.silu(gate) * up, down)


def causal_attention(q, k, v, scale, prefix=()):
    """Prefill attention over one sequence. q [T, Hq, Dqk], k [T, Hkv, Dqk], v [T, Hkv, Dv] of the
    same T positions, causal among them; prefix: pieces (k [Hkv, P_i, Dqk], v [Hkv, P_i, Dv]),
    head-major as the cache reads them back, of the positions before (a chunked prefill's), which
    every query sees: an iterable, so that only one piece need be in memory at a time.
    -> [T, Hq, Dv], in float32, through torch's fused kernels (memory linear in T and the piece).
    V narrower than K (MLA's latent) is zero-padded to K's width so the fused kernels apply; the
    padding adds zeros."""
    dim_qk, dim_v = k.shape[-1], v.shape[-1]

    def padded(values):
        return F.pad(values, (0, dim_qk - dim_v)) if dim_v < dim_qk else values

    q32, k32, v32 = (t.float().transpose(0, 1)[None] for t in (q, k, padded(v)))  # [1, heads, T, dim]
    pieces = iter(prefix)
    first = next(pieces, None)
    if first is None:
        out = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True, scale=scale, enable_gqa=True)
    else:
        pieces = ((k_piece.float()[None], padded(v_piece).float()[None])  # [1, Hkv, P_i, dim]
                  for k_piece, v_piece in itertools.chain([first], pieces))
        out = _chunk_after_prefix(q32, k32, v32, pieces, scale)
    return out[0].transpose(0, 1)[..., :dim_v]


def _chunk_after_prefix(q, k, v, prefix_pieces, scale: float) -> torch.Tensor:
    """q, k, v [1, H, T, D] (k, v with Hkv heads) after the prefix, in pieces k_i, v_i [1, Hkv, P_i, D]
    -> [1, Hq, T, D]: the chunk causally and each piece unmasked, each through a fused kernel with
    its log-sum-exp, merged exactly as they come. A causal mask over prefix + chunk would take
    SDPA's masked path instead, 1.3x slower (measured, 4096 queries after 6K). Per kv head: its
    group's queries fold into one sequence for the prefix (they see the same keys), and only the
    chunk's keys are repeated."""
    num_q, num_kv, length = q.shape[1], k.shape[1], q.shape[2]
    group = num_q // num_kv
    heads = []  # per kv head: (out [1, group, T, D], lse [1, group, T]) over what is merged so far
    for h in range(num_kv):
        chunk_k = k[:, h:h + 1].expand(1, group, length, k.shape[-1])
        chunk_v = v[:, h:h + 1].expand(1, group, length, v.shape[-1])
        heads.append(_attention_with_lse(q[:, h * group:(h + 1) * group], chunk_k, chunk_v, True, scale))
    for k_piece, v_piece in prefix_pieces:
        for h in range(num_kv):
            q_h = q[:, h * group:(h + 1) * group].reshape(1, 1, group * length, -1)
            out, lse = _attention_with_lse(q_h, k_piece[:, h:h + 1], v_piece[:, h:h + 1], False, scale)
            heads[h] = ops.merge([heads[h], (out.reshape(1, group, length, -1), lse.reshape(1, group, length))])
    return torch.cat([out for out, _ in heads], dim=1)


def _attention_with_lse(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H, T, D], k, v [1, H, S, D] float32 -> (out [1, H, T, D], lse [1, H, T]), natural log:
    torch's fused kernel for the device (flash on the CPU, memory-efficient on CUDA, which takes
    float32; its log-sum-exp may come padded past T)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., : q.shape[2]]
