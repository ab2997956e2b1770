"""A decode step's dense paths, timed in one engine on the same decode steps:
- `cpu_kernels`: the projections and the routed experts through the C++ extension (`writescope.dense`:
  each weight read once for the step's rows, each pair's expert read in place), a layer's attention
  inputs, its output projection and its MoE each one fused call, what a CPU decode step takes;
- `separate_kernels`: the same kernels one op at a time (norm, projection, rope, routing in torch);
- `gathered`: torch, every (token, expert) pair at once over the gathered weights;
- `one_by_one`: torch, each chosen expert once over its tokens (what a prefill takes).
The paths take turns in blocks of `--block` steps so that the host's drift falls on all alike; the
median step of each is reported.

    python tools/bench_moe.py --out bench_results/moe.json
    python tools/bench_moe.py --batches 1 4 --context 8192 --steps 60
"""

from __future__ import annotations

import argparse
import logging
import statistics

from writescope import dense
from writescope.tools.profile_step import decoding_engine
from writescope.tools.results import check_positive, host_info, write_json

log = logging.getLogger("bench_moe")
PATHS = ("cpu_kernels", "separate_kernels", "gathered", "one_by_one")


def interleaved_steps(preset: str, policy: str, batch: int, context: int, steps: int, block: int,
                      dtype: str) -> dict[str, list[float]]:
    """Decode step seconds of each path: `steps` each, in blocks of `block` steps taking turns, after
    4 warm-up steps."""
    per_path = steps // block * block
    engine, decode = decoding_engine(preset, policy, batch, context, dtype=dtype,
                                     max_new_tokens=len(PATHS) * per_path + 8)
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    try:
        next(decode)  # prefilled
        for _ in range(4):
            next(decode)
        stacked = engine.model.stacked_experts
        if not stacked:
            raise ValueError(f"{preset} has no stacked MoE layer: nothing to compare")
        for i in range(len(PATHS) * per_path):
            path = PATHS[(i // block) % len(PATHS)]
            engine.model.stacked_experts = {} if path == "one_by_one" else stacked
            dense.use_cpu_kernels = path in ("cpu_kernels", "separate_kernels")
            dense.use_fused_layers = path == "cpu_kernels"
            before = engine.stats["decode_s"]
            next(decode)
            times[path].append(engine.stats["decode_s"] - before)
    finally:
        engine.model.stacked_experts = stacked
        dense.use_cpu_kernels = dense.use_fused_layers = True
        engine.shutdown()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-qwen3-moe")
    parser.add_argument("--policy", default="all_cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps of each path")
    parser.add_argument("--block", type=int, default=4, help="consecutive steps of one path")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", default="bench_results/moe.json")
    args = parser.parse_args(argv)
    check_positive(parser, args, ["context", "steps", "block"])
    if min(args.batches) < 1:
        parser.error(f"--batches must each be >= 1, got {args.batches}")
    if args.steps < args.block:
        parser.error(f"--steps {args.steps} must be at least --block {args.block}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    for batch in args.batches:
        times = interleaved_steps(args.preset, args.policy, batch, args.context, args.steps, args.block, args.dtype)
        medians = {path: statistics.median(times[path]) * 1e3 for path in PATHS}
        rows.append({"batch": batch, "context": args.context, "steps": len(times["gathered"]),
                     **{f"{path}_ms": medians[path] for path in PATHS},
                     **{f"{path}_over_cpu_kernels": medians[path] / medians["cpu_kernels"] for path in PATHS[1:]}})
    write_json(args.out, {"args": vars(args), "host": host_info(), "rows": rows})
    lines = ["| batch | context | cpu kernels ms | separate kernels ms | torch gathered ms | torch one by one ms "
             "| separate / cpu kernels | gathered / cpu kernels | one by one / cpu kernels |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['context']} | {r['cpu_kernels_ms']:.2f} | {r['separate_kernels_ms']:.2f} | "
              f"{r['gathered_ms']:.2f} | {r['one_by_one_ms']:.2f} | {r['separate_kernels_over_cpu_kernels']:.2f} | "
              f"{r['gathered_over_cpu_kernels']:.2f} | {r['one_by_one_over_cpu_kernels']:.2f} |" for r in rows]
    log.info("%s, %s, %s: median decode step of each path\n%s", args.preset, args.policy, args.dtype, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
