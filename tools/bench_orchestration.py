"""Orchestration overhead of the `ray` executor against `local`, per layer and per step, and the
cost of one CPU-partial round trip through a plain actor call vs a Ray Compiled Graph.

Part 1: the engine (all_cpu policy, so every layer's attention goes through the CPU side) decodes at
8K and 32K context under `local` and under `ray` with 1 and 2 CPU workers (emulated nodes); the
decode step time is the median over the steps, and the overhead is (ray - local) per step and per
layer, and as a share of the ray step.
Part 2: the same CPUWorker.partial call (q of 32 heads, a 32K-token table) bound as plain
`.remote()` + `ray.get` and as a compiled graph (`experimental_compile`), median round trip.

    python tools/bench_orchestration.py --out bench_results/orchestration.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import time

import numpy as np
import ray
import torch

from writescope.engine import Engine
from writescope.topology import emulated_topology

log = logging.getLogger("bench_orchestration")


def step_times_ms(executor: str, nodes: int, context: int, new_tokens: int) -> list[float]:
    options = {"executor_options": {"nodes": emulated_topology(nodes)}} if executor == "ray" else {}
    engine = Engine.from_pretrained("tiny-qwen3-moe", policy="all_cpu", executor=executor, dtype="bfloat16",
                                    max_batch_size=1, max_seq_len=context + new_tokens, **options)
    try:
        prompt = torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(0)).tolist()
        stamps = [time.perf_counter() for _ in engine.generate_stream([prompt], max_new_tokens=new_tokens)]
        return [(b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    finally:
        engine.shutdown()


def round_trips_ms(repeats: int) -> dict:
    from ray.dag import InputNode

    @ray.remote(num_cpus=0)
    class Echo:
        def partial(self, q, table, lens):  # the exchange of a CPU partial: q in, (out, lse) back
            return np.zeros((q.shape[0], q.shape[1], 128), np.float32), np.zeros(q.shape[:2], np.float32)

        def pid(self):
            return os.getpid()

    actor = Echo.remote()
    pids = [os.getpid(), ray.get(actor.pid.remote())]
    q = np.zeros((1, 32, 128), np.float32)
    table = np.arange(2048, dtype=np.int32)[None]
    lens = np.array([32768], np.int32)
    ray.get(actor.partial.remote(q, table, lens))
    plain = []
    for _ in range(repeats):
        start = time.perf_counter()
        ray.get(actor.partial.remote(q, table, lens))
        plain.append((time.perf_counter() - start) * 1e3)
    with InputNode() as inp:
        dag = actor.partial.bind(inp[0], inp[1], inp[2])
    compiled = dag.experimental_compile()
    try:
        ray.get(compiled.execute(q, table, lens))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            ray.get(compiled.execute(q, table, lens))
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        compiled.teardown(kill_actors=True)
        remove_graph_semaphores(pids)
    return {"plain_ms": statistics.median(plain), "compiled_graph_ms": statistics.median(times)}


def remove_graph_semaphores(pids) -> None:
    """Compiled graphs leave POSIX semaphores (/dev/shm/sem.hdr<pid>-*, sem.obj<pid>-*) behind."""
    for name in os.listdir("/dev/shm"):
        if any(name.startswith((f"sem.hdr{pid}-", f"sem.obj{pid}-")) for pid in pids):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768], help="context tokens")
    parser.add_argument("--new-tokens", type=int, default=24, help="decode steps timed (plus one)")
    parser.add_argument("--repeats", type=int, default=200, help="round trips timed in part 2")
    parser.add_argument("--out", default="bench_results/orchestration.json", help="JSON output path")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("RAY_CGRAPH_teardown_timeout", "5")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = []
        for context in args.contexts:
            local = statistics.median(step_times_ms("local", 1, context, args.new_tokens))
            for nodes in (1, 2):
                remote = statistics.median(step_times_ms("ray", nodes, context, args.new_tokens))
                rows.append({"context": context, "cpu_workers": nodes, "local_step_ms": local, "ray_step_ms": remote,
                             "overhead_per_step_ms": remote - local, "overhead_per_layer_ms": (remote - local) / 4,
                             "overhead_share": (remote - local) / remote})
                log.info("%s", rows[-1])
        trips = round_trips_ms(args.repeats)
    finally:
        ray.shutdown()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "round_trip": trips}, f, indent=2)
    print("| context | CPU workers | local ms/step | ray ms/step | overhead ms/layer | overhead share |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context'] // 1024}K | {r['cpu_workers']} | {r['local_step_ms']:.2f} | {r['ray_step_ms']:.2f} "
              f"| {r['overhead_per_layer_ms']:.2f} | {r['overhead_share']:.0%} |")
    print(f"\nOne CPU-partial round trip: plain actor call {trips['plain_ms']:.2f} ms, compiled graph "
          f"{trips['compiled_graph_ms']:.2f} ms (median of {args.repeats}).")


if __name__ == "__main__":
    main()
