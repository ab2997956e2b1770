"""What the CPU kernel's AVX2 score loop reaches on this core when nothing else runs, with its K in
L1 and from L2, against the core's FMA peak.

The paired kernel's AVX2 score step (4 heads x 2 token vectors of 8 tokens: per dim pair 2 K loads
widened by a shift and a mask, 8 q broadcasts and 16 FMAs in 8 chains of two) is compiled on its
own from `tools/loop_ceiling_avx2.cpp` (g++ -O3 -mavx2 -mfma), beside variants of it and a burst of
register-only FMAs, and timed on one thread, the loops and the burst taking turns round by round
(each loop's share of the peak is taken against the burst of its own round):
- K in L1: one pair of 16-token blocks (8 KiB) read by every call;
- K from L2: as many block pairs as fill 60% of the L2, each read once a round, which is how the
  kernel reads a tile its prefetch put in L2.
Each loop's scores are checked against a float64 numpy reference of the same inputs before any rate
is reported. The kernel's own rate (`bench_cpu_attention.py`) against these says how much of its
loss is the loop's shape and how much is the work around it (softmax, step boundaries, the memory
level its loops read from).

    python tools/bench_loop_ceiling.py --out bench_results/loop_ceiling.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys

import numpy as np

from writescope import calibration
from writescope.tools import native_probe
from writescope.tools.results import check_positive, write_json

log = logging.getLogger("bench_loop_ceiling")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loop_ceiling_avx2.cpp")
BLOCK_PAIR_BYTES = 2 * 64 * 16 * 2 * 2  # what one call reads: two blocks of 64 dim pairs x 16 tokens x 2 bf16
COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17")


def check_host() -> None:
    """ValueError unless this is an x86-64 CPU with AVX2 and FMA, which the loops are written in."""
    native_probe.check_x86_flags(("avx2", "fma"), "the loops need AVX2 and FMA")


def build(compiler: str | None = None) -> str:
    """The loops' executable, compiled once per source and compiler into the cache directory."""
    return native_probe.build(SOURCE, COMPILE_FLAGS, "loop_ceiling", compiler)


def l2_bytes() -> int:
    """CPU 0's level-2 cache; 512 KiB where /sys does not list it."""
    return calibration.cache_bytes_by_level().get(2, 512 << 10)


def run_loops(executable: str, rounds: int, calls: int, l2_regions: int) -> dict:
    # one JSON object: the FMA peak, each loop's rates in L1 and from L2 and its shares of the peak
    # (medians over the rounds, each share within its round), one call's scores, and the q and K
    done = subprocess.run([executable, str(rounds), str(calls), str(l2_regions)], check=True, capture_output=True,
                          text=True)
    return json.loads(done.stdout)


def reference_scores(result: dict, token_vectors: int) -> np.ndarray:
    """[heads, token_vectors * 8] q.K in float64 over the first region's blocks: token vectors 0 and 1
    are block 0's tokens, vector 2 the next block's first 8."""
    pairs, block_tokens, heads = result["pairs"], result["block_tokens"], result["heads"]
    q = np.asarray(result["q"], dtype=np.float64).reshape(pairs, heads, 2)
    bits = np.asarray(result["k"], dtype=np.uint32) << 16
    k = bits.view(np.float32).astype(np.float64).reshape(2, pairs, block_tokens, 2)  # [block, pair, token, parity]
    tokens = np.concatenate([k[0], k[1]], axis=1)[:, : token_vectors * 8]  # [pair, token, parity]
    return np.einsum("phd,ptd->ht", q, tokens)


def check_scores(result: dict) -> None:
    """ValueError naming the loop whose scores differ from the reference (rounding aside)."""
    for loop in result["loops"]:
        if loop["token_vectors"] == 0:
            continue
        expected = reference_scores(result, loop["token_vectors"])
        got = np.asarray(loop["scores"], dtype=np.float64).reshape(expected.shape)
        if not np.allclose(got, expected, rtol=1e-5, atol=1e-4):
            worst = float(np.max(np.abs(got - expected)))
            raise ValueError(f"loop {loop['name']}: scores differ from the float64 reference by up to {worst:.3g}")


def measure(executable: str, rounds: int, calls: int, l2_regions: int) -> tuple[list[dict], float]:
    """One row per loop (median GFLOP/s with K in L1 and from L2, and each as a share of the FMA
    burst's rate in the same round), and the burst's median GFLOP/s."""
    result = run_loops(executable, rounds, calls, l2_regions)
    check_scores(result)
    rows = [{key: loop[key] for key in ("l1_gflops", "l2_gflops", "l1_of_peak", "l2_of_peak")} | {"loop": loop["name"]}
            for loop in result["loops"]]
    return rows, result["fma_peak_gflops"]


def table(rows: list[dict], peak_gflops: float, cpu: str, l2_regions: int) -> str:
    lines = [f"{cpu}, one thread, g++ {' '.join(COMPILE_FLAGS)}; FMA peak {peak_gflops:.1f} GFLOP/s; K from L2: "
             f"{l2_regions} x {BLOCK_PAIR_BYTES >> 10} KiB read in turn",
             "| loop | K in L1 GFLOP/s | of FMA peak | K from L2 GFLOP/s | of FMA peak |",
             "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['loop']} | {row['l1_gflops']:.1f} | {row['l1_of_peak']:.2f} | {row['l2_gflops']:.1f} | "
                     f"{row['l2_of_peak']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="turns of every loop (the median is reported)")
    parser.add_argument("--calls", type=int, default=20000, help="calls of a loop in one turn")
    parser.add_argument("--l2-regions", type=int, default=None,
                        help=f"block pairs ({BLOCK_PAIR_BYTES >> 10} KiB each) read in turn for K from L2 "
                             "(default: 60%% of the L2)")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    check_positive(parser, args, ("rounds", "calls"))
    if args.l2_regions is not None and args.l2_regions < 2:
        parser.error(f"--l2-regions must be >= 2 (1 is the L1 case), got {args.l2_regions}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    executable = native_probe.executable_or_exit(parser, check_host, build)
    l2_regions = args.l2_regions or max(2, int(0.6 * l2_bytes()) // BLOCK_PAIR_BYTES)
    rows, peak_gflops = measure(executable, args.rounds, args.calls, l2_regions)
    log.info("%s", table(rows, peak_gflops, calibration.cpu_model(), l2_regions))
    if args.out:
        write_json(args.out, {"rows": rows, "fma_peak_gflops": peak_gflops, "cpu_model": calibration.cpu_model(),
                              "l2_regions": l2_regions,
                              "rounds": args.rounds, "calls": args.calls, "compile_flags": list(COMPILE_FLAGS)})
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
