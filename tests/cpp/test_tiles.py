"""The shapes the amx variant runs as tile products (4 heads or more per kv head in the paired layout, 8 to
16 token-major; blocks of whole 16 tokens), in both layouts, against the float32 torch reference; on every
other variant the same calls take the vector paths, so the tests hold everywhere. Unused block slots hold
NaN: nothing there may reach a result."""

import pytest
import torch

from tests.cpp.test_paired_layout import as_paired, assert_identical, paged, results_for_thread_counts
from tests.tolerances import assert_partials_close, cpu_out_tolerance
from writescope import _cpu, ops


def reference(q, source):
    return ops.paged_partial_attention(q, *source, backend="torch")


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("group", [4, 8, 16, 24])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_paired_tiles(cpu_variant, q_dtype, group, block_size):
    q, source = paged([613, 77, 16, 1], block_size, group=group, q_dtype=q_dtype)
    out, lse, _ = ops.cpu_paged_attention_timed(q, as_paired(source), 128**-0.5)
    tol_out = cpu_out_tolerance(q.dtype, source.k_cache.dtype, source.v_cache)
    assert_partials_close(out, lse, *reference(q, source), tol_out)


def head_major(source: ops.KVSource) -> ops.KVSource:
    """The cache's storage: [num_kv_heads, num_blocks, <block>] seen as [num_blocks, num_kv_heads,
    <block>], so one head's blocks of consecutive ids lie one after the other."""
    def relaid(blocks):
        return blocks.transpose(0, 1).contiguous().transpose(0, 1)

    return ops.KVSource(relaid(source.k_cache), relaid(source.v_cache), *source[2:])


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("run_blocks", [2, 3, 256])
@pytest.mark.parametrize("group", [8, 16])
def test_paired_tiles_over_consecutive_blocks(cpu_variant, q_dtype, run_blocks, group):
    """16-token blocks with consecutive ids: the amx variant takes two blocks' V, 32 tokens, in one tile
    product wherever a tile's pairs of blocks lie one after the other (runs of 3: some tiles do, some do
    not), and 16 tokens elsewhere."""
    q, source = paged([613, 77, 96, 33, 1], 16, group=group, q_dtype=q_dtype, run_blocks=run_blocks)
    out, lse, _ = ops.cpu_paged_attention_timed(q, head_major(as_paired(source)), 128**-0.5)
    assert_partials_close(out, lse, *reference(q, source),
                          cpu_out_tolerance(q.dtype, source.k_cache.dtype, source.v_cache))


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group, head_dims", [(16, (576, 512)), (8, (128, 128)), (16, (64, 32)), (16, (96, 64)),
                                              (8, (160, 96)), (12, (96, 64))])
@pytest.mark.parametrize("block_size", [16, 48])
def test_token_major_tiles(cpu_variant, q_dtype, group, head_dims, block_size):
    q, source = paged([613, 77, 32, 3], block_size, num_kv_heads=1, group=group, head_dim_k=head_dims[0],
                      head_dim_v=head_dims[1], q_dtype=q_dtype)
    out, lse, _ = ops.cpu_paged_attention_timed(q, source, 0.07)
    assert_partials_close(out, lse, *ops.paged_partial_attention(q, *source, scale=0.07, backend="torch"),
                          cpu_out_tolerance(q.dtype, source.k_cache.dtype, source.v_cache))


def test_mla_latent_as_value_prefix(cpu_variant):
    q, source = paged([1000, 45], 16, num_kv_heads=1, group=16, head_dim_k=576, head_dim_v=576)
    latent = ops.KVSource(source.k_cache, source.k_cache[..., :512], *source[2:])
    out, lse, _ = ops.cpu_paged_attention_timed(q, latent, 192**-0.5)
    assert_partials_close(out, lse, *ops.paged_partial_attention(q, *latent, scale=192**-0.5, backend="torch"),
                          cpu_out_tolerance(q.dtype, latent.k_cache.dtype, latent.v_cache))


@pytest.mark.parametrize("layout", ["paired", "token_major"])
def test_tile_results_are_identical_for_any_thread_count(layout):
    q, source = paged([4099, 1500], 16, num_kv_heads=2, group=16, head_dim_k=128, head_dim_v=128)
    source = as_paired(source) if layout == "paired" else source
    assert_identical(results_for_thread_counts(q, source))


def test_the_instructions_reported_follow_the_variant_and_shape():
    default = _cpu.__cpu_variant__
    try:
        for variant in _cpu.available_variants():
            _cpu.set_variant(variant)
            tiles = ("tile", "tile")
            assert (_cpu.multiply_add_instructions("paired", 8, 128, 128, 16) == tiles) == (variant == "amx")
            assert (_cpu.multiply_add_instructions("token_major", 16, 576, 512, 16) == tiles) == (variant == "amx")
            vector = "dot" if _cpu.uses_bf16_dot() else "fma"  # bf16 q.K and PV: the dot where it measured faster
            assert (_cpu.multiply_add_instructions("paired", 4, 128, 128, 16) == tiles) == (variant == "amx")
            assert _cpu.multiply_add_instructions("paired", 2, 128, 128, 16) == (vector, vector)
            assert _cpu.multiply_add_instructions("token_major", 4, 576, 512, 16) == (vector, vector)
            if variant not in ("avx512bf16", "amx"):
                assert not _cpu.uses_bf16_dot()  # no bf16 dot instruction to use
            # bf16 q and KV have their probabilities rounded on the bf16 dot path and on the tiles only
            assert _cpu.rounds_probabilities() == (_cpu.uses_bf16_dot() or variant == "amx")
            assert _cpu.multiply_add_instructions("paired", 8, 128, 128, 8)[1] == vector  # half-tile blocks
    finally:
        _cpu.set_variant(default)
    with pytest.raises(ValueError, match="allowed: token_major, paired"):
        _cpu.multiply_add_instructions("vnni", 8, 128, 128, 16)
