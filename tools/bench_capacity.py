"""Capacity: a batch of long contexts decoding together through the Ray executor (or in one process),
with the host memory it takes against the raw bytes of the KV it holds.

    python tools/bench_capacity.py --batch 32 --context 32768     # 1M aggregate tokens
    python tools/bench_capacity.py --preset qwen3-30b-a3b-shape --batch 32 --context 32768 \
        --executor local --device cuda --device-kv-gb 2 --policy writescope   # on a GPU, the paper's cap

Reported: prefill tok/s (every prompt prefilled, chunked and interleaved as the engine does it: the
first sequences decode while the later ones are prefilled), decode tok/s of the whole batch over
--new-tokens steps once every sequence is resident, the KV placed (tokens and raw bytes), each host region's size and
the bytes of it actually in memory (its committed segments), the peak RSS of the GPU
worker (Ray) and of this process.
"""

from __future__ import annotations

import argparse
import logging
import resource
import time

import torch
from tqdm import tqdm

from writescope.config import EngineConfig
from writescope.engine import Engine, placement
from writescope.tools.bench_split import device_budget
from writescope.tools.results import check_positive, write_json

log = logging.getLogger("bench_capacity")


def make_engine(args, max_new_tokens: int):
    """The engine the batch runs on: Ray's actors, or one process (a device machine without Ray)."""
    window, pingpong_blocks = args.window_tokens, None
    if args.device_kv_gb is not None:  # the paper's cap: the batch's windows and a ping-pong pair within it
        window, pingpong_blocks = device_budget(args.preset, args.device_kv_gb, 16, args.batch)
    config = EngineConfig(model=args.preset, dtype="bfloat16", policy=args.policy, max_batch_size=args.batch,
                          max_seq_len=args.context + max_new_tokens, window_tokens=window, device=args.device,
                          prefill_chunk_tokens=args.prefill_chunk_tokens, pingpong_blocks=pingpong_blocks,
                          enable_prefix_caching=False)
    if args.executor == "local":
        return Engine.from_config(config)
    from writescope.actors.ray_engine import RayEngine

    return RayEngine.from_pretrained(config=config)  # connects to Ray, or starts the embedded one


def host_memory(engine) -> dict[str, dict[str, int]]:
    """Each host region's size and resident bytes: the cache's here, or the Ray region owner's."""
    return engine.cache.host_memory() if isinstance(engine, Engine) else engine.host_memory()


def run(args) -> dict:
    # The first sequences decode while the later ones are prefilled (a turn per chunk): each may
    # decode as many tokens as there are turns before the whole batch is resident, then new_tokens.
    prefill_turns = args.batch * -(-args.context // args.prefill_chunk_tokens)
    max_new_tokens = prefill_turns + args.new_tokens
    engine = make_engine(args, max_new_tokens)
    try:
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 250, (args.context,), generator=generator).tolist() for _ in range(args.batch)]
        started = time.perf_counter()
        first, tokens, placed = {}, 0, None
        bar = tqdm(total=args.batch, desc=f"prefill {args.batch} x {args.context}", unit="seq")
        for event in engine.generate_stream(prompts, max_new_tokens=max_new_tokens):
            tokens += 1
            if event.index not in first:
                first[event.index] = time.perf_counter()
                bar.update(1)
            if len(first) == args.batch and placed is None:  # every prompt prefilled: the whole batch resident
                bar.close()
                placed, memory, decode_started, decode_tokens = placement_of(engine), host_memory(engine), \
                    time.perf_counter(), tokens
            elif placed is not None and tokens - decode_tokens >= args.batch * args.new_tokens:
                break  # new_tokens decode steps of the whole batch (stopping cancels the rest)
        decode_s = time.perf_counter() - decode_started
        gpu_worker_hwm = engine_peak_rss(engine) if args.executor == "ray" else None
        # the device's peak (window, ping-pong, weights, activations) where it runs in this process
        device_peak = torch.cuda.max_memory_allocated() if args.executor == "local" and args.device != "cpu" \
            else None
    finally:
        engine.shutdown()
    prefill_s = max(first.values()) - started
    spilled = placed["placed_tokens"]["cpu_compute"] + placed["placed_tokens"]["cpu_transfer"]
    raw = spilled * kv_bytes_per_token(args.preset)
    resident = sum(r["resident_bytes"] for r in memory.values())
    return {
        "preset": args.preset, "batch": args.batch, "context": args.context, "policy": args.policy,
        "aggregate_tokens": args.batch * args.context, "prefill_s": prefill_s,
        "prefill_tok_s": args.batch * args.context / prefill_s,
        "decode_tok_s": (tokens - decode_tokens) / decode_s, "placed_tokens": placed["placed_tokens"],
        "raw_kv_bytes": raw, "host_regions": memory, "host_resident_bytes": resident,
        "host_size_bytes": sum(r["size_bytes"] for r in memory.values()),
        "resident_over_raw": resident / raw, "gpu_worker_peak_rss_bytes": gpu_worker_hwm,
        "driver_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "device_peak_bytes": device_peak,
    }


def placement_of(engine) -> dict:
    """Where the KV lies (placed_tokens by region), from the engine here or the GPU worker's."""
    return placement(engine) if isinstance(engine, Engine) else engine.state()


def kv_bytes_per_token(preset: str) -> int:
    """Raw bf16 KV bytes of one token in every layer: what the host regions must hold for it."""
    from writescope.loading import kv_format, load_model_config

    config, torch_dtype = load_model_config(preset, "bfloat16")
    return kv_format(config, torch_dtype, 16).token_bytes


def engine_peak_rss(engine) -> int | None:
    """VmHWM of the GPU worker's process (it maps cpu_transfer; its pages count where touched)."""
    import ray

    pid = ray.get(engine.gpu_worker.pid.remote())
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(row for row in f if row.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-qwen3-moe")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=32768, help="prompt tokens of each sequence")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--policy", default="all_cpu")
    parser.add_argument("--window-tokens", type=int, default=256)
    parser.add_argument("--executor", default="ray", choices=["ray", "local"])
    parser.add_argument("--device", default="cpu", help="the engine's device (cuda on a GPU)")
    parser.add_argument("--device-kv-gb", type=float, default=None,
                        help="cap the device's KV (the batch's windows + ping-pong), as the paper does")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=4096)
    parser.add_argument("--out", default="bench_results/capacity.json")
    args = parser.parse_args(argv)
    check_positive(parser, args, ("batch", "context", "new_tokens"))
    if args.device_kv_gb is not None and not args.device_kv_gb > 0:
        parser.error(f"--device-kv-gb must be > 0 (the device's KV budget in GiB), got {args.device_kv_gb}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = run(args)
    write_json(args.out, result)
    gib = 2**30
    print(f"{result['batch']} x {result['context']} = {result['aggregate_tokens']} tokens, {result['policy']}: "
          f"prefill {result['prefill_tok_s']:.0f} tok/s ({result['prefill_s']:.0f} s), "
          f"decode {result['decode_tok_s']:.1f} tok/s; raw KV {result['raw_kv_bytes'] / gib:.2f} GiB, host regions "
          f"{result['host_size_bytes'] / gib:.2f} GiB of which {result['host_resident_bytes'] / gib:.2f} GiB resident "
          f"({result['resident_over_raw']:.2f}x the raw KV)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
