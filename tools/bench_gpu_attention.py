"""Triton split-KV decode on a GPU against the device's copy bandwidth and torch SDPA, plus the
host-to-device bandwidth the ping-pong stream gets from pinned vs pageable memory.

For each context length and model shape (bf16 KV in shuffled 16-token blocks, one decode query):
median time of an eager call (CUDA events: launch overhead included) and of a CUDA-graph replay
(GPU time alone), the split size `split_tokens` chose and the eager call's speed-up over a fixed
256-token split (the size before it), achieved HBM GB/s = KV bytes / time, that as a fraction of the device-to-device
copy bandwidth measured in the same run (bytes read + written / time), and the ratio against torch
`scaled_dot_product_attention` (bf16, enable_gqa, contiguous KV) timed the same two ways. The
result is checked against SDPA before it is timed. The kernel is timed through
`writescope.triton_attention.paged_attention`, below the ops boundary's argument checks.

    python tools/bench_gpu_attention.py --out $OUT/gpu_attention.json
    TRITON_INTERPRET=1 python tools/bench_gpu_attention.py --smoke   # checks the script on a CPU
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from writescope.tools.bench_cpu_attention import SHAPES, flops, kv_bytes
from writescope.tools.results import write_json

log = logging.getLogger("bench_gpu_attention")


def median_ms(fn, device, warmup, repeats):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def graph_ms(fn, repeats):
    """Median time of one replay of fn captured in a CUDA graph: the GPU time without Python's
    launch overhead, which at 8K is most of an eager call. None (with a warning) if capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # capture needs the kernels compiled and the allocator warm
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as error:
        log.warning("CUDA graph capture failed: %s", error)
        return None
    return median_ms(graph.replay, "cuda", 3, repeats)


def copy_gbps(device, num_bytes, repeats):
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, 3, repeats)
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def host_to_device_gbps(pinned, num_bytes, repeats):
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    ms = median_ms(lambda: dev.copy_(host, non_blocking=pinned), "cuda", 2, repeats)
    return num_bytes / (ms * 1e-3) / 1e9


def paged_copy(k, v, v_in_k, block_size):
    """k [num_kv_heads, seq_len, head_dim_qk], v [..., head_dim_v] -> a KVSource of the same tokens in
    blocks of block_size placed in a shuffled order, as the engine's window and ping-pong hold them."""
    from writescope import ops

    num_kv_heads, seq_len, _ = k.shape
    num_blocks = -(-seq_len // block_size)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seq_len))

    def blocked(x):  # [heads, seq, dim] -> [num_blocks, heads, block_size, dim] at shuffled slots
        padded = torch.nn.functional.pad(x, (0, 0, 0, num_blocks * block_size - seq_len))
        tiles = padded.view(num_kv_heads, num_blocks, block_size, -1).transpose(0, 1)
        return torch.empty_like(tiles).index_copy_(0, order.to(x.device), tiles.contiguous())
    k_cache = blocked(k)
    v_cache = k_cache[..., : v.shape[-1]] if v_in_k else blocked(v)
    table = order.to(torch.int32)[None].to(k.device)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=k.device)
    return ops.KVSource(k_cache, v_cache, table, lens)


def bench_row(shape, seq_len, device, copy_bw, args):
    from writescope import triton_attention

    q = torch.randn(1, shape.num_q_heads, shape.head_dim_qk, device=device).bfloat16()
    k = torch.randn(shape.num_kv_heads, seq_len, shape.head_dim_qk, device=device).bfloat16()
    v = k[..., : shape.head_dim_v] if shape.v_in_k else torch.randn(
        shape.num_kv_heads, seq_len, shape.head_dim_v, device=device).bfloat16()
    source = paged_copy(k, v, shape.v_in_k, args.block_size)  # what the engine reads: shuffled blocks
    scale = shape.head_dim_qk**-0.5
    ours, _ = triton_attention.paged_attention(q, [source], scale)  # checked before it is timed
    expected = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k[None], v[None], scale=scale,
                                                                enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(ours, expected.float(), atol=2e-2, rtol=2e-2)
    ms = median_ms(lambda: triton_attention.paged_attention(q, [source], scale), device, args.warmup, args.repeats)
    # the split the work and the SMs chose, against the fixed 256-token split it replaced
    split = triton_attention.source_split_tokens(q, source)
    fixed_ms = median_ms(lambda: triton_attention.paged_attention(q, [source], scale, split=256), device,
                         args.warmup, args.repeats)
    row = {"shape": shape.name, "seq_len": seq_len, "kernel_ms": ms, "split_tokens": split,
           "fixed_256_ms": fixed_ms, "speedup_vs_fixed_256": fixed_ms / ms,
           "hbm_gbps": kv_bytes(shape, seq_len) / (ms * 1e-3) / 1e9,
           "tflops": flops(shape, seq_len) / (ms * 1e-3) / 1e12}
    row["fraction_of_copy_bw"] = row["hbm_gbps"] / copy_bw
    sdpa_ms = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k[None], v[None], scale=scale, enable_gqa=True), device, args.warmup, args.repeats)
    row["sdpa_ms"] = sdpa_ms
    row["speedup_vs_sdpa"] = sdpa_ms / ms
    if device == "cuda":
        ours_graph = graph_ms(lambda: triton_attention.paged_attention(q, [source], scale), args.repeats)
        sdpa_graph = graph_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], k[None], v[None], scale=scale, enable_gqa=True), args.repeats)
        if ours_graph and sdpa_graph:
            row.update(graph_ms=ours_graph, sdpa_graph_ms=sdpa_graph,
                       graph_fraction_of_copy_bw=kv_bytes(shape, seq_len) / (ours_graph * 1e-3) / 1e9 / copy_bw,
                       graph_speedup_vs_sdpa=sdpa_graph / ours_graph)
    return row


def markdown_table(result):
    lines = ["| shape | L | split | call ms | vs 256-token split | HBM GB/s | of copy BW | vs SDPA | graph-replay ms "
             "| of copy BW | vs SDPA |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        graph = (f"{r['graph_ms']:.3f} | {r['graph_fraction_of_copy_bw']:.2f} | {r['graph_speedup_vs_sdpa']:.2f}x"
                 if "graph_ms" in r else "- | - | -")
        lines.append(f"| {r['shape']} | {r['seq_len'] // 1024}K | {r['split_tokens']} | {r['kernel_ms']:.3f} "
                     f"| {r['speedup_vs_fixed_256']:.2f}x | {r['hbm_gbps']:.0f} "
                     f"| {r['fraction_of_copy_bw']:.2f} | {r['speedup_vs_sdpa']:.2f}x | {graph} |")
    machine = result["machine"]
    lines.append("")
    lines.append(f"Device copy {machine['copy_gbps']:.0f} GB/s (read + write); host-to-device "
                 f"{machine.get('h2d_pinned_gbps', float('nan')):.1f} GB/s pinned, "
                 f"{machine.get('h2d_pageable_gbps', float('nan')):.1f} GB/s pageable.")
    return "\n".join(lines)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072], help="context lengths")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the engine's default)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before timing")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls (median reported)")
    parser.add_argument("--smoke", action="store_true", help="tiny run on the CPU interpreter: checks the script")
    parser.add_argument("--out", default="bench_results/gpu_attention.json", help="JSON output path")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or use --smoke with TRITON_INTERPRET=1")
    if args.smoke:
        args.seq_lens, args.warmup, args.repeats = [64], 0, 1
    machine = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
               "copy_gbps": copy_gbps(device, (1 << 30) if device == "cuda" else (1 << 20), 1 if args.smoke else 20)}
    if device == "cuda":
        machine["h2d_pinned_gbps"] = host_to_device_gbps(True, 1 << 28, 10)
        machine["h2d_pageable_gbps"] = host_to_device_gbps(False, 1 << 28, 10)
    rows = []
    for shape in SHAPES:
        for seq_len in args.seq_lens:
            rows.append(bench_row(shape, seq_len, device, machine["copy_gbps"], args))
            log.info("%s L=%d: %.3f ms", shape.name, seq_len, rows[-1]["kernel_ms"])
    result = {"machine": machine, "rows": rows}
    write_json(args.out, result)
    print(markdown_table(result))


if __name__ == "__main__":
    main()
