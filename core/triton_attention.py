"""Triton split-KV decode attention and the LSE merge: the GPU half of split attention.

Same contract as the CPU kernel (`writescope.ops`): normalised float32 partials with natural-log
LSE, -inf for an empty part. Stage 1 gives each (sequence, kv head, split) one program; the query
heads of the kv head (GQA group, or all MLA heads) are the rows of one `tl.dot`. Stage 2 merges the
splits in split order, so the reduction order is fixed for a given split size. The split size
comes from the work and the device (`split_tokens`): enough programs to fill every SM a few
times over at any batch and length, and no program so short that its fixed work dominates.

On a machine without a GPU the kernels run under Triton's interpreter: `TRITON_INTERPRET=1` must
be set before this module is imported (Triton reads it when the kernels are decorated). There,
tensors live on the CPU, and every load is cast to float32 before `tl.dot` (bf16 into `tl.dot` is
wrong in the interpreter); no autotuning, no libdevice.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from writescope import env

BLOCK_N = 32  # tokens per inner step of a stage-1 program
# The split's bounds and the programs per SM are first choices, not yet measured on a GPU: the H200
# run of the fixed 256-token split reached 0.18-0.78 of the copy bandwidth, short of programs at
# 8K-32K (README). tools/bench_gpu_attention.py times every row against that fixed split too.
MIN_SPLIT_TOKENS = 128  # four inner steps: a program's fixed work (its q, its partial stored, merged)
MAX_SPLIT_TOKENS = 8192  # past it a program only lengthens its serial loop: huge work fills the grid anyway
PROGRAMS_PER_SM = 8  # programs in flight per SM to keep its loads queued, and a short last wave
NUM_STAGES = 2  # software-pipelined K/V loads in stage 1 (ignored by the interpreter)
INTERPRETED = env.TRITON_INTERPRET.enabled()


def split_tokens(num_seqs: int, num_kv_heads: int, capacity_tokens: int, num_sms: int) -> int:
    """Tokens per stage-1 program for a grid of (num_seqs, num_kv_heads, splits of capacity_tokens):
    the work spread over PROGRAMS_PER_SM x num_sms programs, rounded up to a power of two (a handful
    of compiled variants) and kept within [MIN_SPLIT_TOKENS, MAX_SPLIT_TOKENS]. capacity_tokens is
    the block table's (no device-to-host read of the lengths)."""
    if min(num_seqs, num_kv_heads, capacity_tokens, num_sms) < 1:
        return MIN_SPLIT_TOKENS
    per_program = -(-num_seqs * num_kv_heads * capacity_tokens // (PROGRAMS_PER_SM * num_sms))
    return min(max(triton.next_power_of_2(per_program), MIN_SPLIT_TOKENS), MAX_SPLIT_TOKENS)


@functools.cache
def _num_sms(device: torch.device) -> int:
    # Under the interpreter the "device" is this CPU, which runs the programs one by one.
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, mid_out_ptr, mid_lse_ptr,
    stride_q_seq, stride_q_head,
    stride_k_block, stride_k_head, stride_k_token,
    stride_v_block, stride_v_head, stride_v_token,
    stride_table_seq,
    stride_mid_seq, stride_mid_head, stride_mid_split,
    stride_lse_seq, stride_lse_head,
    split_offset, scale, block_size,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    K_MAIN: tl.constexpr, BLOCK_K_MAIN: tl.constexpr,
    K_TAIL: tl.constexpr, BLOCK_K_TAIL: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    V_IN_K: tl.constexpr, DOT_FP32: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
):
    # q [num_seqs, num_q_heads, K_MAIN + K_TAIL]; k/v [num_blocks, num_kv_heads, block_size, dim]
    # mid_out [num_seqs, num_q_heads, num_splits, HEAD_DIM_V]; mid_lse [num_seqs, num_q_heads, num_splits]
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_km = tl.arange(0, BLOCK_K_MAIN)
    km_mask = offs_km < K_MAIN
    q_rows = q_ptr + seq * stride_q_seq + heads * stride_q_head
    q_main = tl.load(q_rows[:, None] + offs_km[None, :], mask=g_mask[:, None] & km_mask[None, :], other=0.0)
    if K_TAIL > 0:
        offs_kt = tl.arange(0, BLOCK_K_TAIL)
        kt_mask = offs_kt < K_TAIL
        q_tail = tl.load(q_rows[:, None] + K_MAIN + offs_kt[None, :], mask=g_mask[:, None] & kt_mask[None, :],
                         other=0.0)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < HEAD_DIM_V

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    table_row = block_table_ptr + seq * stride_table_seq
    for token0 in range(start, end, BLOCK_TOKENS):
        offs_n = token0 + tl.arange(0, BLOCK_TOKENS)
        n_mask = offs_n < end
        physical = tl.load(table_row + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
        in_block = (offs_n % block_size).to(tl.int64)
        k_rows = k_ptr + physical * stride_k_block + kv_head * stride_k_head + in_block * stride_k_token
        k_main = tl.load(k_rows[:, None] + offs_km[None, :], mask=n_mask[:, None] & km_mask[None, :], other=0.0)
        if DOT_FP32:
            qk = tl.dot(q_main.to(tl.float32), tl.trans(k_main.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q_main.to(k_main.dtype), tl.trans(k_main))
        if K_TAIL > 0:
            k_tail = tl.load(k_rows[:, None] + K_MAIN + offs_kt[None, :], mask=n_mask[:, None] & kt_mask[None, :],
                             other=0.0)
            if DOT_FP32:
                qk += tl.dot(q_tail.to(tl.float32), tl.trans(k_tail.to(tl.float32)), input_precision="ieee")
            else:
                qk += tl.dot(q_tail.to(k_tail.dtype), tl.trans(k_tail))
        qk = tl.where(n_mask[None, :], qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_IN_K:
            v = k_main  # MLA: V is the latent already loaded for QK
        else:
            v_rows = v_ptr + physical * stride_v_block + kv_head * stride_v_head + in_block * stride_v_token
            v = tl.load(v_rows[:, None] + offs_dv[None, :], mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    slot = split_offset + split
    mid_rows = mid_out_ptr + seq * stride_mid_seq + heads * stride_mid_head + slot * stride_mid_split
    tl.store(mid_rows[:, None] + offs_dv[None, :], out, mask=g_mask[:, None] & dv_mask[None, :])
    tl.store(mid_lse_ptr + seq * stride_lse_seq + heads * stride_lse_head + slot, lse, mask=g_mask)


@triton.jit
def _merge_kernel(
    outs_ptr, lses_ptr, out_ptr, lse_ptr, num_parts,
    stride_outs_part, stride_outs_row, stride_lses_part, stride_lses_row, stride_out_row,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # outs [num_parts, rows, HEAD_DIM_V], lses [num_parts, rows] -> out [rows, HEAD_DIM_V], lse [rows]
    # Scale factors first: the max LSE over parts, then the weighted sum in part order.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_DV)
    mask = offs < HEAD_DIM_V
    max_lse = tl.full([], float("-inf"), tl.float32)
    for part in range(num_parts):
        max_lse = tl.maximum(max_lse, tl.load(lses_ptr + part * stride_lses_part + row * stride_lses_row))
    shift = tl.where(max_lse == float("-inf"), 0.0, max_lse)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for part in range(num_parts):
        weight = tl.exp(tl.load(lses_ptr + part * stride_lses_part + row * stride_lses_row) - shift)
        part_out = tl.load(outs_ptr + part * stride_outs_part + row * stride_outs_row + offs, mask=mask, other=0.0)
        acc += weight * part_out
        total += weight
    nonempty = total > 0
    tl.store(out_ptr + row * stride_out_row + offs, acc / tl.where(nonempty, total, 1.0), mask=mask)
    tl.store(lse_ptr + row, tl.where(nonempty, shift + tl.log(tl.where(nonempty, total, 1.0)), float("-inf")))


def _pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(max(n, 1)))


def _v_in_k(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """MLA: V is the first head_dim_v dims of K (same storage and strides)."""
    return (v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()
            and v_cache.shape[-1] <= k_cache.shape[-1])


def _launch_splits(q, k_cache, v_cache, block_table, seq_lens, mid_out, mid_lse, split_offset, scale, split):
    num_seqs, num_q_heads, head_dim_qk = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    head_dim_v = v_cache.shape[-1]
    group = num_q_heads // num_kv_heads
    v_in_k = _v_in_k(k_cache, v_cache)
    k_main = head_dim_v if v_in_k else head_dim_qk
    k_tail = head_dim_qk - k_main
    num_splits = _num_splits(block_table, block_size, split)
    if num_splits == 0:
        return
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, mid_out, mid_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        split_offset, scale, max(block_size, 1),
        GROUP=group, BLOCK_G=_pow2(group),
        K_MAIN=k_main, BLOCK_K_MAIN=_pow2(k_main),
        K_TAIL=k_tail, BLOCK_K_TAIL=_pow2(k_tail),
        HEAD_DIM_V=head_dim_v, BLOCK_DV=_pow2(head_dim_v),
        V_IN_K=v_in_k, DOT_FP32=INTERPRETED or k_cache.dtype == torch.float32,
        SPLIT=split, BLOCK_TOKENS=BLOCK_N, num_stages=NUM_STAGES,
    )


def _num_splits(block_table: torch.Tensor, block_size: int, split: int) -> int:
    # From the table's capacity, not the lengths: no device-to-host sync; programs past a
    # sequence's end write an empty partial.
    capacity = block_table.shape[1] * block_size
    return -(-capacity // split)


def source_split_tokens(q, source, split: int | None = None) -> int:
    """The split one source gets: `split` when given, else split_tokens of its work on q's device."""
    k_cache, _, block_table, _ = source
    if split is not None:
        return split
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    return split_tokens(q.shape[0], num_kv_heads, block_table.shape[1] * block_size, _num_sms(q.device))


def paged_attention(q, sources, scale, split: int | None = None):
    """Split-KV decode over one or more paged sources of the same sequences (e.g. the GPU window and
    the ping-pong buffer), merged into one partial.

    q [num_seqs, num_q_heads, head_dim_qk]; each source is (k_cache [num_blocks, num_kv_heads,
    block_size, head_dim_qk], v_cache [..., head_dim_v], block_table [num_seqs, max_blocks] int32,
    seq_lens [num_seqs] int32) -> out [num_seqs, num_q_heads, head_dim_v], lse [num_seqs, num_q_heads].
    split: tokens per stage-1 program, a multiple of BLOCK_N (None: `split_tokens` per source).
    """
    if split is not None and (split < BLOCK_N or split % BLOCK_N):
        raise ValueError(f"split must be a positive multiple of {BLOCK_N} tokens, got {split}")
    num_seqs, num_q_heads, _ = q.shape
    head_dim_v = sources[0][1].shape[-1]
    source_splits = [source_split_tokens(q, source, split) for source in sources]
    splits = [_num_splits(table, k.shape[2], size)
              for (k, _, table, _), size in zip(sources, source_splits, strict=True)]
    total_splits = max(sum(splits), 1)
    mid_out = torch.empty((num_seqs, num_q_heads, total_splits, head_dim_v), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((num_seqs, num_q_heads, total_splits), dtype=torch.float32, device=q.device)
    if sum(splits) == 0:  # every source has zero capacity: one empty part
        mid_out.zero_()
        mid_lse.fill_(float("-inf"))
    offset = 0
    for (k_cache, v_cache, table, lens), count, size in zip(sources, splits, source_splits, strict=True):
        _launch_splits(q, k_cache, v_cache, table, lens, mid_out, mid_lse, offset, scale, size)
        offset += count
    out = torch.empty((num_seqs, num_q_heads, head_dim_v), dtype=torch.float32, device=q.device)
    lse = torch.empty((num_seqs, num_q_heads), dtype=torch.float32, device=q.device)
    # mid [num_seqs, num_q_heads, splits, dim] is parts of rows (seq, head): part stride = dim.
    _merge_kernel[(num_seqs * num_q_heads,)](
        mid_out, mid_lse, out, lse, total_splits,
        mid_out.stride(2), mid_out.stride(1), mid_lse.stride(2), mid_lse.stride(1), out.stride(1),
        HEAD_DIM_V=head_dim_v, BLOCK_DV=_pow2(head_dim_v),
    )
    return out, lse


def merge_partials(outs, lses):
    """outs [num_parts, rows, head_dim_v], lses [num_parts, rows] float32 -> out [rows, head_dim_v], lse [rows]."""
    num_parts, rows, head_dim_v = outs.shape
    out = torch.empty((rows, head_dim_v), dtype=torch.float32, device=outs.device)
    lse = torch.empty((rows,), dtype=torch.float32, device=outs.device)
    if rows:
        _merge_kernel[(rows,)](
            outs, lses, out, lse, num_parts,
            outs.stride(0), outs.stride(1), lses.stride(0), lses.stride(1), out.stride(0),
            HEAD_DIM_V=head_dim_v, BLOCK_DV=_pow2(head_dim_v),
        )
    return out, lse
