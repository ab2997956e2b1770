"""Random inputs shared by the kernel tests (seeded by the autouse fixture in conftest)."""

import torch


def make_inputs(seq_len, head_dim, group, num_kv_heads, dtype, head_dim_v=None, q_dtype=torch.bfloat16, device="cpu"):
    """q [num_kv_heads * group, head_dim], k [num_kv_heads, seq_len, head_dim], v [..., head_dim_v]."""
    q = torch.randn(num_kv_heads * group, head_dim).to(q_dtype)
    k = torch.randn(num_kv_heads, seq_len, head_dim).to(dtype)
    v = torch.randn(num_kv_heads, seq_len, head_dim_v or head_dim).to(dtype)
    return q.to(device), k.to(device), v.to(device)


def make_paged(seq_lens, block_size, num_kv_heads=2, group=4, head_dim=64, spare_blocks=3, dtype=torch.bfloat16,
               device="cpu"):
    """A ragged batch over shuffled physical blocks; unused table entries are -1 (invalid)."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq + [1])
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim).to(dtype)
    order = torch.randperm(num_blocks).to(torch.int32)  # shuffled physical blocks
    table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)  # unused entries invalid
    used = 0
    for s, n in enumerate(blocks_per_seq):
        table[s, :n] = order[used:used + n]
        used += n
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, table, lens))
