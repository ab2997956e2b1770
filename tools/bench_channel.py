"""Round trips of one CPU partial through a real CPU worker's channel: the engine's per-layer hop on
Ray, with the C++ kernel in it (bench_orchestration's channel figure answers with zeros instead).

A CPUWorker actor serves a bf16 cpu_compute region (tiny-qwen3-moe's attention shape: 8 query heads,
2 KV heads of 32, blocks of 16 tokens); this process sends requests of 4 sequences x `blocks` blocks
for `seconds` each and reports the round trip's median, p10 and p90, the kernel's own median seconds
(as the worker's launcher timed them), and the median of the rest: the channel, the worker's Python
and the wake-ups. Compare commits by running it on each, in turns.

    python tools/bench_channel.py --blocks 1 16 --seconds 8 --out bench_results/channel.json
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import statistics
import time

import ray
import torch
from tqdm import tqdm

from writescope.actors.cpu_worker import BLOCKS, ChannelSpec, CPUWorker, PartialClient, create_segment
from writescope.actors.local_ray import ensure_ray
from writescope.kv_format import KVFormat
from writescope.kv_regions import HostRegion
from writescope.tools.results import write_json
from writescope.topology import emulated_topology

log = logging.getLogger("bench_channel")

NUM_SEQS, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 8, 2, 32, 16


def round_trips(client: PartialClient, blocks: int, seconds: float) -> dict:
    """Requests of NUM_SEQS x blocks blocks (each sequence its own blocks) for `seconds`, one at a time."""
    q = torch.randn(NUM_SEQS, NUM_Q_HEADS, HEAD_DIM).to(torch.bfloat16)
    table = torch.arange(NUM_SEQS * blocks, dtype=torch.int32).reshape(NUM_SEQS, blocks)
    lens = torch.full((NUM_SEQS,), BLOCK_SIZE * blocks, dtype=torch.int32)
    walls, kernels = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(walls) < 3:
        start = time.perf_counter()
        client.send(0, q, table, lens, HEAD_DIM ** -0.5, region=0, unit=BLOCKS)
        _, _, kernel_s = client.receive()
        walls.append(time.perf_counter() - start)
        kernels.append(kernel_s)
    walls.sort()
    rest = [wall - kernel for wall, kernel in zip(walls, kernels, strict=True)]
    return {"blocks": blocks, "tokens": NUM_SEQS * blocks * BLOCK_SIZE, "calls": len(walls),
            "wall_us": statistics.median(walls) * 1e6, "wall_p10_us": walls[len(walls) // 10] * 1e6,
            "wall_p90_us": walls[9 * len(walls) // 10] * 1e6, "kernel_us": statistics.median(kernels) * 1e6,
            "outside_kernel_us": statistics.median(rest) * 1e6}


def measure(block_counts: list[int], seconds: float) -> list[dict]:
    ensure_ray()
    fmt = KVFormat(num_layers=1, num_kv_heads=NUM_KV_HEADS, head_dim_k=HEAD_DIM, head_dim_v=HEAD_DIM,
                   dtype="bfloat16", block_size=BLOCK_SIZE)
    num_blocks = NUM_SEQS * max(block_counts)
    region = HostRegion.create("cpu_compute", fmt, num_blocks, segment_blocks=num_blocks, shard=0, pin=False,
                               label=f"bench_channel{os.getpid()}")
    spec = ChannelSpec(shm_name="named below", owner_pid=0, fd=-1,
                       socket_address=f"\0writescope-bench-channel-{secrets.token_hex(4)}", max_seqs=NUM_SEQS,
                       max_blocks=max(block_counts), num_q_heads=NUM_Q_HEADS, head_dim_qk=HEAD_DIM, head_dim_v=HEAD_DIM)
    segment = worker = client = None
    try:
        region.commit(0)
        for array in region.arrays:
            array.copy_(torch.randn(array.shape).to(array.dtype))
        spec, segment = create_segment(spec, f"bench_channel_{os.getpid()}")
        worker = CPUWorker.remote(emulated_topology(1)[0], [region.handle.to_bytes()], spec)
        ray.get(worker.check_health.remote())
        client = PartialClient(spec, reconnect_timeout_s=30)
        round_trips(client, block_counts[0], 0.5)  # warm-up: the connection, the pool, the pages
        return [round_trips(client, blocks, seconds) for blocks in tqdm(block_counts, desc="sizes", unit="size")]
    finally:
        if client is not None:
            client.close()
        if worker is not None:
            ray.kill(worker)
        if segment is not None:
            segment.close()
        region.close()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 16], help="blocks per sequence of a request")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds of round trips per size")
    parser.add_argument("--out", default="bench_results/channel.json", help="JSON output path")
    args = parser.parse_args(argv)
    if min(args.blocks) < 1 or args.seconds <= 0:
        parser.error(f"--blocks must be >= 1 and --seconds > 0, got {args.blocks} and {args.seconds}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = measure(args.blocks, args.seconds)
    write_json(args.out, {"rows": rows})
    print("| tokens | calls | round trip us (p10-p90) | kernel us | outside the kernel us |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['calls']} | {r['wall_us']:.0f} ({r['wall_p10_us']:.0f}-{r['wall_p90_us']:.0f}) "
              f"| {r['kernel_us']:.1f} | {r['outside_kernel_us']:.0f} |")
    return rows


if __name__ == "__main__":
    main()
