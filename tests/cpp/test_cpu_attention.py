"""The C++ kernel against the float32 torch reference, one dimension varied at a time."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.inputs import make_inputs, make_paged, stepped_scores
from tests.tolerances import ATTENTION_OUT, MERGE, assert_partials_close, cpu_out_tolerance
from writescope import _cpu, ops

BASE = {"seq_len": 613, "head_dim": 128, "group": 4, "num_kv_heads": 2, "dtype": torch.bfloat16}


def check_against_reference(q, k, v, scale=None):
    out, lse = ops.partial_attention(q, k, v, scale=scale, backend="cpu")
    ref_out, ref_lse = ops.partial_attention(q, k, v, scale=scale, backend="torch")
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert_partials_close(out, lse, ref_out, ref_lse, cpu_out_tolerance(q.dtype, k.dtype, v))


@pytest.mark.parametrize("seq_len", [0, 1, 17, 613, 4099])
def test_seq_len(cpu_variant, seq_len):
    check_against_reference(*make_inputs(**{**BASE, "seq_len": seq_len}))


@pytest.mark.parametrize("head_dim", [64, 80, 128, 72])
def test_head_dim(cpu_variant, head_dim):
    check_against_reference(*make_inputs(**{**BASE, "head_dim": head_dim}))


@pytest.mark.parametrize("group", [1, 4, 8, 16, 3])
def test_group(cpu_variant, group):
    check_against_reference(*make_inputs(**{**BASE, "group": group}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kv_dtype(cpu_variant, dtype):
    check_against_reference(*make_inputs(**{**BASE, "dtype": dtype}))


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_q_dtype(cpu_variant, q_dtype):
    check_against_reference(*make_inputs(**BASE, q_dtype=q_dtype))


@pytest.mark.parametrize("num_q_heads", [16, 128])
@pytest.mark.parametrize("seq_len", [17, 613])
def test_mla_latent_shared_by_all_heads(cpu_variant, num_q_heads, seq_len):
    # MLA absorbed decode: one kv head of 512 latent + 64 rope dims; V is the latent, a view of K.
    q = torch.randn(num_q_heads, 576, dtype=torch.bfloat16)
    k = torch.randn(1, seq_len, 576).to(torch.bfloat16)
    check_against_reference(q, k, k[..., :512], scale=192**-0.5)


@pytest.mark.parametrize("chunk_tokens", [None, 7, 130])
def test_mla_running_max_grows_tile_after_tile(cpu_variant, chunk_tokens):
    # Keys grow along the sequence, so every 64-token tile's max passes the tiles' before it and each
    # head's output so far is rescaled; items of 7 and 130 tokens end on odd tokens and mid-tile.
    q = torch.randn(16, 576, dtype=torch.bfloat16)
    growth = torch.linspace(0.5, 1.5, 613)[None, :, None]
    k = (torch.randn(1, 613, 576) * growth).to(torch.bfloat16)
    table = torch.zeros((1, 1), dtype=torch.int32)
    lens = torch.tensor([613], dtype=torch.int32)
    out = torch.empty(1, 16, 512)
    lse = torch.empty(1, 16)
    _cpu.paged_attention(q[None].view(torch.int16).numpy(), k[None].view(torch.int16).numpy(),
                         k[None, ..., :512].view(torch.int16).numpy(), table.numpy(), lens.numpy(), out.numpy(),
                         lse.numpy(), q_dtype="bfloat16", kv_dtype="bfloat16", scale=192**-0.5,
                         chunk_tokens=chunk_tokens)
    ref_out, ref_lse = ops.partial_attention(q, k, k[..., :512], scale=192**-0.5, backend="torch")
    assert_partials_close(out[0], lse[0], ref_out, ref_lse, cpu_out_tolerance(q.dtype, k.dtype, k[..., :512]))


@pytest.mark.parametrize("group", [1, 4, 8, 16])
def test_scores_that_creep_jump_and_underflow(cpu_variant, group):
    # The running max lags rises smaller than the rescale slack, moves for a jump of ~240 (the earlier
    # tiles' sums vanish), and later tiles a little under it reuse it; a build that never moved it
    # after the first tile overflowed to NaN here. 16 heads of 64 dims take the lane softmax where
    # the bf16 dot runs.
    check_against_reference(*stepped_scores(group=group))


@pytest.mark.parametrize(("num_q_heads", "head_dim"), [(16, 72), (32, 64), (16, 66), (48, 128)])
def test_many_heads_on_one_kv_head_with_bf16_q(cpu_variant, num_q_heads, head_dim):
    # Whole 16-head chunks with head dims in 4s take the scores with heads in vector lanes where the
    # bf16 dot runs (66 dims do not); 37 tokens end in a partial block of 8; q rows are strided.
    fused = torch.randn(num_q_heads, 2 * head_dim).to(torch.bfloat16)
    q = fused[:, head_dim:]
    k = torch.randn(1, 37, head_dim).to(torch.bfloat16)
    v = torch.randn(1, 37, head_dim).to(torch.bfloat16)
    check_against_reference(q, k, v)


def test_explicit_scale(cpu_variant):
    q, k, v = make_inputs(**BASE)
    check_against_reference(q, k, v, scale=0.031)


def test_fp16_subnormals_and_large_values_convert_exactly(cpu_variant):
    q = torch.randn(4, 64)
    k = torch.randn(1, 40, 64).to(torch.float16)
    k[0, :5] = torch.tensor(6e-8, dtype=torch.float16)  # fp16 subnormal
    k[0, 5:10] = torch.tensor(-60000.0, dtype=torch.float16) / 1000
    v = (torch.randn(1, 40, 64) * 1000).to(torch.float16)
    check_against_reference(q, k, v)


@pytest.mark.parametrize("block_size", [16, 17, 64])
def test_paged_ragged_batch_with_shuffled_blocks(cpu_variant, block_size):
    args = make_paged([613, 0, 1, 97, 1200], block_size)
    out, lse = ops.paged_partial_attention(*args, backend="cpu")
    ref_out, ref_lse = ops.paged_partial_attention(*args, backend="torch")
    assert_partials_close(out, lse, ref_out, ref_lse)


def test_paged_head_major_pool_layout(cpu_variant):
    # A pool stored [num_kv_heads, num_blocks, block_size, dim] and passed as a permuted view.
    q, k_cache, v_cache, table, lens = make_paged([300, 45], 16)
    k_pool = k_cache.permute(1, 0, 2, 3).contiguous()
    v_pool = v_cache.permute(1, 0, 2, 3).contiguous()
    out, lse = ops.paged_partial_attention(q, k_pool.permute(1, 0, 2, 3), v_pool.permute(1, 0, 2, 3), table, lens)
    ref_out, ref_lse = ops.paged_partial_attention(q, k_cache, v_cache, table, lens, backend="torch")
    assert_partials_close(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, 100000, 2**63 - 1])
def test_chunking_does_not_change_the_result(cpu_variant, chunk_tokens):
    q, k, v = make_inputs(**BASE)
    q3, k4, v4 = q[None], k[None], v[None]
    table = torch.zeros((1, 1), dtype=torch.int32)
    lens = torch.tensor([k.shape[1]], dtype=torch.int32)
    out = torch.empty(1, q.shape[0], v.shape[-1])
    lse = torch.empty(1, q.shape[0])
    _cpu.paged_attention(q3.view(torch.int16).numpy(), k4.view(torch.int16).numpy(), v4.view(torch.int16).numpy(),
                         table.numpy(), lens.numpy(), out.numpy(), lse.numpy(), q_dtype="bfloat16", kv_dtype="bfloat16",
                         scale=128**-0.5, chunk_tokens=chunk_tokens)
    ref_out, ref_lse = ops.partial_attention(q, k, v, backend="torch")
    assert_partials_close(out[0], lse[0], ref_out, ref_lse, cpu_out_tolerance(q.dtype, k.dtype, v))


def _one_block_call(q, k, v, **chunking):
    # q [num_q_heads, head_dim]; k, v [num_kv_heads, seq_len, head_dim] as one block of one sequence
    table = torch.zeros((1, 1), dtype=torch.int32)
    lens = torch.tensor([k.shape[1]], dtype=torch.int32)
    out = torch.empty(1, q.shape[0], v.shape[-1])
    lse = torch.empty(1, q.shape[0])
    _cpu.paged_attention(q[None].view(torch.int16).numpy(), k[None].view(torch.int16).numpy(),
                         v[None].view(torch.int16).numpy(), table.numpy(), lens.numpy(), out.numpy(), lse.numpy(),
                         q_dtype="bfloat16", kv_dtype="bfloat16", scale=128**-0.5, **chunking)
    return out, lse


@pytest.mark.parametrize("seq_len, num_kv_heads", [(613, 2), (20000, 8), (300000, 1)])
def test_default_items_are_sized_from_the_job(seq_len, num_kv_heads):
    # tokens x kv heads / 64, within [MIN_CHUNK_TOKENS, MAX_CHUNK_TOKENS]: 512, 2500 and 4096 here
    q, k, v = make_inputs(**{**BASE, "seq_len": seq_len, "num_kv_heads": num_kv_heads, "head_dim": 64})
    expected = min(max(-(-seq_len * num_kv_heads // 64), _cpu.MIN_CHUNK_TOKENS), _cpu.MAX_CHUNK_TOKENS)
    out, lse = _one_block_call(q, k, v)
    explicit_out, explicit_lse = _one_block_call(q, k, v, chunk_tokens=expected)
    assert torch.equal(out, explicit_out) and torch.equal(lse, explicit_lse)
    none_out, _ = _one_block_call(q, k, v, chunk_tokens=None)
    assert torch.equal(none_out, out)


def _mla_inputs(seq_len):
    q = torch.randn(16, 576, dtype=torch.bfloat16)
    k = torch.randn(1, seq_len, 576).to(torch.bfloat16)
    return q, k, k[..., :512]


def test_mla_items_hold_64_times_the_tokens_whose_latent_matches_their_output():
    # an item's output is 16 heads x 512 float32 = 32 KB against 1152 bytes of latent a token:
    # 64 x 32768 / 1152 -> 1821 tokens, a power of two up -> 2048, where tokens / 64 gives 512 at 8K
    q, k, v = _mla_inputs(8192)
    out, lse = _one_block_call(q, k, v)
    at_2048 = _one_block_call(q, k, v, chunk_tokens=2048)
    assert torch.equal(out, at_2048[0]) and torch.equal(lse, at_2048[1])
    assert not torch.equal(out, _one_block_call(q, k, v, chunk_tokens=512)[0])


@pytest.mark.parametrize("inputs", [lambda: make_inputs(**{**BASE, "seq_len": 4099}), lambda: _mla_inputs(4099)],
                         ids=["gqa", "mla"])
def test_result_is_identical_for_any_thread_count(inputs):
    q, k, v = inputs()
    default_threads = _cpu.num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            _cpu.set_num_threads(threads)
            results.append(ops.partial_attention(q, k, v))
    finally:
        _cpu.set_num_threads(default_threads)
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


def test_pool_threads_can_be_pinned():
    default_threads = _cpu.num_threads()
    cpus = sorted(os.sched_getaffinity(0))
    try:
        _cpu.set_num_threads(2, cpus[:1])
        assert _cpu.pinned_cpus() == cpus[:1]
        check_against_reference(*make_inputs(**BASE))
    finally:
        _cpu.set_num_threads(default_threads)
    assert _cpu.pinned_cpus() == []


@settings(max_examples=40, deadline=None)
@given(
    seq_len=st.integers(0, 300),
    split=st.floats(0, 1),
    group=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([16, 40, 64]),
    backend=st.sampled_from(["cpu", "torch"]),
)
def test_split_identity(seq_len, split, group, head_dim, backend):
    """merge(attn(K[:i]), attn(K[i:])) == attn(K), empty parts included."""
    i = round(split * seq_len)
    q, k, v = make_inputs(seq_len, head_dim, group, 2, torch.bfloat16)
    first = ops.partial_attention(q, k[:, :i], v[:, :i], backend=backend)
    second = ops.partial_attention(q, k[:, i:], v[:, i:], backend=backend)
    whole_out, whole_lse = ops.partial_attention(q, k, v, backend="torch")
    tol_out = cpu_out_tolerance(q.dtype, k.dtype, v) if backend == "cpu" else ATTENTION_OUT
    for merge_backend in ("torch", "cpu"):
        out, lse = ops.merge_partials(
            torch.stack([first[0], second[0]]), torch.stack([first[1], second[1]]), backend=merge_backend
        )
        assert_partials_close(out, lse, whole_out, whole_lse, tol_out)


def test_cpu_merge_matches_torch_merge_over_many_parts_and_rows():
    outs = torch.randn(5, 3, 7, 33)
    lses = torch.randn(5, 3, 7) * 10
    lses[1, 0] = float("-inf")
    lses[:, 2, 3] = float("-inf")
    cpu = ops.merge_partials(outs, lses, backend="cpu")
    ref = ops.merge_partials(outs, lses, backend="torch")
    torch.testing.assert_close(cpu[0], ref[0], **MERGE)
    torch.testing.assert_close(cpu[1], ref[1], **MERGE)
    assert torch.all(cpu[0][2, 3] == 0) and cpu[1][2, 3] == float("-inf")


def test_cpu_merge_of_more_parts_than_one_batch_of_weights(cpu_variant):
    # 150 parts: three batches of the merge's held weights; 70 dims: whole vectors and a tail.
    outs = torch.randn(150, 6, 70)
    lses = torch.randn(150, 6) * 5
    lses[::7, 1] = float("-inf")
    cpu = ops.merge_partials(outs, lses, backend="cpu")
    ref = ops.merge_partials(outs, lses, backend="torch")
    torch.testing.assert_close(cpu[0], ref[0], **MERGE)
    torch.testing.assert_close(cpu[1], ref[1], **MERGE)


def test_an_empty_partial_leaves_a_merge_unchanged_bit_for_bit():
    """What lets a step skip an empty cpu_compute shard's call and its merge: the partial over no tokens
    (what the kernel returns for sequences of length 0) changes no merge."""
    q, k_cache, v_cache, table, lens = make_paged([70, 300, 5], 16)
    out, lse = ops.paged_partial_attention(q, k_cache, v_cache, table, lens, backend="cpu")
    empty = ops.empty_partial(q, v_cache.shape[-1])
    assert empty.tokens == 0 and torch.all(empty.out == 0) and torch.all(empty.lse == float("-inf"))
    no_tokens = ops.paged_partial_attention(q, k_cache, v_cache, table, torch.zeros_like(lens), backend="cpu")
    assert torch.equal(no_tokens[0], empty.out) and torch.equal(no_tokens[1], empty.lse)
    for parts in ([empty[:2], (out, lse)], [(out, lse), empty[:2]]):
        merged = ops.merge(parts)
        assert torch.equal(merged[0], out) and torch.equal(merged[1], lse)


def run_with_env(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})


@pytest.mark.parametrize("variant", _cpu.available_variants())
def test_environment_variable_forces_a_variant(variant):
    result = run_with_env("from writescope import _cpu; print(_cpu.__cpu_variant__)", WRITESCOPE_CPU_VARIANT=variant)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == variant


def test_unknown_variant_in_environment_fails_the_import_with_the_allowed_list():
    result = run_with_env("import writescope._cpu", WRITESCOPE_CPU_VARIANT="avx1024")
    assert result.returncode != 0
    assert "avx1024" in result.stderr and "scalar" in result.stderr


def test_thread_count_from_environment():
    result = run_with_env("from writescope import _cpu; print(_cpu.num_threads())", WRITESCOPE_NUM_THREADS="3")
    assert result.stdout.strip() == "3", result.stderr
    bad = run_with_env("import writescope._cpu", WRITESCOPE_NUM_THREADS="many")
    assert bad.returncode != 0 and "WRITESCOPE_NUM_THREADS" in bad.stderr


def test_best_variant_is_the_default():
    result = run_with_env("from writescope import _cpu; print(_cpu.__cpu_variant__)", WRITESCOPE_CPU_VARIANT="")
    assert result.stdout.strip() == _cpu.available_variants()[0]
    assert _cpu.available_variants()[-1] == "scalar"


def test_roofline_probes_return_positive_figures():
    assert all(gbps > 0 for gbps in _cpu.read_bandwidth(8 << 20, 2))
    assert all(gflops > 0 for gflops in _cpu.fma_peak(10000, 2))


def test_stream_read_takes_the_callers_arrays_whole():
    # bf16 KV as the benchmark passes it (its int16 bit pattern), float32, and bytes whose count is not
    # a multiple of 4 (the last word's remainder is not read, nothing past the array is)
    kv = ops._as_numpy(torch.randn(2, 64, 16, 32).bfloat16())
    assert _cpu.stream_read_seconds([kv]) > 0
    assert _cpu.stream_read_seconds([np.ones(1 << 20, dtype=np.float32), kv, np.ones(4099, dtype=np.uint8)]) > 0


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_strided_query_heads(cpu_variant, q_dtype):
    # q rows taken from a wider buffer (e.g. a fused qkv projection): head stride != head_dim.
    fused = torch.randn(8, 3 * 64).to(q_dtype)
    q = fused[:, 64:128]
    k = torch.randn(2, 300, 64).bfloat16()
    v = torch.randn(2, 300, 64).bfloat16()
    assert q.stride(0) == 192
    check_against_reference(q, k, v)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_offsets_beyond_int32(backend):
    # A pool of more than 2**31 elements (4.3 GB of address space, left untouched except the
    # blocks used): the used blocks sit past element 2**31, so 32-bit offsets would wrap.
    block_size, head_dim = 16, 128
    num_blocks = 2**31 // (block_size * head_dim) + 8
    k_cache = torch.empty(num_blocks, 1, block_size, head_dim, dtype=torch.bfloat16)
    v_cache = torch.empty(num_blocks, 1, block_size, head_dim, dtype=torch.bfloat16)
    used = torch.arange(num_blocks - 4, num_blocks, dtype=torch.int32)
    k_cache[used.long()] = torch.randn(4, 1, block_size, head_dim).bfloat16()
    v_cache[used.long()] = torch.randn(4, 1, block_size, head_dim).bfloat16()
    assert int(used[0]) * block_size * head_dim > 2**31
    q = torch.randn(1, 4, head_dim).bfloat16()
    table, lens = used[None], torch.tensor([60], dtype=torch.int32)
    out, lse = ops.paged_partial_attention(q, k_cache, v_cache, table, lens, backend=backend)
    k = k_cache[used.long()].permute(1, 0, 2, 3).reshape(1, 64, head_dim)[:, :60]
    v = v_cache[used.long()].permute(1, 0, 2, 3).reshape(1, 64, head_dim)[:, :60]
    ref_out, ref_lse = ops.partial_attention(q[0], k, v, backend="torch")
    tol_out = cpu_out_tolerance(q.dtype, k.dtype, v) if backend == "cpu" else ATTENTION_OUT
    assert_partials_close(out[0], lse[0], ref_out, ref_lse, tol_out)
