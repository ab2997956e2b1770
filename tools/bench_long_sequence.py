"""One long sequence, prefilled in chunks and decoded with exact attention, in one process (the
local executor): what the engine holds of it on the device and on the host.

    python tools/bench_long_sequence.py --context 262144 --new-tokens 16            # CPU
    python tools/bench_long_sequence.py --context 1048576 --device cuda --device-kv-gb 2

Reported: prefill s and tok/s, decode tok/s, the KV placed per region, the host regions' resident
bytes against the raw KV, peak RSS, and on CUDA the peak device memory (torch's allocator).
--device-kv-gb caps the device's KV (window + ping-pong) as the paper does.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import resource
import time

import torch
from tqdm import tqdm

from writescope.config import EngineConfig
from writescope.engine import Engine, placement
from writescope.tools.results import check_positive, write_json

log = logging.getLogger("bench_long_sequence")


def run(args) -> dict:
    pingpong_blocks = None
    if args.device_kv_gb is not None:  # a ping-pong buffer pair of what the budget leaves after the window
        from writescope.tools.bench_split import device_budget

        window, pingpong_blocks = device_budget(args.preset, args.device_kv_gb, 16, 1)
        args.window_tokens = window
    config = EngineConfig(model=args.preset, dtype="bfloat16", policy=args.policy, max_batch_size=1,
                          max_seq_len=args.context + args.new_tokens, window_tokens=args.window_tokens,
                          device=args.device, prefill_chunk_tokens=args.prefill_chunk_tokens,
                          pingpong_blocks=pingpong_blocks, enable_prefix_caching=False)
    engine = Engine.from_config(config)
    try:
        prompt = torch.randint(1, 250, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
        started = time.perf_counter()
        events = engine.generate_stream([prompt], max_new_tokens=args.new_tokens)
        with _prefill_progress(engine, args.context):
            next(events)  # the first token: the prompt is prefilled
        prefill_s = time.perf_counter() - started
        where, resident = placement(engine), engine.cache.host_resident_bytes()
        decode_started = time.perf_counter()
        decoded = sum(1 for _ in events)
        decode_s = time.perf_counter() - decode_started
        fmt = engine.cache.config.format
        raw = where["spilled_tokens"] * fmt.token_bytes
        device_peak = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else None
        device_kv = engine.cache.device_bytes()
    finally:
        engine.shutdown()
    return {"preset": args.preset, "context": args.context, "device": args.device, "policy": args.policy,
            "prefill_chunk_tokens": args.prefill_chunk_tokens, "prefill_s": prefill_s,
            "prefill_tok_s": args.context / prefill_s, "decode_tok_s": decoded / decode_s,
            "placed_tokens": where["placed_tokens"], "raw_kv_bytes": raw, "host_resident_bytes": resident,
            "resident_over_raw": resident / raw if raw else None, "device_kv_bytes": device_kv,
            "device_peak_bytes": device_peak,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


@contextlib.contextmanager
def _prefill_progress(engine, tokens: int):
    """A progress bar over the prompt tokens prefilled, chunk by chunk (a 256K prefill takes minutes)."""
    prefill_chunk = engine._prefill_chunk
    bar = tqdm(total=tokens, desc="prefill", unit="tok")

    def counted(request):
        before = request.prefilled
        result = prefill_chunk(request)
        bar.update(request.prefilled - before)
        return result

    engine._prefill_chunk = counted
    try:
        yield
    finally:
        engine._prefill_chunk = prefill_chunk
        bar.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-qwen3-moe")
    parser.add_argument("--context", type=int, default=262144, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--policy", default="all_cpu")
    parser.add_argument("--window-tokens", type=int, default=256)
    parser.add_argument("--device-kv-gb", type=float, default=None, help="cap the device's KV (window + ping-pong)")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=4096)
    parser.add_argument("--out", default="bench_results/long_sequence.json")
    args = parser.parse_args(argv)
    check_positive(parser, args, ("context", "new_tokens"))
    if args.device_kv_gb is not None and not args.device_kv_gb > 0:
        parser.error(f"--device-kv-gb must be > 0 (the device's KV budget in GiB), got {args.device_kv_gb}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = run(args)
    write_json(args.out, result)
    gib = 2**30
    print(f"{result['context']} tokens on {result['device']} ({result['policy']}): prefill {result['prefill_s']:.1f} s "
          f"({result['prefill_tok_s']:.0f} tok/s), decode {result['decode_tok_s']:.1f} tok/s; raw KV "
          f"{result['raw_kv_bytes'] / gib:.3f} GiB, host resident {result['host_resident_bytes'] / gib:.3f} GiB, "
          f"device KV {result['device_kv_bytes'] / gib:.3f} GiB, peak RSS {result['peak_rss_bytes'] / gib:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
