"""Orchestration overhead of the engine on Ray against `local`, per layer and per step, and the
cost of one CPU-partial round trip through each binding: a plain actor call, a Ray Compiled Graph,
and the shared-memory channel the engine uses.

Part 1: the engine (all_cpu policy, so every layer's attention goes through the CPU side) decodes at
8K and 32K context under `local` and under `ray` (GPU worker + 1 or 2 CPU workers on emulated
nodes, per-layer exchange over the shared-memory channels); the decode step time is the median over
the steps, and the overhead is (ray - local) per step and per layer, and as a share of the ray step.
Part 2: the exchange of one CPU partial (q of 32 heads, a 32K-token table in; out and lse back) with
a trivial partial, bound as plain `.remote()` + `ray.get`, as a compiled graph
(`experimental_compile`) and over a channel (writescope.actors.cpu_worker), median round trip.

    python tools/bench_orchestration.py --out bench_results/orchestration.json
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import time

import numpy as np
import ray
import torch

from writescope.actors.cpu_worker import ChannelSpec, PartialClient, create_segment
from writescope.actors.local_ray import start_local_ray
from writescope.engine import Engine
from writescope.tools.results import write_json
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
    return {"plain_ms": statistics.median(plain), "compiled_graph_ms": statistics.median(times),
            "channel_ms": channel_round_trip_ms(q, table, lens, repeats)}


def channel_round_trip_ms(q, table, lens, repeats: int) -> float:
    @ray.remote(num_cpus=0)
    class ChannelEcho:
        def __init__(self, spec):
            import torch

            from writescope.actors.cpu_worker import PartialServer

            def zeros(region, layer, q, block_table, seq_lens, scale, unit):
                return torch.zeros(q.shape[0], q.shape[1], spec.head_dim_v), torch.zeros(q.shape[:2]), 0.0

            self.server = PartialServer(spec, zeros, region_layers=[1])

        def ready(self):
            return self.server.serving()

    spec = ChannelSpec(shm_name="named below", owner_pid=0, fd=-1, socket_address=f"\0writescope-bench-{os.getpid()}",
                       max_seqs=1, max_blocks=table.shape[1], num_q_heads=q.shape[1], head_dim_qk=q.shape[2],
                       head_dim_v=128)
    spec, segment = create_segment(spec, f"bench_{os.getpid()}")  # this process owns it, the echo actor maps it
    echo = ChannelEcho.remote(spec)
    client = None
    try:
        ray.get(echo.ready.remote())
        client = PartialClient(spec)
        args = (0, torch.from_numpy(q), torch.from_numpy(table), torch.from_numpy(lens), 1.0)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            client.send(*args)
            client.receive()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times[1:])
    finally:
        if client is not None:
            client.close()
        ray.kill(echo)
        segment.close()


def remove_graph_semaphores(pids) -> None:
    """Compiled graphs leave POSIX semaphores (/dev/shm/sem.hdr<pid>-*, sem.obj<pid>-*) behind."""
    for name in os.listdir("/dev/shm"):
        if any(name.startswith((f"sem.hdr{pid}-", f"sem.obj{pid}-")) for pid in pids):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768], help="context tokens")
    parser.add_argument("--new-tokens", type=int, default=24, help="decode steps timed (plus one)")
    parser.add_argument("--repeats", type=int, default=200, help="round trips timed in part 2")
    parser.add_argument("--out", default="bench_results/orchestration.json", help="JSON output path")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("RAY_CGRAPH_teardown_timeout", "5")
    start_local_ray(num_cpus=2)
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
    write_json(args.out, {"rows": rows, "round_trip": trips})
    print("| context | CPU workers | local ms/step | ray ms/step | overhead ms/layer | overhead share |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context'] // 1024}K | {r['cpu_workers']} | {r['local_step_ms']:.2f} | {r['ray_step_ms']:.2f} "
              f"| {r['overhead_per_layer_ms']:.2f} | {r['overhead_share']:.0%} |")
    print(f"\nOne CPU-partial round trip: plain actor call {trips['plain_ms']:.2f} ms, compiled graph "
          f"{trips['compiled_graph_ms']:.2f} ms, shared-memory channel {trips['channel_ms']:.3f} ms "
          f"(median of {args.repeats}).")


if __name__ == "__main__":
    main()
