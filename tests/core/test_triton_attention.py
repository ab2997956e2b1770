"""Triton split-KV decode and merge against the float32 torch reference.

Runs under Triton's interpreter on the CPU (CI), and compiled on CUDA (marker gpu) where present.
Sequences stay <= 4K tokens: the interpreter runs every program in numpy.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

from tests.inputs import make_inputs, make_paged
from tests.tolerances import MERGE, assert_partials_close, cpu_out_tolerance, looser, triton_tolerances
from writescope import ops, reference

BASE = {"seq_len": 613, "head_dim": 128, "group": 4, "num_kv_heads": 2, "dtype": torch.bfloat16}


def check_against_reference(q, k, v, device, scale=None):
    out, lse = ops.partial_attention(q, k, v, scale=scale, backend="triton")
    ref_out, ref_lse = ops.partial_attention(q.cpu(), k.cpu(), v.cpu(), scale=scale, backend="torch")
    assert out.device.type == device and out.dtype == torch.float32 and lse.dtype == torch.float32
    tol_out, tol_lse = triton_tolerances(device, k.dtype)
    assert_partials_close(out.cpu(), lse.cpu(), ref_out, ref_lse, tol_out, tol_lse)


@pytest.mark.parametrize("seq_len", [0, 1, 17, 613, 4099])
def test_seq_len(triton_device, seq_len):
    check_against_reference(*make_inputs(**{**BASE, "seq_len": seq_len}, device=triton_device), triton_device)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_group(triton_device, group):
    check_against_reference(*make_inputs(**{**BASE, "group": group}, device=triton_device), triton_device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kv_dtype(triton_device, dtype):
    check_against_reference(*make_inputs(**{**BASE, "dtype": dtype}, device=triton_device), triton_device)


@pytest.mark.parametrize("head_dim", [64, 80])
def test_head_dim(triton_device, head_dim):
    check_against_reference(*make_inputs(**{**BASE, "head_dim": head_dim}, device=triton_device), triton_device)


@pytest.mark.parametrize("seq_len", [17, 613])
def test_mla_latent_loaded_once(triton_device, seq_len):
    # One kv head of 512 latent + 64 rope dims; V is the latent, a view of K.
    q = torch.randn(16, 576).bfloat16().to(triton_device)
    k = torch.randn(1, seq_len, 576).bfloat16().to(triton_device)
    check_against_reference(q, k, k[..., :512], triton_device, scale=192**-0.5)


@pytest.mark.parametrize("block_size", [16, 17])
def test_ragged_batch_with_shuffled_block_tables(triton_device, block_size):
    args = make_paged([613, 0, 1, 97, 300], block_size, device=triton_device)
    out, lse = ops.paged_partial_attention(*args, backend="triton")
    ref_out, ref_lse = ops.paged_partial_attention(*(t.cpu() for t in args), backend="torch")
    assert_partials_close(out.cpu(), lse.cpu(), ref_out, ref_lse, *triton_tolerances(triton_device, torch.bfloat16))


def test_window_and_pingpong_sources_make_one_partial(triton_device):
    """The device partial reads two sources: the newest tokens in a per-sequence window and the
    spilled tokens streamed into a ping-pong buffer; together they are the reference of both."""
    num_seqs, num_kv_heads, head_dim, window = 3, 2, 64, 40
    q = torch.randn(num_seqs, 8, head_dim).bfloat16()
    spilled = [200, 0, 75]
    newest = [13, 40, 0]
    # window: one block per sequence slot [num_seqs, num_kv_heads, window, head_dim]
    win_k = torch.randn(num_seqs, num_kv_heads, window, head_dim).bfloat16()
    win_v = torch.randn(num_seqs, num_kv_heads, window, head_dim).bfloat16()
    win_table = torch.arange(num_seqs, dtype=torch.int32)[:, None]
    # ping-pong: the spilled tokens of every sequence packed in 16-token blocks
    ping = make_paged(spilled, 16, num_kv_heads=num_kv_heads, head_dim=head_dim)
    sources = [
        ops.KVSource(win_k, win_v, win_table, torch.tensor(newest, dtype=torch.int32)),
        ops.KVSource(*ping[1:]),
    ]
    on_device = [ops.KVSource(*(t.to(triton_device) for t in source)) for source in sources]
    out, lse = ops.multi_source_partial_attention(q.to(triton_device), on_device, backend="triton")
    for s in range(num_seqs):
        k = torch.cat([reference.gather_sequence(ping[1], ping[3][s], spilled[s]), win_k[s, :, : newest[s]]], dim=1)
        v = torch.cat([reference.gather_sequence(ping[2], ping[3][s], spilled[s]), win_v[s, :, : newest[s]]], dim=1)
        ref_out, ref_lse = ops.partial_attention(q[s], k, v, backend="torch")
        assert_partials_close(out[s].cpu(), lse[s].cpu(), ref_out, ref_lse, *triton_tolerances(triton_device, k.dtype))
    cpu_out, cpu_lse = ops.multi_source_partial_attention(q, sources, backend="cpu")
    triton_out_tol, triton_lse_tol = triton_tolerances(triton_device, torch.bfloat16)
    cpu_out_tol = cpu_out_tolerance(q.dtype, torch.bfloat16, torch.cat([win_v.flatten(), ping[2].flatten()]))
    assert_partials_close(out.cpu(), lse.cpu(), cpu_out, cpu_lse, looser(triton_out_tol, cpu_out_tol), triton_lse_tol)


@pytest.mark.parametrize("split", [0, 300, 613])
def test_triton_and_cpu_halves_merge_to_the_whole(triton_device, split):
    q, k, v = make_inputs(**BASE)
    gpu_part = ops.partial_attention(*(t.to(triton_device) for t in (q, k[:, :split], v[:, :split])), backend="triton")
    cpu_part = ops.partial_attention(q, k[:, split:], v[:, split:], backend="cpu")
    outs = torch.stack([gpu_part[0].cpu(), cpu_part[0]])
    lses = torch.stack([gpu_part[1].cpu(), cpu_part[1]])
    ref_out, ref_lse = ops.partial_attention(q, k, v, backend="torch")
    triton_out_tol, lse_tol = triton_tolerances(triton_device, k.dtype)
    out_tol = looser(triton_out_tol, cpu_out_tolerance(q.dtype, k.dtype, v))
    for backend, device in (("triton", triton_device), ("cpu", "cpu"), ("torch", "cpu")):
        out, lse = ops.merge_partials(outs.to(device), lses.to(device), backend=backend)
        assert_partials_close(out.cpu(), lse.cpu(), ref_out, ref_lse, out_tol, lse_tol)


def test_merge_kernel_matches_torch_merge(triton_device):
    outs = torch.randn(5, 3, 7, 33)
    lses = torch.randn(5, 3, 7) * 10
    lses[1, 0] = -math.inf
    lses[:, 2, 3] = -math.inf
    out, lse = ops.merge_partials(outs.to(triton_device), lses.to(triton_device), backend="triton")
    ref_out, ref_lse = ops.merge_partials(outs, lses, backend="torch")
    torch.testing.assert_close(out.cpu(), ref_out, **MERGE)
    torch.testing.assert_close(lse.cpu(), ref_lse, **MERGE)
    assert torch.all(out[2, 3] == 0) and lse[2, 3] == -math.inf


def test_bad_block_table_is_refused_before_the_kernel(triton_device):
    q, k_cache, v_cache, table, lens = make_paged([40], 16, device=triton_device)
    table[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]"):
        ops.paged_partial_attention(q, k_cache, v_cache, table, lens, backend="triton")
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 99"):
        ops.paged_partial_attention(q, k_cache, v_cache, table, torch.full_like(lens, 99), backend="triton")


def test_paired_source_is_attended_and_its_blocks_checked(triton_device):
    # cpu_compute's paired blocks (the monolithic baseline ships them as they are)
    from writescope.kv_format import to_paired

    q, k_cache, v_cache, table, lens = make_paged([613, 97], 16, device=triton_device)
    paired = ops.KVSource(to_paired("k", k_cache), to_paired("v", v_cache), table, lens)
    out, lse = ops.multi_source_partial_attention(q, [paired], backend="triton")
    ref_out, ref_lse = ops.paged_partial_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), table.cpu(), lens.cpu(),
                                                   backend="torch")
    assert_partials_close(out.cpu(), lse.cpu(), ref_out, ref_lse, *triton_tolerances(triton_device, torch.bfloat16))
    bad = table.clone()
    bad[1, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]"):
        ops.multi_source_partial_attention(q, [paired._replace(block_table=bad)], backend="triton")


def test_cpu_tensors_need_the_interpreter():
    code = ("import torch; from writescope import ops\n"
            "try:\n    ops.partial_attention(torch.randn(4, 16), torch.randn(1, 3, 16), torch.randn(1, 3, 16),"
            " backend='triton')\nexcept ValueError as e:\n    print(e)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "TRITON_INTERPRET=1" in result.stdout, result.stderr


@pytest.mark.parametrize("num_seqs, num_kv_heads, capacity, num_sms, expected", [
    (1, 8, 8192, 132, 128),  # 1 x 8K on an H200: 512 programs, twice the fixed 256-token split's
    (1, 8, 32768, 132, 256),
    (4, 4, 131072, 132, 2048),  # 1024 programs, not 8192 of 256 tokens
    (64, 8, 32768, 132, 8192),  # the cap: 2048 programs still fill the GPU
    (1, 1, 100, 132, 128),  # the floor: one short program
    (1, 2, 4112, 1, 2048),  # the interpreter's one "SM"
])
def test_split_size_follows_the_work_and_the_sms(triton_device, num_seqs, num_kv_heads, capacity, num_sms, expected):
    from writescope import triton_attention as ta

    split = ta.split_tokens(num_seqs, num_kv_heads, capacity, num_sms)
    assert split == expected
    programs = num_seqs * num_kv_heads * -(-capacity // split)
    target = ta.PROGRAMS_PER_SM * num_sms
    assert programs <= target + num_seqs * num_kv_heads or split in (ta.MIN_SPLIT_TOKENS, ta.MAX_SPLIT_TOKENS)
    if ta.MIN_SPLIT_TOKENS < split < ta.MAX_SPLIT_TOKENS:
        assert programs > target / 4  # the GPU is filled, not left to a few long programs


@pytest.mark.parametrize("split", [32, 96, 512, 8192])
def test_any_split_size_gives_the_reference(triton_device, split):
    from writescope import triton_attention as ta

    q, k_cache, v_cache, table, lens = make_paged([613, 0, 97, 300], 16, device=triton_device)
    out, lse = ta.paged_attention(q, [ops.KVSource(k_cache, v_cache, table, lens)], 64**-0.5, split=split)
    ref_out, ref_lse = ops.paged_partial_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), table.cpu(), lens.cpu(),
                                                   backend="torch")
    assert_partials_close(out.cpu(), lse.cpu(), ref_out, ref_lse, *triton_tolerances(triton_device, torch.bfloat16))


@pytest.mark.parametrize("split", [0, 16, 100])
def test_split_off_the_inner_step_is_refused(triton_device, split):
    from writescope import triton_attention as ta

    q, k_cache, v_cache, table, lens = make_paged([40], 16, device=triton_device)
    with pytest.raises(ValueError, match=f"split must be a positive multiple of 32 tokens, got {split}"):
        ta.paged_attention(q, [ops.KVSource(k_cache, v_cache, table, lens)], 0.1, split=split)
