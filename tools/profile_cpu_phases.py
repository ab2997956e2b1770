"""Where the CPU attention kernel's thread time goes, phase by phase, from its own timers.

Each row runs one benchmark shape at one context length (the inputs and the block layout of
`bench_cpu_attention.py`), rotating over enough copies of the KV that every call reads memory not read
for --cold-mib MiB, with the kernel's phase timers on (`writescope._cpu.set_phase_timers`). Per phase
it reports how often it ran per call, its mean time, and its share of the phases' summed thread time:

    item_start   an item's queries and zeroed output, before its first tile
    first_tile   an item's first tile, whole: its own lines are asked for at its start, so it waits
    gather, scores, softmax, values
                 each middle tile's parts (row pointers and page touches; the score products; the
                 running max, exps and sums; the value products with the prefetcher's last lines)
    last_tile    an item's last tile, whole: nothing ahead to ask for
    item_end     normalising the item's output, its lse
    merge        merging a (sequence, kv head)'s chunk partials, by the thread that finished last

and how the first and last tiles compare with a middle tile, and how much of the threads' kernel
time the phases cover (the rest: the pool's wake-up, claiming items, a thread idle at a call's end).

    python tools/profile_cpu_phases.py --shapes deepseek-v2-lite-mla --seq-lens 32768

With the timers off (the default) a tile pays one predicted branch per phase; on, a time-stamp read.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import sys

import torch

from writescope import _cpu, ops
from writescope.calibration import cpu_model
from writescope.tools.bench_cpu_attention import SHAPES, cache_source, copies_for, make_inputs
from writescope.tools.results import check_positive, write_json

log = logging.getLogger("profile_cpu_phases")

PHASES = ("item_start", "first_tile", "gather", "scores", "softmax", "values", "last_tile", "item_end", "merge")
MIDDLE_PARTS = ("gather", "scores", "softmax", "values")
RUN_BLOCKS = 256  # the benchmark's block layout: runs of one allocator extent


def phase_rows(totals: dict, calls: int) -> list[dict]:
    """totals {phase: (count, seconds)} over `calls` calls -> a row per phase that ran."""
    summed_s = sum(seconds for _, seconds in totals.values())
    rows = []
    for phase in PHASES:
        count, seconds = totals.get(phase, (0, 0.0))
        if count == 0:
            continue
        rows.append({"phase": phase, "per_call": count / calls, "mean_us": seconds / count * 1e6,
                     "share": seconds / summed_s if summed_s > 0 else 0.0})
    return rows


def tile_figures(totals: dict) -> dict:
    """totals {phase: (count, seconds)} -> a middle tile's mean microseconds (its four parts, each run
    once a middle tile) and an item's first and last tiles against it; None where no item had a
    middle tile (or no last tile)."""
    count = totals.get("scores", (0, 0.0))[0]
    middle_us = sum(totals[part][1] for part in MIDDLE_PARTS) / count * 1e6 if count else None

    def against_middle(phase: str) -> float | None:
        tiles, seconds = totals.get(phase, (0, 0.0))
        return seconds / tiles * 1e6 / middle_us if tiles and middle_us else None

    return {"middle_tile_us": middle_us, "first_tile_in_middle_tiles": against_middle("first_tile"),
            "last_tile_in_middle_tiles": against_middle("last_tile")}


def profile(shape, seq_len: int, calls: int, cold_bytes: int, warmup: int) -> dict:
    """Times `calls` calls of the kernel with the phase timers on; returns the row's figures."""
    q, k, v = make_inputs(shape, seq_len)
    num_copies = copies_for(shape, seq_len, cold_bytes)
    generator = torch.Generator().manual_seed(0)
    sources = [cache_source(shape, k, v, generator, RUN_BLOCKS) for _ in range(num_copies)]
    arrays = [(ops._kv_numpy(s.k_cache), ops._kv_numpy(s.v_cache), ops._as_numpy(s.block_table),
               ops._as_numpy(s.seq_lens), s.layout) for s in sources]
    q_array = ops._as_numpy(q[None])
    out = torch.empty((1, shape.num_q_heads, shape.head_dim_v))
    lse = torch.empty((1, shape.num_q_heads))
    scale = shape.head_dim_qk ** -0.5
    turn = itertools.cycle(arrays)

    def call() -> float:
        k_cache, v_cache, block_table, seq_lens, layout = next(turn)
        return _cpu.paged_attention(q_array, k_cache, v_cache, block_table, seq_lens, out.numpy(), lse.numpy(),
                                    q_dtype="bfloat16", kv_dtype="bfloat16", layout=layout, scale=scale)

    for _ in range(warmup * num_copies):
        call()
    _cpu.set_phase_timers(True)
    try:
        kernel_s = [call() for _ in range(calls)]
        totals = _cpu.phase_timers()
    finally:
        _cpu.set_phase_timers(False)
    threads = _cpu.num_threads()
    summed_s = sum(seconds for _, seconds in totals.values())
    return {
        "shape": shape.name, "seq_len": seq_len, "calls": calls, "threads": threads, "copies": num_copies,
        "kernel_ms_median": statistics.median(kernel_s) * 1e3,
        "covered": summed_s / (sum(kernel_s) * threads),
        **tile_figures(totals),
        "phases": phase_rows(totals, calls),
    }


def format_figure(value: float | None) -> str:
    """Two decimals, or "-" for a figure that could not be taken."""
    return "-" if value is None else f"{value:.2f}"


def table(results: list[dict], cpu: str, variant: str) -> str:
    lines = [f"{cpu}, variant `{variant}`, {results[0]['threads']} threads; every call reads KV not read for "
             f"the copies before it"]
    for r in results:
        lines.append("")
        lines.append(f"**{r['shape']} at {r['seq_len'] // 1024}K**: {r['calls']} calls over {r['copies']} copies, "
                     f"kernel {r['kernel_ms_median']:.3f} ms a call (median); the phases cover "
                     f"{r['covered']:.2f} of the threads' kernel time; a middle tile "
                     f"{format_figure(r['middle_tile_us'])} us, the first "
                     f"{format_figure(r['first_tile_in_middle_tiles'])}x it, "
                     f"the last {format_figure(r['last_tile_in_middle_tiles'])}x")
        lines.append("")
        lines.append("| phase | per call | us each | share |")
        lines.append("|---|---|---|---|")
        for p in r["phases"]:
            lines.append(f"| {p['phase']} | {p['per_call']:.1f} | {p['mean_us']:.2f} | {p['share']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    names = [s.name for s in SHAPES]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=names, default=names)
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[32768],
                        help="tokens (multiples of the benchmark's 16-token blocks)")
    parser.add_argument("--calls", type=int, default=100, help="timed calls a row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes over the copies first")
    parser.add_argument("--cold-mib", type=int, default=1024, help="MiB read between two reads of the same KV")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (default: the pool's)")
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    args = parser.parse_args(argv)
    check_positive(parser, args, ["calls", "warmup", "cold_mib"])
    for seq_len in args.seq_lens:
        if seq_len < 16 or seq_len % 16:
            parser.error(f"--seq-lens must be positive multiples of 16, got {seq_len}")
    if args.threads is not None:
        check_positive(parser, args, ["threads"])
        _cpu.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    shapes = [s for s in SHAPES if s.name in args.shapes]
    results = []
    for shape in shapes:
        for seq_len in args.seq_lens:
            log.info("%s at %d tokens ...", shape.name, seq_len)
            results.append(profile(shape, seq_len, args.calls, args.cold_mib << 20, args.warmup))
    cpu, variant = cpu_model(), _cpu.__cpu_variant__
    log.info("%s", table(results, cpu, variant))
    if args.out:
        write_json(args.out, {"cpu_model": cpu, "variant": variant, "rows": results})
    return results


if __name__ == "__main__":
    main()
