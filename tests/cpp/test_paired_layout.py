"""The paired block layout (cpu_compute's): the C++ kernel over it against the float32 torch reference,
its results across thread counts, its argument checks, and the layout written by the cache itself."""

import numpy as np
import pytest
import torch

from tests.cpp.test_bad_arguments import call_kernel, valid_kernel_args
from tests.inputs import stepped_scores
from tests.tolerances import assert_partials_close, cpu_out_tolerance
from writescope import _cpu, ops, reference
from writescope.inplace_kv_cache import CacheConfig, InplaceKVCache
from writescope.kv_format import KVFormat, from_paired, to_paired
from writescope.policies import make_policy


def paged(lens, block_size, *, num_kv_heads=2, group=4, head_dim_k=128, head_dim_v=128, dtype=torch.bfloat16,
          q_dtype=torch.bfloat16, seed=0, run_blocks=1):
    """A ragged batch in shuffled blocks: q and the token-major source, with NaN in every slot past a
    sequence's end (nothing there may reach the result). run_blocks: the block ids in runs of that
    many consecutive ids (as an allocator extent gives them), the runs shuffled."""
    generator = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + 3
    k = torch.randn(num_blocks, num_kv_heads, block_size, head_dim_k, generator=generator).to(dtype)
    v = torch.randn(num_blocks, num_kv_heads, block_size, head_dim_v, generator=generator).to(dtype)
    runs = torch.arange(num_blocks).split(run_blocks)
    order = torch.cat([runs[i] for i in torch.randperm(len(runs), generator=generator)])
    table = torch.zeros(len(lens), max(counts + [1]), dtype=torch.int32)
    first = 0
    for s, (n, count) in enumerate(zip(lens, counts, strict=True)):
        table[s, :count] = order[first:first + count]
        first += count
        if n % block_size:
            k[table[s, count - 1], :, n % block_size:] = float("nan")
            v[table[s, count - 1], :, n % block_size:] = float("nan")
    q = torch.randn(len(lens), num_kv_heads * group, head_dim_k, generator=generator).to(q_dtype)
    return q, ops.KVSource(k, v, table, torch.tensor(lens, dtype=torch.int32))


def as_paired(source: ops.KVSource) -> ops.KVSource:
    return ops.KVSource(to_paired("k", source.k_cache), to_paired("v", source.v_cache), *source[2:])


def check(q, source):
    out, lse, _ = ops.cpu_paged_attention_timed(q, as_paired(source), source.k_cache.shape[-1] ** -0.5)
    ref_out, ref_lse = ops.paged_partial_attention(q, *source, backend="torch")
    assert_partials_close(out, lse, ref_out, ref_lse, cpu_out_tolerance(q.dtype, source.k_cache.dtype, source.v_cache))


@pytest.mark.parametrize("lens", [[613, 64], [0, 1, 97], [4099]])
def test_lengths(cpu_variant, lens):
    check(*paged(lens, 16))


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16])
def test_group(cpu_variant, group):
    check(*paged([613, 77], 16, group=group))


@pytest.mark.parametrize("group", [1, 4, 8])
def test_scores_that_creep_jump_and_underflow(cpu_variant, group):
    # See the token-major test of the same name: the paired kernel's softmax is the same function.
    q, k, v = stepped_scores(group=group)
    blocks = 39  # 613 tokens in blocks of 16, shuffled
    order = torch.randperm(blocks)

    def stored(array):
        tail = torch.zeros(array.shape[0], blocks * 16 - 613, array.shape[-1], dtype=array.dtype)
        padded = torch.cat([array, tail], 1)
        by_block = padded.unflatten(1, (blocks, 16)).transpose(0, 1)  # [logical block, kv, 16, dim]
        physical = torch.empty_like(by_block)
        physical[order] = by_block
        return physical

    table = order.to(torch.int32)[None]
    check(q[None], ops.KVSource(stored(k), stored(v), table, torch.tensor([613], dtype=torch.int32)))


# 70: an odd count of dim pairs (the bf16 dot score loop sums even and odd pairs apart)
@pytest.mark.parametrize("head_dims", [(64, 64), (70, 66), (72, 80), (80, 40), (128, 128)])
@pytest.mark.parametrize("block_size", [2, 4, 6, 16, 32, 100])
def test_head_dims_and_block_sizes(cpu_variant, head_dims, block_size):
    check(*paged([613, 77, 5], block_size, head_dim_k=head_dims[0], head_dim_v=head_dims[1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes(cpu_variant, dtype, q_dtype):
    check(*paged([613, 31], 16, dtype=dtype, q_dtype=q_dtype))


@pytest.mark.parametrize("chunk_tokens", [1, 7, 16, 100, 2**63 - 1])
def test_chunks_are_rounded_to_whole_blocks_without_changing_the_result(chunk_tokens):
    q, source = paged([1200, 613], 16)
    paired = as_paired(source)
    out = torch.empty(2, q.shape[1], 128)
    lse = torch.empty(2, q.shape[1])
    _cpu.paged_attention(*(ops._as_numpy(t) for t in (q, *paired)), out.numpy(), lse.numpy(), q_dtype="bfloat16",
                         kv_dtype="bfloat16", layout="paired", scale=128**-0.5, chunk_tokens=chunk_tokens)
    ref_out, ref_lse = ops.paged_partial_attention(q, *source, backend="torch")
    assert_partials_close(out, lse, ref_out, ref_lse, cpu_out_tolerance(q.dtype, source.k_cache.dtype, source.v_cache))


def results_for_thread_counts(q, source, scale=0.1):
    """(out, lse) of the same call with 1, 2 and 3 kernel threads."""
    default_threads = _cpu.num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            _cpu.set_num_threads(threads)
            results.append(ops.cpu_paged_attention_timed(q, source, scale)[:2])
    finally:
        _cpu.set_num_threads(default_threads)
    return results


def assert_identical(results):
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


def test_result_is_identical_for_any_thread_count():
    q, source = paged([4099, 1500], 16)
    assert_identical(results_for_thread_counts(q, as_paired(source)))


def probabilities_rounded_once(q, source, scale, lone_last_float32: bool):
    """out of one sequence of one tile (64 tokens or fewer) as the rounding paths compute it: float32
    scores and probabilities, each probability rounded to bf16 for PV (except a lone last token's, of
    an odd count, on the bf16-dot path: lone_last_float32; the AMX tiles round it too), the float32
    sum as the normaliser. q [1, num_q_heads, head_dim_qk]."""
    seq_len = int(source.seq_lens[0])
    k = reference.gather_sequence(source.k_cache, source.block_table[0], seq_len).float()
    v = reference.gather_sequence(source.v_cache, source.block_table[0], seq_len).float()
    num_kv_heads = k.shape[0]
    q_grouped = q[0].float().reshape(num_kv_heads, -1, k.shape[-1])
    scores = q_grouped @ k.transpose(1, 2) * scale  # [num_kv_heads, group, seq_len]
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    rounded = p.bfloat16().float()
    if seq_len % 2 and lone_last_float32:
        rounded[..., -1] = p[..., -1]
    return ((rounded @ v) / p.sum(-1, keepdim=True)).reshape(1, q.shape[1], v.shape[-1])


@pytest.mark.parametrize("layout", ["paired", "token_major"])
@pytest.mark.parametrize("seq_len", [64, 61])
def test_bf16_q_and_kv_have_each_probability_rounded_to_bf16_once(layout, seq_len):
    if not ops.cpu_rounds_probabilities(torch.bfloat16, torch.bfloat16):
        pytest.skip(f"variant {_cpu.__cpu_variant__} here takes PV in float32 FMAs (no faster bf16 dot, no AMX)")
    q, source = paged([seq_len], 16, num_kv_heads=2, group=8)
    out, _, _ = ops.cpu_paged_attention_timed(q, as_paired(source) if layout == "paired" else source, 0.09)
    expected = probabilities_rounded_once(q, source, 0.09, lone_last_float32=_cpu.uses_bf16_dot())
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    float32_out, _ = ops.paged_partial_attention(q, *source, scale=0.09, backend="torch")
    assert (out - float32_out).abs().max() > 1e-4  # the rounding is visible: the test tells the two apart


def test_to_paired_round_trips_and_is_the_kernels_layout():
    blocks = torch.randn(3, 2, 16, 8)  # [num_blocks, num_kv_heads, block_size, head_dim]
    k, v = to_paired("k", blocks), to_paired("v", blocks)
    assert k.shape == (3, 2, 4, 16, 2) and v.shape == (3, 2, 8, 8, 2)
    assert torch.equal(k[1, 0, 3, 5], blocks[1, 0, 5, 6:8])  # dim pair 3 of token 5
    assert torch.equal(v[1, 0, 2, 7], blocks[1, 0, 4:6, 7])  # dim 7 of token pair 2
    assert torch.equal(from_paired("k", k), blocks) and torch.equal(from_paired("v", v), blocks)


def test_the_cache_writes_cpu_compute_in_the_paired_layout_at_prefill_and_at_window_flush():
    fmt = KVFormat(num_layers=2, num_kv_heads=2, head_dim_k=8, head_dim_v=6, block_size=4)
    config = CacheConfig(format=fmt, compute_blocks_per_shard=16, transfer_blocks=0, max_seqs=2,
                         pingpong_blocks=4, window_tokens=8)
    with InplaceKVCache(config, make_policy("all_cpu")) as cache:
        cache.admit("a", prompt_len=10, max_new_tokens=6)
        generator = torch.Generator().manual_seed(1)
        written = {layer: [torch.randn(2, 10, d, generator=generator).bfloat16() for d in (8, 6)] for layer in (0, 1)}
        for layer, (k, v) in written.items():
            cache.write_prefill("a", layer, k, v)
        for _ in range(6):  # the window reaches 8 tokens and flushes as two sealed blocks
            for layer, arrays in written.items():
                new = [torch.randn(2, 1, a.shape[-1], generator=generator).bfloat16() for a in arrays]
                cache.append("a", layer, new[0][:, 0], new[1][:, 0])
                written[layer] = [torch.cat([a, n], dim=1) for a, n in zip(arrays, new, strict=True)]
            cache.commit(["a"])
        blocks = [p.block for p in cache.seqs["a"].blocks]
        assert len(blocks) == 4  # two at prefill, two from the flush
        region = cache.compute[0]
        for layer, (k, v) in written.items():
            for index, block in enumerate(blocks):
                tokens = slice(index * 4, index * 4 + 4)
                assert torch.equal(region.k[layer, :, block], to_paired("k", k[:, tokens]))
                assert torch.equal(region.v[layer, :, block], to_paired("v", v[:, tokens]))
            got = cache.sequence_kv("a", layer)
            assert torch.equal(got[0], k) and torch.equal(got[1], v)


def test_formats_the_pairs_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="block_size must be even"):
        KVFormat(num_layers=1, num_kv_heads=1, head_dim_k=8, head_dim_v=8, block_size=5)
    with pytest.raises(ValueError, match="head_dim_v must be even"):
        KVFormat(num_layers=1, num_kv_heads=1, head_dim_k=8, head_dim_v=7)
    KVFormat(num_layers=1, num_kv_heads=1, head_dim_k=9, head_dim_v=7, block_size=5, v_in_k=True)  # MLA: token-major


def paired_kernel_args():
    """valid_kernel_args with K and V in the paired layout: the same 2 sequences, heads and block size."""
    rng = np.random.default_rng(0)
    return {**valid_kernel_args(), "layout": "paired",
            "k_cache": rng.standard_normal((3, 2, 4, 4, 2), dtype=np.float32),
            "v_cache": rng.standard_normal((3, 2, 2, 6, 2), dtype=np.float32)}


def test_valid_paired_arguments_run():
    args = paired_kernel_args()
    call_kernel(args)
    assert np.isfinite(args["out"]).all() and np.isfinite(args["lse"]).all()


@pytest.mark.parametrize("change, message", [
    ({"layout": "vnni"}, "layout: 'vnni' is not supported; allowed: token_major, paired"),
    ({"k_cache": np.zeros((3, 2, 4, 8), np.float32)}, "k_cache: expected a 5-d array"),
    ({"v_cache": np.zeros((3, 2, 4, 6), np.float32)}, "v_cache: expected a 5-d array"),
    ({"k_cache": np.zeros((3, 2, 4, 5, 2), np.float32)}, "even block_size"),
    ({"k_cache": np.zeros((3, 2, 3, 4, 2), np.float32)}, "head_dim_qk / 2"),
    ({"k_cache": np.zeros((3, 2, 4, 4, 1), np.float32)}, "the pair"),
    ({"v_cache": np.zeros((3, 2, 4, 6, 2), np.float32)}, "block_size / 2"),
    ({"k_cache": np.zeros((3, 2, 4, 2, 4), np.float32).transpose(0, 1, 2, 4, 3)}, "must be contiguous"),
    ({"v_cache": np.zeros((3, 2, 6, 2, 2), np.float32).transpose(0, 1, 3, 2, 4)}, "must be contiguous"),
    ({"block_table": np.array([[0, 3], [2, 0]], np.int32)}, r"block_table\[0, 1\] = 3 is outside \[0, 3\)"),
    ({"seq_lens": np.array([9, 3], np.int32)}, r"seq_lens\[0\] = 9 is outside \[0, 8\]"),
])
def test_paired_kernel_rejects(change, message):
    with pytest.raises(ValueError, match=message):
        call_kernel({**paired_kernel_args(), **change})


@pytest.mark.parametrize("variant", _cpu.available_variants())
def test_the_multiply_add_probes_and_the_dot_choice(variant):
    default = _cpu.__cpu_variant__
    try:
        _cpu.set_variant(variant)
        assert isinstance(_cpu.uses_bf16_dot(), bool)
        if variant in ("amx", "avx512bf16"):
            assert min(_cpu.dot_peak(100_000, 2)) > 0
        else:
            assert not _cpu.uses_bf16_dot()
            with pytest.raises(ValueError, match="has no bf16 dot product"):
                _cpu.dot_peak(100_000, 2)
        if variant == "amx":  # the tiles' peak: well above the FMA peak wherever AMX exists
            assert min(_cpu.tile_peak(100_000, 2)) > max(_cpu.fma_peak(1_000_000, 2))
        else:
            with pytest.raises(ValueError, match="has no AMX tiles"):
                _cpu.tile_peak(100_000, 2)
    finally:
        _cpu.set_variant(default)
