"""The end-to-end demo (`make run`): a tiny MoE preset decodes a long context under every policy,
through the Ray executor on an embedded local Ray (nothing to set up; `--executor local` for one
process).

For each policy: prefill of the batch straight into InplaceKVCache, then decoding with a progress
bar; reports prefill time, decode tok/s, where the KV was placed, and r* as the context grows.
On a CPU-only host the "device" is the CPU too: its partial runs on the C++ kernel and a transfer
is a host memcpy, so the measured r* says little about a GPU machine (see the policy simulator).

    python tools/demo.py --preset tiny-qwen3-moe --batch 4 --context 16384 --new-tokens 32
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from tqdm import tqdm

from writescope.config import EngineConfig
from writescope.engine import Engine, placement
from writescope.models.presets import PRESETS
from writescope.policies import POLICY_NAMES, policy_argument
from writescope.tools.results import write_json

log = logging.getLogger("demo")


def run_policy(args, policy: str, prompts) -> dict:
    # Prompts are prefilled a chunk per turn of the engine's loop, between decode steps, so the first
    # sequences decode while the later ones are prefilled: each may need a token per prefill turn
    # before the whole batch is resident, then new_tokens decode steps of the whole batch are timed.
    chunk = EngineConfig.prefill_chunk_tokens
    max_new_tokens = args.batch * -(-args.context // chunk) + args.new_tokens
    engine = Engine.from_pretrained(args.preset, policy=policy, dtype=args.dtype, max_batch_size=args.batch,
                                    max_seq_len=args.context + max_new_tokens, window_tokens=args.window,
                                    emulated_nodes=args.emulated_nodes, executor=args.executor,
                                    enable_prefix_caching=False)
    try:
        started = time.perf_counter()
        shares, placed, prefilled, tokens = [], {}, set(), 0
        prefill_s = decode_started = None
        bar = tqdm(total=args.batch * args.new_tokens, desc=f"{policy:>12}", unit="tok", leave=True)
        for event in engine.generate_stream(prompts, max_new_tokens=max_new_tokens):
            prefilled.add(event.index)
            if prefill_s is None:
                if len(prefilled) < args.batch:
                    continue
                prefill_s = time.perf_counter() - started  # every sequence has its first token
                decode_started = time.perf_counter()
                continue
            tokens += 1
            bar.update(1)
            if tokens % (args.batch * 8) == 0:  # every 8 decode steps of the whole batch
                state = engine.state() if args.executor == "ray" else placement(engine)
                shares.append((state["spilled_tokens"], round(state["cpu_share_spilled"], 3)))
                placed = state["placed_tokens"]
            if tokens >= args.batch * args.new_tokens:
                break  # the timed steps are done (stopping cancels the rest)
        decode_s = time.perf_counter() - decode_started
        bar.close()
        return {"policy": policy, "prefill_s": prefill_s, "decode_tok_s": tokens / decode_s,
                "r_star_by_spilled_tokens": shares, "placed_tokens": placed}
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-qwen3-moe", choices=list(PRESETS), help="model preset")
    parser.add_argument("--batch", type=int, default=4, help="sequences decoded together")
    parser.add_argument("--context", type=int, default=16384, help="prompt tokens per sequence")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per sequence")
    parser.add_argument("--window", type=int, default=256, help="GPU window tokens per sequence")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and KV dtype")
    parser.add_argument("--policies", nargs="+", default=list(POLICY_NAMES), type=policy_argument,
                        help="policies to run, in order")
    parser.add_argument("--executor", default="ray", choices=["ray", "local"],
                        help="ray: the engine's actors on an embedded local Ray (started here); local: one process")
    parser.add_argument("--emulated-nodes", type=int, default=None,
                        help="ray: split this machine's CPUs into N emulated NUMA nodes, one CPU worker each")
    parser.add_argument("--out", default="bench_results/demo.json", help="JSON output path")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.executor == "ray":
        from writescope.actors.local_ray import ensure_ray

        ensure_ray()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (args.context,), generator=generator).tolist() for _ in range(args.batch)]
    results = [run_policy(args, policy, prompts) for policy in args.policies]
    write_json(args.out, {"args": vars(args), "results": results})
    print(f"\n{args.preset}, batch {args.batch} x {args.context} tokens of context, {args.new_tokens} new tokens, "
          f"{args.dtype}, executor {args.executor}")
    print("| policy | prefill s | decode tok/s | placed: cpu_compute / cpu_transfer / window "
          "| r* every 8 steps (online correction) |")
    print("|---|---|---|---|---|")
    for r in results:
        p = r["placed_tokens"]
        shares = ", ".join(f"{s} at {n / 1024:.1f}K" for n, s in r["r_star_by_spilled_tokens"][:4])
        print(f"| {r['policy']} | {r['prefill_s']:.1f} | {r['decode_tok_s']:.1f} | "
              f"{p.get('cpu_compute', 0)} / {p.get('cpu_transfer', 0)} / {p.get('gpu_window', 0)} | {shares} |")


if __name__ == "__main__":
    main()
