"""What one core reads from DRAM while it runs MLA's tile loop, however it asks for the next tile's
lines, against a plain read of the same memory.

The loop of the CPU kernel's MLA path on the AMX tiles (16 heads on one 576-dim latent, 64-token
tiles: the scores' 72 tile products, then PV's 128) is compiled on its own from
`tools/tile_stream_amx.cpp` (g++ -O2 -mamx-tile -mamx-bf16 -mavx512f) and run over a latent region
larger than the last-level cache, one process a CPU at once (each pinned to its own), with each way
of asking for the next tile's lines (--prefetch: `rows`, the kernel's; `loads`, the same lines read
by loads whose values go unused; `lines`, `every2`, `every4`, `heads2`, `none`; each spread over a
tile's steps as the kernel steps its prefetcher), with and without PV (--pv), and beside them a
plain read of the same region. The configurations take turns round by round, each reported as the
median over the rounds of its processes' summed GB/s, and of that sum over the plain read's in the
same round. One tile's scores and values are checked against a numpy reference of the same inputs
before any rate is reported.

What it says: how much of a plain read the loop's own shape can reach, so that the kernel's MLA
row (`bench_cpu_attention.py`) can be split into the loop's share and that of the work around it
(the softmax, item starts, merges). On the 2-vCPU Xeon of session 62 the loop asking the kernel's
way read 0.80 of the plain read (the scores alone 0.94, the other ways 0.63-0.73) where the kernel
read about 0.7 (docs/cpu_kernel_history.md). In session 63 the same lines asked for by loads read 0.64
where `rows` read 0.76: a load is no better a way to start the L2's streamer.

    python tools/bench_tile_stream.py --out bench_results/tile_stream.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys

import numpy as np

from writescope import calibration
from writescope.tools import native_probe
from writescope.tools.results import check_positive, write_json

log = logging.getLogger("bench_tile_stream")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tile_stream_amx.cpp")
COMPILE_FLAGS = ("-O2", "-mamx-tile", "-mamx-bf16", "-mavx512f", "-std=c++17")
PREFETCHES = ("rows", "loads", "lines", "every2", "every4", "heads2", "none")
HEADS, LATENT, VALUE_DIMS, TILE_TOKENS = 16, 576, 512, 64
TILE_BYTES = TILE_TOKENS * LATENT * 2


def check_host() -> None:
    """ValueError unless this is an x86-64 CPU with AMX (tiles and bf16) and AVX-512."""
    native_probe.check_x86_flags(("amx_tile", "amx_bf16", "avx512f"), "the loop needs AMX tiles, AMX bf16 and AVX-512")


def build(compiler: str | None = None) -> str:
    """The probe's executable, compiled once per source and compiler into the cache directory."""
    return native_probe.build(SOURCE, COMPILE_FLAGS, "tile_stream", compiler)


def configurations(prefetches: list[str], pvs: list[str]) -> list[dict]:
    """The plain read first, then every (prefetch, pv) pair of the loop."""
    configs = [{"name": "plain read", "mode": "read", "prefetch": "none", "pv": True}]
    for prefetch in prefetches:
        for pv in pvs:
            name = f"loop, {prefetch}" + ("" if pv == "on" else ", scores only")
            configs.append({"name": name, "mode": "loop", "prefetch": prefetch, "pv": pv == "on"})
    return configs


def run_processes(executable: str, config: dict, cpus: list[int], region_mib: int) -> list[dict]:
    """One process a CPU of `cpus`, all at once, each over its own region; their JSON results."""
    argv = [executable, config["mode"], config["prefetch"], "1" if config["pv"] else "0", str(region_mib)]
    children = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 preexec_fn=(lambda cpu=cpu: os.sched_setaffinity(0, {cpu}))) for cpu in cpus]
    outputs = [child.communicate() for child in children]  # every child waited for, a failed one or not
    for child, (_, err) in zip(children, outputs, strict=True):
        if child.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {child.returncode}: {err.strip()}")
    return [json.loads(out) for out, _ in outputs]


def mix(i: np.ndarray) -> np.ndarray:
    return (i.astype(np.uint64) * np.uint64(2654435761)) & np.uint64(0xFFFFFFFF)


def reference(tile_tokens: int = TILE_TOKENS) -> tuple[np.ndarray, np.ndarray]:
    """Tile 0's scores [tokens, heads] and values [heads, 512 dims in split-pair order] from the
    probe's inputs (tile_stream_amx.cpp: K and V k / 16, q k / 8, P k / 8, from the same hash)."""
    latent = (((mix(np.arange(tile_tokens * LATENT)) >> np.uint64(16)) % np.uint64(17)).astype(np.float64) - 8) / 16
    latent = latent.reshape(tile_tokens, LATENT)
    q = (((mix(np.arange(HEADS * LATENT) + 7) >> np.uint64(16)) % np.uint64(9)).astype(np.float64) - 4) / 8
    q = q.reshape(HEADS, LATENT)
    p = (((mix(np.arange(HEADS * tile_tokens) + 13) >> np.uint64(16)) % np.uint64(8)).astype(np.float64) + 1) / 8
    p = p.reshape(HEADS, tile_tokens)
    scores = latent @ q.T
    values = p @ latent[:, :VALUE_DIMS]  # [heads, dims], natural order
    chunks = values.reshape(HEADS, VALUE_DIMS // 32, 16, 2)  # [head, chunk, pair, even/odd]
    split = np.concatenate([chunks[..., 0], chunks[..., 1]], axis=2).reshape(HEADS, VALUE_DIMS)
    return scores, split


def check_result(result: dict, name: str) -> None:
    """ValueError naming the configuration whose tile-0 scores or values differ from the reference
    (the inputs are exact in bf16 and their sums exact in float32: no rounding to allow for)."""
    scores, values = reference()
    got_scores = np.asarray(result["scores"], dtype=np.float64).reshape(scores.shape)
    got_values = np.asarray(result["values"], dtype=np.float64).reshape(values.shape)
    for what, got, expected in (("scores", got_scores, scores), ("values", got_values, values)):
        if not np.array_equal(got, expected):
            worst = float(np.max(np.abs(got - expected)))
            raise ValueError(f"{name}: tile 0's {what} differ from the numpy reference by up to {worst:.3g}")


def measure(executable: str, configs: list[dict], cpus: list[int], region_mib: int, rounds: int) -> list[dict]:
    """One row per configuration: medians over the rounds of the summed and per-process GB/s, of
    the microseconds a tile, and of the sum over the plain read's in the same round."""
    totals = {c["name"]: [] for c in configs}
    per_process = {c["name"]: [] for c in configs}
    tile_us = {c["name"]: [] for c in configs}
    of_read = {c["name"]: [] for c in configs}
    for r in range(rounds):
        read_total = None
        for config in configs:
            results = run_processes(executable, config, cpus, region_mib)
            if config["mode"] == "loop" and r == 0:
                for result in results:
                    check_result(result, config["name"])
            total = sum(result["gbps"] for result in results)
            read_total = total if config["mode"] == "read" else read_total
            totals[config["name"]].append(total)
            per_process[config["name"]].extend(result["gbps"] for result in results)
            tile_us[config["name"]].extend(result["tile_us"] for result in results)
            of_read[config["name"]].append(total / read_total)
        log.info("round %d of %d: %s", r + 1, rounds,
                 ", ".join(f"{c['name']} {totals[c['name']][-1]:.1f}" for c in configs))
    return [{"config": c["name"], "mode": c["mode"], "prefetch": c["prefetch"], "pv": c["pv"],
             "total_gbps": statistics.median(totals[c["name"]]),
             "per_process_gbps": statistics.median(per_process[c["name"]]),
             "tile_us": statistics.median(tile_us[c["name"]]),
             "of_plain_read": statistics.median(of_read[c["name"]])} for c in configs]


def table(rows: list[dict], cpu: str, processes: int, region_mib: int, rounds: int) -> str:
    lines = [f"{cpu}, {processes} processes at once (one a CPU), {region_mib} MiB each, median of {rounds} rounds; "
             f"g++ {' '.join(COMPILE_FLAGS)}",
             "| configuration | GB/s, all processes | GB/s a process | us a 64-token tile | of the plain read |",
             "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['config']} | {row['total_gbps']:.1f} | {row['per_process_gbps']:.1f} | "
                     f"{row['tile_us']:.2f} | {row['of_plain_read']:.2f} |")
    return "\n".join(lines)


def default_region_mib() -> int:
    """Twice the last-level cache, at least 1 GiB: each process reads from DRAM."""
    levels = calibration.cache_bytes_by_level()
    llc = levels[max(levels)] if levels else 0
    return max(1024, 2 * (llc >> 20))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefetch", nargs="+", choices=PREFETCHES, default=["rows", "none", "every2", "heads2"],
                        help="ways of asking for the next tile's lines (rows: the kernel's)")
    parser.add_argument("--pv", nargs="+", choices=("on", "off"), default=["on", "off"],
                        help="the loop with PV, and the scores alone")
    parser.add_argument("--processes", type=int, default=len(os.sched_getaffinity(0)),
                        help="processes at once, each pinned to its own CPU (default: every CPU this may use)")
    parser.add_argument("--region-mib", type=int, default=None,
                        help="each process's latent region (default: twice the last-level cache, at least 1024)")
    parser.add_argument("--rounds", type=int, default=5, help="turns of every configuration (the median is reported)")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    check_positive(parser, args, ("processes", "rounds"))
    cpus = sorted(os.sched_getaffinity(0))
    if args.processes > len(cpus):
        parser.error(f"--processes must be at most the {len(cpus)} CPUs this process may use, got {args.processes}")
    min_region_mib = -(-3 * TILE_BYTES // (1 << 20))
    if args.region_mib is not None and args.region_mib < min_region_mib:
        parser.error(f"--region-mib must be >= {min_region_mib} (three 64-token tiles), got {args.region_mib}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    executable = native_probe.executable_or_exit(parser, check_host, build)
    region_mib = args.region_mib or default_region_mib()
    configs = configurations(args.prefetch, args.pv)
    rows = measure(executable, configs, cpus[: args.processes], region_mib, args.rounds)
    cpu = calibration.cpu_model()
    log.info("%s", table(rows, cpu, args.processes, region_mib, args.rounds))
    if args.out:
        write_json(args.out, {"rows": rows, "cpu_model": cpu, "processes": args.processes, "region_mib": region_mib,
                              "rounds": args.rounds, "compile_flags": list(COMPILE_FLAGS)})
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
