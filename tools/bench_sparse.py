"""DeepSeek-V4's sparse step on InplaceKVCache against the same model with the selection disabled.

For each context length: one sequence of tiny-deepseek-v4 (the release's compression rates 4 and
128, sliding window 128, top-512 selection) is prefilled, then decoded `--steps` steps with the CSA
indexer's top-k selection (sparse), then `--steps` more attending every CSA entry (dense: the
selection disabled, everything else the same, on the same sequence). Per step and variant:
    KV read      bytes of KV the attention reads: each layer's sliding window, every HCA entry,
                 the CSA entries attended (the selection, or all of them)
    moved        of those, the bytes the device side read from cpu_transfer (beside a GPU they
                 cross PCIe: the ping-pong copy for HCA, the gathered span for CSA)
    entries      CSA entries attended per step on the CPU and on the device side
    gather       host seconds a step spends gathering CSA selections (the device's span from
                 cpu_transfer and the CPU's rows from cpu_compute), against the step's seconds
    tok/s        1 / the median step, the first --warmup steps of each variant left out
The placement is the policy's (`fixed_half` by default, so that both sides hold entries).

    python tools/bench_sparse.py --contexts 32768 131072 --out bench_results/sparse.json
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
from tqdm import tqdm

from writescope.engine import Engine
from writescope.models.deepseek_v4 import CSA, HCA
from writescope.policies import POLICY_NAMES
from writescope.tools.results import check_positive, host_info, write_json

log = logging.getLogger("bench_sparse")
PRESET = "tiny-deepseek-v4"


def measure(context: int, args) -> dict:
    """One sequence of `context` prompt tokens: prefill, then the sparse steps, then the dense ones."""
    engine = Engine.from_pretrained(PRESET, policy=args.policy, dtype=args.dtype, max_batch_size=1, device=args.device,
                                    max_seq_len=context + 2 * (args.steps + args.warmup) + 8,
                                    window_tokens=args.window_tokens, block_size=args.block_size)
    try:
        prompt = torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(context)).tolist()
        per_variant = args.steps + args.warmup
        records = {"sparse": [], "dense": []}
        began = time.perf_counter()
        stream = engine.generate_stream([prompt], max_new_tokens=2 * per_variant + 1)
        next(stream)  # the first token: the prefill's
        prefill_s = time.perf_counter() - began
        log.info("%d tokens prefilled in %.1f s", context, prefill_s)
        for variant in ("sparse", "dense"):
            engine.forward.select_entries = variant == "sparse"
            for _ in tqdm(range(per_variant), desc=f"{context} tokens, {variant}", unit="step"):
                before = _counters(engine)
                start = time.perf_counter()
                next(stream)
                records[variant].append((time.perf_counter() - start, _delta(before, _counters(engine))))
        stream.close()
        return {"context": context, "prefill_s": prefill_s, "prefill_tok_s": context / prefill_s,
                **{variant: summarize(engine, rows[args.warmup:]) for variant, rows in records.items()}}
    finally:
        engine.shutdown()


def _counters(engine) -> dict:
    counts = {f"{kind}_{side}": n for kind, sides in engine.store.attended.items() for side, n in sides.items()}
    return {**counts, "gather_s": engine.store.gather_s}


def _delta(before: dict, after: dict) -> dict:
    return {name: after[name] - before.get(name, 0) for name in after}


def summarize(engine, rows) -> dict:
    """Medians over the measured steps of one variant."""
    cfg = engine.config
    entry_bytes = cfg.head_dim * torch.empty((), dtype=engine.model.dtype).element_size()
    window_bytes = cfg.num_layers * cfg.sliding_window * entry_bytes  # every layer's sliding window

    def median(name):
        return statistics.median(counts.get(name, 0) for _, counts in rows)

    read = {kind: median(f"{kind}_cpu") + median(f"{kind}_device") for kind in (CSA, HCA)}
    step_s = statistics.median(s for s, _ in rows)
    return {"step_s": step_s, "tok_s": 1.0 / step_s, "kv_read_bytes": window_bytes + entry_bytes * sum(read.values()),
            "moved_bytes": entry_bytes * (median(f"{CSA}_transfer") + median(f"{HCA}_transfer")),
            "csa_entries_cpu": median(f"{CSA}_cpu"), "csa_entries_device": median(f"{CSA}_device"),
            "hca_entries": read[HCA], "gather_s": median("gather_s")}


def table(results: list[dict], host: dict, args) -> str:
    lines = [f"{PRESET}, {args.dtype}, policy {args.policy}, batch 1, device {args.device}"
             f"{' (' + host['gpu'] + ')' if host['gpu'] else ''}; {host['cpu_model']} ({host['cpus']} CPUs, "
             f"kernel variant `{host['cpu_variant']}`); medians of {args.steps} steps after {args.warmup} warm-up.",
             "",
             "| context | variant | KV read / step | moved / step | CSA entries CPU / device | gather ms / step "
             "| step ms | decode tok/s | prefill tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for variant in ("sparse", "dense"):
            v = r[variant]
            lines.append(f"| {r['context']} | {variant} | {v['kv_read_bytes'] / 2**20:.2f} MiB | "
                         f"{v['moved_bytes'] / 2**20:.2f} MiB | {v['csa_entries_cpu']:.0f} / "
                         f"{v['csa_entries_device']:.0f} | {v['gather_s'] * 1e3:.2f} | {v['step_s'] * 1e3:.1f} | "
                         f"{v['tok_s']:.1f} | {r['prefill_tok_s']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072], help="prompt tokens")
    parser.add_argument("--steps", type=int, default=16, help="measured decode steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="decode steps per variant left out")
    parser.add_argument("--policy", default="fixed_half", choices=POLICY_NAMES, help="placement of the entries")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and KV")
    parser.add_argument("--window-tokens", type=int, default=256, help="entries kept in each cache's window")
    parser.add_argument("--block-size", type=int, default=16, help="entries per block")
    parser.add_argument("--device", default="cpu", help="the engine's device (cuda: the GPU's side of the split)")
    parser.add_argument("--out", default="bench_results/sparse.json", help="JSON results")
    args = parser.parse_args(argv)
    check_positive(parser, args, ["steps", "window_tokens", "block_size"])
    if args.warmup < 0 or any(c < 1 for c in args.contexts):
        parser.error("--warmup must be >= 0 and every context >= 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    host = host_info()
    results = [measure(context, args) for context in args.contexts]
    text = table(results, host, args)
    write_json(args.out, {"host": host, "args": vars(args), "results": results, "table": text})
    print(text)  # noqa: T201 - the tool's output


if __name__ == "__main__":
    main()
