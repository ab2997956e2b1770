"""Every argument check: a ValueError naming the argument, never a crash, copy or stray read."""

import numpy as np
import pytest
import torch

from writescope import _cpu, ops


def valid_kernel_args():
    """Numpy arguments of _cpu.paged_attention: 2 sequences, 4 q heads, 2 kv heads, block 4."""
    rng = np.random.default_rng(0)
    return {
        "q": rng.standard_normal((2, 4, 8), dtype=np.float32),
        "k_cache": rng.standard_normal((3, 2, 4, 8), dtype=np.float32),
        "v_cache": rng.standard_normal((3, 2, 4, 6), dtype=np.float32),
        "block_table": np.array([[0, 1], [2, 0]], dtype=np.int32),
        "seq_lens": np.array([5, 3], dtype=np.int32),
        "out": np.zeros((2, 4, 6), dtype=np.float32),
        "lse": np.zeros((2, 4), dtype=np.float32),
        "q_dtype": "float32",
        "kv_dtype": "float32",
        "scale": 0.5,
    }


def call_kernel(args):
    args = dict(args)
    arrays = [args.pop(n) for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "out", "lse")]
    _cpu.paged_attention(*arrays, **args)


def test_valid_arguments_run():
    args = valid_kernel_args()
    call_kernel(args)
    assert np.isfinite(args["out"]).all() and np.isfinite(args["lse"]).all()


def readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


KERNEL_CASES = {
    "q_dtype name": ({"q_dtype": "int8"}, "q_dtype"),
    "kv_dtype name": ({"kv_dtype": "float64"}, "kv_dtype"),
    "q rank": ({"q": np.zeros((4, 8), np.float32)}, "q: expected a 3-d"),
    "k rank": ({"k_cache": np.zeros((3, 2, 4), np.float32)}, "k_cache: expected a 4-d"),
    "v rank": ({"v_cache": np.zeros((3, 2, 4), np.float32)}, "v_cache: expected a 4-d"),
    "table rank": ({"block_table": np.zeros(2, np.int32)}, "block_table: expected a 2-d"),
    "lens rank": ({"seq_lens": np.zeros((2, 1), np.int32)}, "seq_lens: expected a 1-d"),
    "out rank": ({"out": np.zeros((2, 24), np.float32)}, "out: expected a 3-d"),
    "lse rank": ({"lse": np.zeros(8, np.float32)}, "lse: expected a 2-d"),
    "q element type": ({"q": np.zeros((2, 4, 8), np.float64)}, "q: element type"),
    "k element type": ({"k_cache": np.zeros((3, 2, 4, 8), np.float16)}, "k_cache: element type"),
    "v element type": ({"v_cache": np.zeros((3, 2, 4, 6), np.int16)}, "v_cache: element type"),
    "bf16 declared, float given": (
        {"kv_dtype": "bfloat16", "v_cache": np.zeros((3, 2, 4, 6), np.int16)}, "k_cache: element type"),
    "table int64": ({"block_table": np.zeros((2, 2), np.int64)}, "block_table: expected int32"),
    "lens int64": ({"seq_lens": np.zeros(2, np.int64)}, "seq_lens: expected int32"),
    "out float64": ({"out": np.zeros((2, 4, 6), np.float64)}, "out: element type"),
    "lse float16": ({"lse": np.zeros((2, 4), np.float16)}, "lse: element type"),
    "group": ({"q": np.zeros((2, 3, 8), np.float32), "out": np.zeros((2, 3, 6), np.float32),
               "lse": np.zeros((2, 3), np.float32)}, "multiple of num_kv_heads"),
    "zero heads": ({"q": np.zeros((2, 0, 8), np.float32), "out": np.zeros((2, 0, 6), np.float32),
                    "lse": np.zeros((2, 0), np.float32)}, "must be >= 1"),
    "k head_dim": ({"k_cache": np.zeros((3, 2, 4, 7), np.float32)}, "k_cache: dimension 3"),
    "v blocks": ({"v_cache": np.zeros((2, 2, 4, 6), np.float32)}, "v_cache: dimension 0"),
    "v heads": ({"v_cache": np.zeros((3, 1, 4, 6), np.float32)}, "v_cache: dimension 1"),
    "v block size": ({"v_cache": np.zeros((3, 2, 5, 6), np.float32)}, "v_cache: dimension 2"),
    "table rows": ({"block_table": np.zeros((3, 2), np.int32)}, "block_table: dimension 0"),
    "lens rows": ({"seq_lens": np.zeros(3, np.int32)}, "seq_lens: dimension 0"),
    "out head_dim_v": ({"out": np.zeros((2, 4, 8), np.float32)}, "out: dimension 2"),
    "lse heads": ({"lse": np.zeros((2, 5), np.float32)}, "lse: dimension 1"),
    "scale nan": ({"scale": float("nan")}, "scale must be finite"),
    "q last dim strided": ({"q": np.zeros((2, 4, 16), np.float32)[:, :, ::2]}, "q: the last dimension"),
    "k negative stride": ({"k_cache": np.zeros((3, 2, 4, 8), np.float32)[::-1]}, "k_cache: stride"),
    "lens strided": ({"seq_lens": np.zeros(4, np.int32)[::2]}, "seq_lens: the last dimension must be contiguous"),
    "out strided": ({"out": np.zeros((2, 8, 6), np.float32)[:, ::2]}, "out: must be C-contiguous"),
    "out read-only": ({"out": readonly(np.zeros((2, 4, 6), np.float32))}, "out: must be writeable"),
    "lse read-only": ({"lse": readonly(np.zeros((2, 4), np.float32))}, "lse: must be writeable"),
    "seq_len beyond table": ({"seq_lens": np.array([9, 3], np.int32)}, "seq_lens[0] = 9 is outside [0, 8]"),
    "negative seq_len": ({"seq_lens": np.array([5, -1], np.int32)}, "seq_lens[1] = -1"),
    "block index too large": ({"block_table": np.array([[0, 3], [2, 0]], np.int32)}, "block_table[0, 1] = 3"),
    "negative block index": ({"block_table": np.array([[0, 1], [-1, 0]], np.int32)}, "block_table[1, 0] = -1"),
    "chunk_tokens": ({"chunk_tokens": 0}, "chunk_tokens must be >= 1"),
}


@pytest.mark.parametrize("change,message", KERNEL_CASES.values(), ids=KERNEL_CASES.keys())
def test_kernel_rejects(change, message):
    args = {**valid_kernel_args(), **change}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call_kernel(args)


def test_kernel_refuses_conversion_of_non_arrays():
    args = valid_kernel_args()
    args["q"] = args["q"].tolist()
    with pytest.raises(TypeError):
        call_kernel(args)


def test_unused_block_table_entries_are_not_checked():
    args = valid_kernel_args()
    args["block_table"] = np.array([[0, 1], [2, -7]], np.int32)  # sequence 1 uses one block only
    call_kernel(args)


def valid_merge_args():
    return {
        "outs": np.zeros((2, 3, 4), np.float32),
        "lses": np.zeros((2, 3), np.float32),
        "out": np.zeros((3, 4), np.float32),
        "lse": np.zeros(3, np.float32),
    }


MERGE_CASES = {
    "outs rank": ({"outs": np.zeros((2, 12), np.float32)}, "outs: expected a 3-d"),
    "lses rank": ({"lses": np.zeros(6, np.float32)}, "lses: expected a 2-d"),
    "outs float64": ({"outs": np.zeros((2, 3, 4), np.float64)}, "outs: element type"),
    "lses parts": ({"lses": np.zeros((1, 3), np.float32)}, "lses: dimension 0"),
    "out dim": ({"out": np.zeros((3, 5), np.float32)}, "out: dimension 1"),
    "lse rows": ({"lse": np.zeros(2, np.float32)}, "lse: dimension 0"),
    "outs strided": ({"outs": np.zeros((2, 6, 4), np.float32)[:, ::2]}, "outs: must be C-contiguous"),
    "out read-only": ({"out": readonly(np.zeros((3, 4), np.float32))}, "out: must be writeable"),
    "nan lse": ({"lses": np.array([[0, np.nan, 0], [0, 0, 0]], np.float32)}, "NaN or \\+inf"),
    "+inf lse": ({"lses": np.array([[0, 0, 0], [np.inf, 0, 0]], np.float32)}, "NaN or \\+inf"),
}


@pytest.mark.parametrize("change,message", MERGE_CASES.values(), ids=MERGE_CASES.keys())
def test_merge_rejects(change, message):
    args = {**valid_merge_args(), **change}
    with pytest.raises(ValueError, match=message):
        _cpu.merge_partials(**args)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: _cpu.set_variant("avx1024"), "avx1024.*allowed: .*scalar"),
        (lambda: _cpu.set_num_threads(0), "num_threads must be >= 1"),
        (lambda: _cpu.set_num_threads(2, [-1]), "cpus: -1"),
        (lambda: _cpu.read_bandwidth(1000, 1), "num_bytes must be >= 1 MiB"),
        (lambda: _cpu.read_bandwidth(1 << 20, 0), "repeats must be >= 1"),
        (lambda: _cpu.fma_peak(0, 1), "iterations must be >= 1"),
        (lambda: _cpu.stream_read_seconds([]), "buffers: expected at least one array, got none"),
        (lambda: _cpu.stream_read_seconds([torch.ones(4)]), r"buffers\[0\]: expected a numpy array, got Tensor"),
        (lambda: _cpu.stream_read_seconds([np.ones(4), [1.0]]), r"buffers\[1\]: expected a numpy array, got list"),
        (lambda: _cpu.stream_read_seconds([np.ones((4, 4))[:, ::2]]), r"buffers\[0\]: must be C-contiguous"),
        (lambda: _cpu.stream_read_seconds([np.ones(3, dtype=np.uint8)]), r"buffers\[0\]: must hold at least 4 bytes"),
    ],
)
def test_runtime_controls_reject(call, message):
    with pytest.raises(ValueError, match=message):
        call()
    assert _cpu.num_threads() >= 1


def tensors():
    return torch.randn(8, 64), torch.randn(2, 10, 64).bfloat16(), torch.randn(2, 10, 64).bfloat16()


OPS_CASES = {
    "backend": (lambda q, k, v: ops.partial_attention(q, k, v, backend="gpu"), "backend must be one of"),
    "q not a tensor": (lambda q, k, v: ops.partial_attention(q.numpy(), k, v), "q must be a torch.Tensor"),
    "q rank": (lambda q, k, v: ops.partial_attention(q[None], k, v), "q must be 2-d"),
    "q dtype": (lambda q, k, v: ops.partial_attention(q.double(), k, v), "q has dtype float64"),
    "k dtype": (lambda q, k, v: ops.partial_attention(q, k.to(torch.int8), v), "k has dtype int8"),
    "k/v length": (lambda q, k, v: ops.partial_attention(q, k, v[:, :5]), "same number of tokens"),
    "k/v dtype": (lambda q, k, v: ops.partial_attention(q, k, v.half()), "same dtype"),
    "group": (lambda q, k, v: ops.partial_attention(q[:7], k, v), "multiple of num_kv_heads"),
    "head_dim": (lambda q, k, v: ops.partial_attention(q[:, :32], k, v), "head_dim_qk"),
    "scale": (lambda q, k, v: ops.partial_attention(q, k, v, scale=float("inf")), "scale must be finite"),
    "k strided last dim": (lambda q, k, v: ops.partial_attention(q[:, :32], k[..., ::2], v),
                           "k_cache: the last dimension must be contiguous"),
    "merge backend": (lambda q, k, v: ops.merge_partials(torch.zeros(1, 2, 3), torch.zeros(1, 2), backend="x"),
                      "backend must be one of"),
    "merge shapes": (lambda q, k, v: ops.merge_partials(torch.zeros(2, 3, 4), torch.zeros(2, 4)),
                     "plus a head_dim_v"),
    "merge dtype": (lambda q, k, v: ops.merge_partials(torch.zeros(2, 3, 4).half(), torch.zeros(2, 3)),
                    "outs has dtype float16"),
    "merge nan": (lambda q, k, v: ops.merge_partials(torch.zeros(2, 3, 4), torch.full((2, 3), float("nan"))),
                  "NaN or \\+inf"),
    "merge no parts": (lambda q, k, v: ops.merge_partials(torch.zeros(0, 3, 4), torch.zeros(0, 3)),
                       "num_parts >= 1"),
    "merge cpu strided": (lambda q, k, v: ops.merge_partials(torch.zeros(2, 4, 3).transpose(1, 2),
                                                             torch.zeros(2, 3), backend="cpu"), "contiguous"),
    "mixed devices": (lambda q, k, v: ops.partial_attention(q, k.to("meta"), v, backend="torch"),
                      "all tensors must be on one device"),
    "cpu backend off the CPU": (lambda q, k, v: ops.partial_attention(q.to("meta"), k.to("meta"), v.to("meta")),
                                "the cpu backend takes CPU tensors, got meta"),
    "triton backend off CUDA": (
        lambda q, k, v: ops.partial_attention(q.to("meta"), k.to("meta"), v.to("meta"), backend="triton"),
        "takes CUDA tensors, got meta"),
    "no sources": (lambda q, k, v: ops.multi_source_partial_attention(q[None], []), "at least one KVSource"),
}


@pytest.mark.parametrize("call,message", OPS_CASES.values(), ids=OPS_CASES.keys())
def test_ops_rejects(call, message):
    with pytest.raises(ValueError, match=message):
        call(*tensors())


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_paged_value_errors_from_both_backends(backend):
    q = torch.randn(1, 4, 8)
    cache = torch.randn(2, 2, 4, 8)
    with pytest.raises(ValueError, match="outside"):
        ops.paged_partial_attention(q, cache, cache, torch.tensor([[0, 5]], dtype=torch.int32),
                                    torch.tensor([6], dtype=torch.int32), backend=backend)
    with pytest.raises(ValueError, match="outside"):
        ops.paged_partial_attention(q, cache, cache, torch.tensor([[0, 1]], dtype=torch.int32),
                                    torch.tensor([9], dtype=torch.int32), backend=backend)
