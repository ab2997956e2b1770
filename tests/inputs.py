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


def stepped_scores(num_kv_heads=2, group=4, head_dim=64, dtype=torch.bfloat16):
    """q [num_kv_heads * group, head_dim], k, v [num_kv_heads, 613, head_dim] whose scores (at scale
    head_dim^-0.5) follow a profile in every head: a rise of ~16 over the first 320 tokens (~3 a
    64-token tile, less than a kernel's rescale slack, so a running max may lag the scores), a jump of
    ~240 for tokens 320-399 (a tile whose max passes the running one by far: what came before must
    vanish), ~-160 for 400-499 (probabilities that underflow to 0) and ~236 from 500 on (a little
    under the jump: probabilities of e^-4 and so against a max set tiles before)."""
    q = 1.0 + 0.1 * torch.randn(num_kv_heads * group, head_dim)  # q . (b, b, ...) ~ b * head_dim
    offsets = torch.cat([torch.linspace(0.0, 2.0, 320), torch.full((80,), 30.0), torch.full((100,), -20.0),
                         torch.full((113,), 29.5)])
    k = 0.1 * torch.randn(num_kv_heads, 613, head_dim) + offsets[None, :, None]
    v = torch.randn(num_kv_heads, 613, head_dim)
    return q.to(dtype), k.to(dtype), v.to(dtype)
