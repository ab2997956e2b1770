"""The torch reference is the oracle for the kernels: check it against torch SDPA and the math."""

import math

import pytest
import torch

from tests.tolerances import MERGE
from writescope import ops, reference


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 8), (8, 2), (16, 1)])
def test_reference_matches_sdpa(num_q_heads, num_kv_heads):
    q = torch.randn(num_q_heads, 64)
    k = torch.randn(num_kv_heads, 97, 64)
    v = torch.randn(num_kv_heads, 97, 48)
    out, lse = reference.attention(q, k, v, scale=0.125)
    group = num_q_heads // num_kv_heads
    k_rep = k.repeat_interleave(group, dim=0)
    v_rep = v.repeat_interleave(group, dim=0)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[:, None, :], k_rep, v_rep, scale=0.125
    )[:, 0, :]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    scores = torch.einsum("hd,htd->ht", q, k_rep) * 0.125
    torch.testing.assert_close(lse, torch.log(torch.exp(scores.double()).sum(-1)).float(), atol=1e-5, rtol=1e-6)


def test_reference_empty_sequence_is_zero_and_minus_inf():
    out, lse = reference.attention(torch.randn(4, 16), torch.randn(2, 0, 16), torch.randn(2, 0, 8), 0.25)
    assert out.shape == (4, 8) and torch.all(out == 0)
    assert torch.all(lse == -math.inf)


def test_reference_paged_gathers_blocks_in_table_order():
    k_cache = torch.randn(5, 2, 3, 8)
    v_cache = torch.randn(5, 2, 3, 8)
    table = torch.tensor([[4, 0, 2]], dtype=torch.int32)
    k = reference.gather_sequence(k_cache, table[0], 7)
    assert torch.equal(k[:, 0:3], k_cache[4])
    assert torch.equal(k[:, 3:6], k_cache[0])
    assert torch.equal(k[:, 6:7], k_cache[2, :, :1])
    q = torch.randn(1, 4, 8)
    out, lse = reference.paged_attention(q, k_cache, v_cache, table, torch.tensor([7], dtype=torch.int32), 0.3)
    direct_out, direct_lse = reference.attention(q[0], k, reference.gather_sequence(v_cache, table[0], 7), 0.3)
    assert torch.equal(out[0], direct_out) and torch.equal(lse[0], direct_lse)


def test_merge_of_two_halves_is_the_whole():
    q, k, v = torch.randn(8, 32), torch.randn(2, 50, 32), torch.randn(2, 50, 16)
    whole = reference.attention(q, k, v, 0.2)
    a = reference.attention(q, k[:, :20], v[:, :20], 0.2)
    b = reference.attention(q, k[:, 20:], v[:, 20:], 0.2)
    out, lse = ops.merge_partials(torch.stack([a[0], b[0]]), torch.stack([a[1], b[1]]))
    torch.testing.assert_close(out, whole[0], **MERGE)
    torch.testing.assert_close(lse, whole[1], **MERGE)


def test_merge_all_empty_parts_gives_zero_and_minus_inf():
    outs = torch.randn(3, 4, 8)
    lses = torch.full((3, 4), -math.inf)
    out, lse = ops.merge_partials(outs, lses)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_merge_with_one_empty_part_returns_the_other():
    outs = torch.randn(2, 4, 8)
    lses = torch.stack([torch.randn(4), torch.full((4,), -math.inf)])
    out, lse = ops.merge_partials(outs, lses)
    torch.testing.assert_close(out, outs[0], **MERGE)
    torch.testing.assert_close(lse, lses[0], **MERGE)
