"""The same decode steps on the local executor and through Ray, in one process: what the Ray path
adds to a step, and where (the attention span, the CPU kernel's own time, the rest of the step).

Both engines are built first (same preset, policy and prompts); they then take turns in rounds of
`--new-tokens` tokens, so the host's drift falls on both alike. Prefix caching keeps every round
after the first a short prefill. A round during which the hypervisor took more than `--max-steal`
of the CPUs (steal time in /proc/stat) is left out and counted: on a shared VM a round with 30%
steal doubles the cost of every cross-process wake-up, which the Ray path pays per layer.

    python tools/bench_executors.py --context 8192 --batch 4 --rounds 6 --out bench_results/executors.json
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics

from writescope.engine import Engine
from writescope.tools.bench_split import whole_batch_chunk
from writescope.tools.results import check_positive, host_info, write_json

log = logging.getLogger("bench_executors")
EXECUTORS = ("local", "ray")
WARMUP_STEPS = 3  # of each round: the first decode steps after a prefill


def cpu_times() -> list[int]:
    """The host's CPU time counters (/proc/stat's first line: user, nice, system, idle, iowait, irq,
    softirq, steal, ...), in clock ticks."""
    with open("/proc/stat") as f:
        return [int(field) for field in f.readline().split()[1:]]


def steal_share(before: list[int], after: list[int]) -> float:
    """The share of the CPUs' time the hypervisor took between two cpu_times() readings."""
    spent = [b - a for a, b in zip(before, after, strict=True)]
    return spent[7] / max(sum(spent), 1)


def summary(steps: list) -> dict:
    """Medians over decode steps (StepTimes), in ms, and the median kernel share."""
    return {"steps": len(steps),
            "step_ms": statistics.median(s.step_s for s in steps) * 1e3,
            "attention_ms": statistics.median(s.attention_s for s in steps) * 1e3,
            "cpu_kernel_ms": statistics.median(s.cpu_kernel_s for s in steps) * 1e3,
            "rest_ms": statistics.median(s.step_s - s.attention_s for s in steps) * 1e3,
            "kernel_share": statistics.median(s.attention_s / s.step_s for s in steps)}


def interleaved_rounds(args) -> tuple[dict[str, list], dict[str, int]]:
    """Each executor's decode steps (StepTimes) of the rounds kept, and the rounds left out for steal."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 200) for _ in range(args.context)] for _ in range(args.batch)]
    engines = {}
    try:
        for executor in EXECUTORS:
            engines[executor] = Engine.from_pretrained(
                args.preset, policy=args.policy, dtype=args.dtype, executor=executor, max_batch_size=args.batch,
                max_seq_len=args.context + args.new_tokens,
                prefill_chunk_tokens=whole_batch_chunk(args.batch, args.context, 16), enable_prefix_caching=True)
        kept: dict[str, list] = {executor: [] for executor in EXECUTORS}
        dropped = dict.fromkeys(EXECUTORS, 0)
        for round_index in range(args.rounds):
            order = EXECUTORS if round_index % 2 == 0 else EXECUTORS[::-1]
            for executor in order:
                engine = engines[executor]
                seen = len(engine.step_history)
                before = cpu_times()
                engine.generate(prompts, max_new_tokens=args.new_tokens)
                steal = steal_share(before, cpu_times())
                steps = list(engine.step_history)[seen:][WARMUP_STEPS:]
                log.info("round %d, %s: median step %.2f ms, steal %.2f", round_index, executor,
                         statistics.median(s.step_s for s in steps) * 1e3, steal)
                if steal > args.max_steal:
                    dropped[executor] += 1
                else:
                    kept[executor] += steps
        return kept, dropped
    finally:
        for engine in engines.values():
            engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-qwen3-moe")
    parser.add_argument("--policy", default="all_cpu", help="a named policy or share:R")
    parser.add_argument("--context", type=int, default=8192, help="prompt tokens")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens of each sequence in a round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each executor")
    parser.add_argument("--max-steal", type=float, default=0.05, help="a round with more steal is left out")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", default="bench_results/executors.json")
    args = parser.parse_args(argv)
    check_positive(parser, args, ["context", "batch", "rounds"])
    if args.new_tokens <= WARMUP_STEPS + 1:
        parser.error(f"--new-tokens must be more than {WARMUP_STEPS + 1} (the warm-up steps of a round and one "
                     f"timed), got {args.new_tokens}")
    if not 0 <= args.max_steal <= 1:
        parser.error(f"--max-steal is a share of the CPUs' time in [0, 1], got {args.max_steal}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kept, dropped = interleaved_rounds(args)
    if any(not kept[executor] for executor in EXECUTORS):
        log.error("every round of %s had more than %.2f steal: nothing to compare; raise --max-steal or --rounds",
                  [e for e in EXECUTORS if not kept[e]], args.max_steal)
        return 1
    rows = [{"executor": executor, "rounds_left_out": dropped[executor], **summary(kept[executor])}
            for executor in EXECUTORS]
    local = rows[0]
    for row in rows:
        row["step_over_local"] = row["step_ms"] / local["step_ms"]
    write_json(args.out, {"args": vars(args), "host": host_info(), "rows": rows})
    lines = ["| executor | step ms | attention span ms | CPU kernel ms | rest ms | kernel share | step / local "
             "| rounds left out |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['executor']} | {r['step_ms']:.2f} | {r['attention_ms']:.2f} | {r['cpu_kernel_ms']:.2f} | "
              f"{r['rest_ms']:.2f} | {r['kernel_share']:.2f} | {r['step_over_local']:.2f} | {r['rounds_left_out']} |"
              for r in rows]
    log.info("%s, %s, %s, %d x %d: median decode step of each executor\n%s", args.preset, args.policy, args.dtype,
             args.batch, args.context, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
