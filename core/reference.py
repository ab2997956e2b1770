"""Float32 torch reference of partial attention and the merge: the oracle for every backend.

Written for clarity, not speed. Conventions as in `writescope.ops`: natural-log LSE, -inf for an
empty part, outputs float32.
"""

from __future__ import annotations

import torch

# Unit roundoff of bf16 (8 significant bits, round to nearest even): the most a probability's
# relative error grows when a kernel rounds it to bf16 for PV.
BF16_UNIT_ROUNDOFF = 2.0**-9


def attention(q, k, v, scale):
    """q [num_q_heads, head_dim_qk], k [num_kv_heads, seq_len, head_dim_qk], v [num_kv_heads, seq_len,
    head_dim_v] -> out [num_q_heads, head_dim_v], lse [num_q_heads], in float32."""
    num_q_heads, head_dim_qk = q.shape
    num_kv_heads, seq_len, head_dim_v = v.shape
    if seq_len == 0:
        return torch.zeros(num_q_heads, head_dim_v), torch.full((num_q_heads,), float("-inf"))
    group = num_q_heads // num_kv_heads
    q_grouped = q.float().reshape(num_kv_heads, group, head_dim_qk)
    scores = torch.matmul(q_grouped, k.float().transpose(1, 2)) * scale  # [num_kv_heads, group, seq_len]
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())  # [num_kv_heads, group, head_dim_v]
    return out.reshape(num_q_heads, head_dim_v), lse.reshape(num_q_heads)


def probability_rounding_atol(v) -> float:
    """The most an output dim of softmax(s) v can move when every probability is rounded to bf16 (each
    off by a relative 2^-9 at most, the normaliser kept exact), for v [..., seq_len, head_dim_v]:
    |sum p (1 + e) v - sum p v| / sum p <= 2^-9 max |v|."""
    finite = v.float().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # unused slots past a sequence's end
    return BF16_UNIT_ROUNDOFF * float(finite.abs().max()) if v.numel() else 0.0


def gather_sequence(cache, block_table_row, seq_len):
    """cache [num_blocks, num_kv_heads, block_size, dim] -> [num_kv_heads, seq_len, dim] of one sequence."""
    check_block_values(cache, block_table_row, seq_len)
    block_size = cache.shape[2]
    num_used = -(-seq_len // block_size) if seq_len else 0
    blocks = cache[block_table_row[:num_used].long()]  # [num_used, num_kv_heads, block_size, dim]
    return blocks.permute(1, 0, 2, 3).reshape(cache.shape[1], num_used * block_size, cache.shape[3])[:, :seq_len]


def check_block_values(cache, block_table_row, seq_len):
    num_blocks, _, block_size, _ = cache.shape
    capacity = block_table_row.shape[0] * block_size
    if not 0 <= seq_len <= capacity:
        raise ValueError(f"seq_len {seq_len} is outside [0, {capacity}] (max_blocks_per_seq x block_size)")
    num_used = -(-seq_len // block_size) if seq_len else 0
    used = block_table_row[:num_used]
    if num_used and (used.min() < 0 or used.max() >= num_blocks):
        raise ValueError(f"block_table holds {used.tolist()}, outside [0, {num_blocks})")


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, scale):
    outs, lses = [], []
    for s in range(q.shape[0]):
        seq_len = int(seq_lens[s])
        k = gather_sequence(k_cache, block_table[s], seq_len)
        v = gather_sequence(v_cache, block_table[s], seq_len)
        out, lse = attention(q[s], k, v, scale)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def merge_partials(outs, lses):
    """outs [num_parts, *rows, head_dim_v], lses [num_parts, *rows] -> out [*rows, head_dim_v], lse [*rows]."""
    max_lse = lses.max(dim=0).values
    empty = max_lse == float("-inf")
    shift = torch.where(empty, torch.zeros_like(max_lse), max_lse)
    weights = torch.exp(lses - shift)  # an empty part weighs exactly 0
    total = weights.sum(dim=0)
    out = (weights.unsqueeze(-1) * outs).sum(dim=0) / torch.where(empty, 1.0, total).unsqueeze(-1)
    lse = torch.where(empty, torch.full_like(shift, float("-inf")), shift + torch.log(total))
    return out, lse
