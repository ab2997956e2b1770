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
    gather       host seconds a step spends gathering the device's share of CSA selections into
                 one span (beside a GPU, or with --device-gathers; the CPU attends its share in
                 place, and so does the device side on a CPU host), against the step's seconds
    tok/s        1 / the median step, the first --warmup steps of each variant left out
The placement is the policy's (`fixed_half` by default, so that both sides hold entries).

    python tools/bench_sparse.py --contexts 32768 131072 --out bench_results/sparse.json

With --compare-executors it instead decodes one sequence with the local and with the Ray executor
(the CPU's share of each CSA selection sent to the CPU workers as token tables) and reports their
tok/s side by side: what the actors and channels cost the sparse step.
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
from writescope.models.presets import SPARSE_PRESETS
from writescope.policies import POLICY_NAMES
from writescope.sampling import SamplingParams
from writescope.tools.results import check_positive, host_info, write_json

log = logging.getLogger("bench_sparse")


def measure(context: int, args) -> dict:
    """One sequence of `context` prompt tokens: prefilled (or its KV drawn), then the sparse steps,
    then the dense ones, each step the engine's own."""
    per_variant = args.steps + args.warmup
    engine = Engine.from_pretrained(args.preset, policy=args.policy, dtype=args.dtype, max_batch_size=1,
                                    device=args.device, max_seq_len=context + 2 * per_variant + 8,
                                    window_tokens=args.window_tokens, block_size=args.block_size)
    engine.store.device_in_place = not args.device_gathers
    try:
        began = time.perf_counter()
        request = (synthetic_sequence if args.synthetic else prefilled_sequence)(engine, context, 2 * per_variant + 1)
        prefill_s = None if args.synthetic else time.perf_counter() - began
        log.info("%d tokens %s in %.1f s", context, "drawn" if args.synthetic else "prefilled",
                 time.perf_counter() - began)
        records = {}
        for variant in ("sparse", "dense"):
            engine.forward.select_entries = variant == "sparse"
            records[variant] = []
            for _ in tqdm(range(per_variant), desc=f"{context} tokens, {variant}", unit="step"):
                before = _counters(engine)
                start = time.perf_counter()
                sampled = engine._decode_step([request])
                records[variant].append((time.perf_counter() - start, _delta(before, _counters(engine))))
                engine._accept(request, sampled.tokens[0])
        return {"context": context, "prefill_s": prefill_s,
                "prefill_tok_s": None if prefill_s is None else context / prefill_s,
                **{variant: summarize(engine, rows[args.warmup:]) for variant, rows in records.items()}}
    finally:
        engine.shutdown()


def prefilled_sequence(engine, context: int, new_tokens: int):
    """A random prompt admitted and prefilled through the model, chunk by chunk, its first token sampled."""
    prompt = torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    request = engine.make_request(0, prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    engine.cache.admit(request.seq_id, context, new_tokens)
    event = None
    with tqdm(total=context, desc=f"prefill {context} tokens", unit="tok") as bar:
        while event is None:
            before = request.prefilled
            event = engine._prefill_step(request)
            bar.update(request.prefilled - before)
    if event.finish_reason == "error":
        raise RuntimeError(f"the prefill of {context} tokens failed: {event.error}")
    return request


def synthetic_sequence(engine, context: int, new_tokens: int):
    """A sequence of `context` tokens whose KV is drawn at random instead of prefilled: each compressed
    layer's entries (unit RMS, as the compressor's norm leaves them) written to its cache as a prompt's
    are, the CSA indexer keys, the sliding windows. For an attention shape this host cannot prefill
    at length (the release's); the decode steps that follow are the engine's own."""
    request = engine.make_request(0, [0] * context, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    engine.cache.admit(request.seq_id, context, new_tokens)
    slot, cfg = engine.cache.seqs[request.seq_id].slot, engine.config
    generator = torch.Generator().manual_seed(context)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(engine.model.dtype).to(engine.model.device)

    engine.states.reset(slot)
    engine.states.ring[:, slot] = draw(cfg.num_layers, cfg.sliding_window, cfg.head_dim)
    engine.store.prefill_seq = request.seq_id
    for layer in range(cfg.num_layers):
        count = context // cfg.rate(layer) if cfg.rate(layer) else 0
        if count:
            engine.store.write_many(layer, slot, draw(count, cfg.head_dim), 0)
        if layer in engine.states.index_keys:
            engine.states.index_keys[layer][slot, :count] = draw(count, cfg.index_head_dim)
    request.prefilled = context
    engine.cache.seqs[request.seq_id].num_tokens = context
    engine._accept(request, 0)
    return request


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


def executor_rows(context: int, args) -> list[dict]:
    """One sequence of `context` random prompt tokens through the engine's public API on each executor
    (local: in this process; ray: the engine's actors, the CPU partials on the CPU workers over their
    channels): prefill seconds, and decode tok/s from the median gap between streamed tokens."""
    prompt = torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    new_tokens = args.steps + args.warmup + 1
    rows = []
    for executor in ("local", "ray"):
        engine = Engine.from_pretrained(args.preset, executor=executor, policy=args.policy, dtype=args.dtype,
                                        max_batch_size=1, device=args.device, max_seq_len=context + new_tokens + 8,
                                        window_tokens=args.window_tokens, block_size=args.block_size)
        try:
            began, ends = time.perf_counter(), []
            for _ in tqdm(engine.generate_stream([prompt], max_new_tokens=new_tokens), total=new_tokens,
                          desc=f"{context} tokens, {executor}", unit="tok"):
                ends.append(time.perf_counter())
            attended = (engine.state() if executor == "ray" else engine.cache_state())["entries_attended"]
        finally:
            engine.shutdown()
        gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)][args.warmup:]
        steps = len(ends) - 1
        rows.append({"context": context, "executor": executor, "prefill_s": ends[0] - began,
                     "step_s": statistics.median(gaps), "tok_s": 1.0 / statistics.median(gaps),
                     "csa_entries_cpu": attended[CSA]["cpu"] / steps,
                     "csa_entries_device": attended[CSA]["device"] / steps})
    return rows


def executor_table(rows: list[dict], host: dict, args) -> str:
    lines = [f"{args.preset}, {args.dtype}, policy {args.policy}, batch 1, device {args.device}; {host['cpu_model']} "
             f"({host['cpus']} CPUs, kernel variant `{host['cpu_variant']}`); medians of {args.steps} decode steps "
             f"after {args.warmup} warm-up, the sequence prefilled through the engine.",
             "",
             "| context | executor | prefill tok/s | CSA entries CPU / device a step | step ms | decode tok/s "
             "| vs local |",
             "|---|---|---|---|---|---|---|"]
    local = {r["context"]: r["tok_s"] for r in rows if r["executor"] == "local"}
    for r in rows:
        lines.append(f"| {r['context']} | {r['executor']} | {r['context'] / r['prefill_s']:.0f} | "
                     f"{r['csa_entries_cpu']:.0f} / {r['csa_entries_device']:.0f} | {r['step_s'] * 1e3:.1f} | "
                     f"{r['tok_s']:.1f} | {r['tok_s'] / local[r['context']]:.2f}x |")
    return "\n".join(lines)


def table(results: list[dict], host: dict, args) -> str:
    drawn = (" (KV drawn, not prefilled)" if args.synthetic else "") + (
        "; the device side gathers its share" if args.device_gathers else "")
    lines = [f"{args.preset}{drawn}, {args.dtype}, policy {args.policy}, batch 1, device {args.device}"
             f"{' (' + host['gpu'] + ')' if host['gpu'] else ''}; {host['cpu_model']} ({host['cpus']} CPUs, "
             f"kernel variant `{host['cpu_variant']}`); medians of {args.steps} steps after {args.warmup} warm-up.",
             "",
             "| context | variant | KV read / step | moved / step | CSA entries CPU / device | gather ms / step "
             "| step ms | decode tok/s | prefill tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        prefill = "-" if r["prefill_tok_s"] is None else f"{r['prefill_tok_s']:.0f}"
        for variant in ("sparse", "dense"):
            v = r[variant]
            lines.append(f"| {r['context']} | {variant} | {v['kv_read_bytes'] / 2**20:.2f} MiB | "
                         f"{v['moved_bytes'] / 2**20:.2f} MiB | {v['csa_entries_cpu']:.0f} / "
                         f"{v['csa_entries_device']:.0f} | {v['gather_s'] * 1e3:.2f} | {v['step_s'] * 1e3:.1f} | "
                         f"{v['tok_s']:.1f} | {prefill} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-deepseek-v4", choices=list(SPARSE_PRESETS), help="model preset")
    parser.add_argument("--synthetic", action="store_true",
                        help="draw the sequence's KV at random instead of prefilling it (for a shape this host "
                             "cannot prefill at length)")
    parser.add_argument("--device-gathers", action="store_true",
                        help="the device side gathers its share of a selection into one span and copies it (as "
                             "beside a GPU) even where it could attend it in place (a CPU host)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072], help="prompt tokens")
    parser.add_argument("--steps", type=int, default=16, help="measured decode steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="decode steps per variant left out")
    parser.add_argument("--policy", default="fixed_half", choices=POLICY_NAMES, help="placement of the entries")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and KV")
    parser.add_argument("--window-tokens", type=int, default=256, help="entries kept in each cache's window")
    parser.add_argument("--block-size", type=int, default=16, help="entries per block")
    parser.add_argument("--device", default="cpu", help="the engine's device (cuda: the GPU's side of the split)")
    parser.add_argument("--compare-executors", action="store_true",
                        help="instead: the same sequence decoded by the local and the Ray executor (sparse), "
                             "through the engine's public API")
    parser.add_argument("--out", default="bench_results/sparse.json", help="JSON results")
    args = parser.parse_args(argv)
    check_positive(parser, args, ["steps", "window_tokens", "block_size"])
    if args.warmup < 0 or any(c < 1 for c in args.contexts):
        parser.error("--warmup must be >= 0 and every context >= 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    host = host_info()
    if args.compare_executors:
        if args.synthetic or args.device_gathers:
            parser.error("--compare-executors prefills through the engine's API: without --synthetic and "
                         "--device-gathers")
        from writescope.actors.local_ray import ensure_ray

        ensure_ray()
        results = [row for context in args.contexts for row in executor_rows(context, args)]
        text = executor_table(results, host, args)
    else:
        results = [measure(context, args) for context in args.contexts]
        text = table(results, host, args)
    write_json(args.out, {"host": host, "args": vars(args), "results": results, "table": text})
    print(text)  # noqa: T201 - the tool's output


if __name__ == "__main__":
    main()
