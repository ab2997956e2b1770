"""NUMA scaling on one host: CPU attention GB/s and end-to-end decode tok/s against the number of CPU
workers (one per NUMA node, real or emulated) and the threads each worker runs.

For each (workers, threads per worker) of the sweep:
  1. CPU attention: one Ray actor per worker pins every thread of its process and the C++ kernel's
     pool to the first `threads` CPUs of its node, fills its own KV (first touch after pinning, so on
     a real node the pages are local). The workers warm up together, then all call
     `ops.partial_attention` without pause through one shared time window (long enough for
     --repeats calls each), so every timed call runs against all the others; each worker's median
     call is taken, and aggregate GB/s = the KV bytes of all workers / the slowest worker's median.
     The same workers then run the extension's streaming-read probe concurrently: about the read
     bandwidth this set of pinned threads can pull; and --repeats more calls each, together, with
     the kernel's phase timers on (apart from the timed window, whose calls they would slow by a
     time-stamp read a phase): a middle tile's mean time and an item's first tile against it, summed
     over the workers, say whether the tiles themselves slow as threads are added (memory shared by
     more of them) or the items' edges do.
  2. Decode: `Engine.from_pretrained(preset, policy="all_cpu", executor="ray")` with those nodes as
     its CPU workers decodes a random prompt batch; tok/s = batch / the median gap between decode
     step ends, after two warm-up steps (as tools/bench_e2e.py).
The machine's read roofline (the same probe, one pool over every CPU of this process, best of a
probe before and one after the sweep) is reported beside each row as a fraction.

    python tools/numa_scaling.py --csv bench_results/numa_scaling.csv --png bench_results/numa_scaling.png
    writescope numa-scaling --nodes real        # a multi-socket host: one worker per real node
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass

from writescope.tools.bench_split import whole_batch_chunk
from writescope.topology import NumaNode, emulated_topology, pin_process, read_topology

log = logging.getLogger(__name__)

CSV_COLUMNS = ("workers", "threads_per_worker", "total_threads", "attention_gbps", "decode_tok_s",
               "roofline_read_gbps", "attention_of_roofline", "workers_read_gbps", "attention_of_workers_read",
               "middle_tile_us", "first_tile_in_middle_tiles")
DEFAULTS = {"context": 8192, "attention_tokens": 32768, "repeats": 9, "read_mib": 512}
QUICK = {"context": 512, "attention_tokens": 2048, "repeats": 1, "read_mib": 128}
MIN_READ_BYTES = 64 << 20  # per worker: past the last-level cache, so the probe reads DRAM
START_DELAY_S = 0.5  # the workers start their timed loops together, this long after the driver asks
MIN_WINDOW_S = 0.25  # the shortest window the workers' timed calls run in together
READ_REPEATS = 40  # of each worker's read probe: many, so the concurrent probes overlap (each fills its buffer first)


@dataclass(frozen=True)
class Point:
    """One (workers, threads per worker) of the sweep and the nodes its workers run on."""

    workers: int
    threads: int
    nodes: tuple[NumaNode, ...]  # each: the first `threads` CPUs of its node

    @property
    def total_threads(self) -> int:
        return self.workers * self.threads


# ---------------------------------------------------------------------------------------- the sweep plan
def host_nodes(mode: str, workers: int) -> list[NumaNode]:
    """The nodes `workers` CPU workers run on: the first `workers` real nodes, or this process's CPUs
    split into `workers` emulated nodes. ValueError naming what is allowed otherwise."""
    if workers < 1:
        raise ValueError(f"--workers {workers}: allowed 1 or more")
    if mode == "real":
        nodes = read_topology()
        if workers > len(nodes):
            raise ValueError(f"--workers {workers} with --nodes real: this host has {len(nodes)} NUMA node(s), so "
                             f"allowed 1 to {len(nodes)}; --nodes emulated splits its CPUs into more")
        return nodes[:workers]
    if mode == "emulated":
        cpus = len(os.sched_getaffinity(0))
        if workers > cpus:
            raise ValueError(f"--workers {workers} with --nodes emulated: this process has {cpus} CPU(s), so "
                             f"allowed 1 to {cpus} (one CPU per emulated node at most)")
        return emulated_topology(workers)
    raise ValueError(f"--nodes {mode!r}: allowed 'real' or 'emulated'")


def default_nodes_mode() -> str:
    """'real' on a multi-node host, 'emulated' on a one-node one."""
    return "real" if len(read_topology()) > 1 else "emulated"


def max_workers(mode: str) -> int:
    return len(read_topology()) if mode == "real" else len(os.sched_getaffinity(0))


def plan_sweep(mode: str, workers: list[int], threads: list[int] | None) -> list[Point]:
    """Every (workers, threads) asked, in order. threads None: 1..the CPUs of the smallest node, for
    each worker count. A threads value that fits some worker counts but not others is left out for
    those (logged); one that fits none, or a worker count the host cannot run, is a ValueError."""
    if not workers:
        raise ValueError("--workers: give at least one worker count")
    nodes_by_count = {w: host_nodes(mode, w) for w in dict.fromkeys(workers)}
    room = {w: min(len(node.cpus) for node in nodes) for w, nodes in nodes_by_count.items()}
    if threads is not None:
        if any(t < 1 for t in threads):
            raise ValueError(f"--threads {' '.join(map(str, threads))}: allowed 1 or more, or 'all'")
        largest = max(room.values())
        too_many = [t for t in threads if t > largest]
        if too_many:
            raise ValueError(f"--threads {too_many[0]}: the nodes of the worker counts asked have at most {largest} "
                             f"CPU(s) each, so allowed 1 to {largest} (or 'all')")
    points = []
    for w, nodes in nodes_by_count.items():
        for t in (range(1, room[w] + 1) if threads is None else dict.fromkeys(threads)):
            if t > room[w]:
                log.warning("skipping workers=%d threads=%d: each of its nodes has %d CPU(s)", w, t, room[w])
                continue
            points.append(Point(w, t, tuple(NumaNode(n.index, n.cpus[:t], emulated=n.emulated) for n in nodes)))
    return points


# ---------------------------------------------------------------------------------------- CPU attention
class AttentionWorker:
    """One CPU worker of the attention measurement (a Ray actor; see attention_actor_class)."""

    def __init__(self, shape_name: str, tokens: int, seed: int):
        self.shape_name, self.tokens, self.seed = shape_name, tokens, seed
        self.inputs = None

    def configure(self, node: NumaNode) -> dict:
        """Pins every thread of this process and the kernel's pool to node.cpus; fills the KV on the
        first call (after pinning, so its pages are first touched from the node)."""
        import torch

        from writescope import _cpu
        from writescope.tools.bench_cpu_attention import SHAPES, make_inputs

        pin_process(node.cpus)
        torch.set_num_threads(len(node.cpus))
        if self.inputs is None:
            torch.manual_seed(self.seed)
            shape = next(s for s in SHAPES if s.name == self.shape_name)
            self.inputs = (*make_inputs(shape, self.tokens), shape.head_dim_qk**-0.5)
        return {"pid": os.getpid(), "pool_threads": _cpu.num_threads(), "pinned_cpus": list(_cpu.pinned_cpus()),
                "affinity": sorted(os.sched_getaffinity(0))}

    def _call(self):
        from writescope import ops

        q, k, v, scale = self.inputs
        return ops.partial_attention(q, k, v, scale=scale, backend="cpu")

    def warm_up(self, warmup: int) -> float:
        """`warmup` untimed calls, then the median of three: an estimate of one call's seconds."""
        from writescope.calibration import median_time_s

        return median_time_s(self._call, 3, warmup)

    def attention_s(self, start_at: float, end_at: float, repeats: int) -> tuple[float, int]:
        """(median seconds, calls) of the calls that ran inside [start_at, end_at] (epoch seconds): every
        worker calls without pause through the same window, so each timed call runs against all the
        others. At least `repeats` calls: past the window only if it was too short for them."""
        time.sleep(max(0.0, start_at - time.time()))
        times = []
        while True:
            started = time.perf_counter()
            self._call()
            elapsed = time.perf_counter() - started
            if time.time() > end_at and len(times) >= repeats:
                break  # ended after the window: the others may have stopped
            times.append(elapsed)
        return statistics.median(times), len(times)

    def phase_totals(self, start_at: float, calls: int) -> dict:
        """The kernel's phase timers, {phase: (count, seconds)}, over `calls` calls started at start_at
        (epoch) with the other workers; the timers are off again afterwards."""
        from writescope import _cpu

        time.sleep(max(0.0, start_at - time.time()))
        _cpu.set_phase_timers(True)
        try:
            for _ in range(calls):
                self._call()
            return _cpu.phase_timers()
        finally:
            _cpu.set_phase_timers(False)

    def read_gbps(self, start_at: float, num_bytes: int, repeats: int) -> float:
        """Median streaming-read GB/s of this worker's pinned pool, started at start_at (epoch)."""
        from writescope import _cpu

        time.sleep(max(0.0, start_at - time.time()))
        return statistics.median(_cpu.read_bandwidth(num_bytes, repeats))


def attention_actor_class():
    import ray

    return ray.remote(num_cpus=0)(AttentionWorker)


def kv_bytes_of(shape_name: str, tokens: int) -> int:
    from writescope.tools.bench_cpu_attention import SHAPES, kv_bytes

    return kv_bytes(next(s for s in SHAPES if s.name == shape_name), tokens)


def tile_figures(worker_totals: list[dict]) -> dict:
    """The workers' phase totals summed: a middle tile's mean microseconds and an item's first tile
    against it (None where no item had a middle tile)."""
    from writescope.tools import profile_cpu_phases

    summed: dict[str, tuple[int, float]] = {}
    for totals in worker_totals:
        for phase, (count, seconds) in totals.items():
            before = summed.get(phase, (0, 0.0))
            summed[phase] = (before[0] + count, before[1] + seconds)
    figures = profile_cpu_phases.tile_figures(summed)
    return {key: figures[key] for key in ("middle_tile_us", "first_tile_in_middle_tiles")}


def measure_attention(actors: list, point: Point, *, shape: str, tokens_per_worker: int, warmup: int,
                      repeats: int, read_bytes: int) -> dict:
    """Aggregate attention GB/s and the workers' concurrent read GB/s for one point of the sweep."""
    import ray

    infos = ray.get([a.configure.remote(node) for a, node in zip(actors, point.nodes, strict=True)])
    for info, node in zip(infos, point.nodes, strict=True):
        if info["affinity"] != sorted(node.cpus) or info["pool_threads"] != len(node.cpus):
            raise RuntimeError(f"worker {info['pid']} did not pin to {list(node.cpus)}: {info}")
    estimate = max(ray.get([a.warm_up.remote(warmup) for a in actors]))  # the workers warm up together
    start_at = time.time() + START_DELAY_S
    end_at = start_at + max(MIN_WINDOW_S, 2 * repeats * estimate)
    timed = ray.get([a.attention_s.remote(start_at, end_at, repeats) for a in actors])
    seconds = [s for s, _ in timed]
    start_at = time.time() + START_DELAY_S
    reads = ray.get([a.read_gbps.remote(start_at, read_bytes, READ_REPEATS) for a in actors])
    start_at = time.time() + START_DELAY_S
    phases = ray.get([a.phase_totals.remote(start_at, repeats) for a in actors])
    total_bytes = point.workers * kv_bytes_of(shape, tokens_per_worker)
    log.debug("workers=%d threads=%d: per-worker (median s, calls) %s", point.workers, point.threads, timed)
    return {"attention_gbps": total_bytes / max(seconds) / 1e9, "workers_read_gbps": sum(reads),
            **tile_figures(phases)}


def machine_read_gbps(num_bytes: int, repeats: int = 5) -> float:
    """The machine's streaming-read roofline: the extension's probe, one pool over every CPU of this process."""
    from writescope import _cpu

    return statistics.median(_cpu.read_bandwidth(num_bytes, repeats))


# ---------------------------------------------------------------------------------------- decode
def decode_tok_s(point: Point, *, preset: str, context: int, batch: int, new_tokens: int, seed: int = 0) -> float:
    """Decode tok/s of the engine on Ray (all_cpu) with one CPU worker per node of the point."""
    import torch

    from writescope.engine import Engine
    from writescope.tools.bench_e2e import median_step_tok_s

    engine = Engine.from_pretrained(preset, policy="all_cpu", executor="ray", dtype="bfloat16",
                                    max_batch_size=batch, max_seq_len=context + new_tokens,
                                    prefill_chunk_tokens=whole_batch_chunk(batch, context, 16),  # whole-batch steps
                                    executor_options={"nodes": list(point.nodes)})
    try:
        prompts = torch.randint(0, 256, (batch, context), generator=torch.Generator().manual_seed(seed)).tolist()
        produced = [0] * batch
        step_ends: dict[int, float] = {}  # n -> when the last sequence got its n-th token
        early = []
        for event in engine.generate_stream(prompts, max_new_tokens=new_tokens):
            produced[event.index] += 1
            step_ends[produced[event.index]] = time.perf_counter()
            if event.finish_reason not in (None, "length"):
                early.append((event.index, event.finish_reason, produced[event.index]))
        if early:
            log.warning("sequences finished before %d tokens (index, reason, tokens): %s; later steps ran a "
                        "smaller batch", new_tokens, early)
        return median_step_tok_s([step_ends[n] for n in sorted(step_ends)], batch)
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------------------------- the run
def run_sweep(points: list[Point], args, progress: bool = True) -> tuple[list[dict], float]:
    """Measures every point; returns the rows (CSV_COLUMNS) and the machine's read roofline in GB/s.
    Needs a running Ray."""
    import ray
    from tqdm import tqdm

    read_bytes = args.read_mib << 20
    before = machine_read_gbps(read_bytes)
    log.info("machine read roofline (probe before the sweep): %.1f GB/s", before)
    actor_class = attention_actor_class()
    rows = []
    with tqdm(total=len(points), desc="numa scaling", unit="point", disable=not progress) as bar:
        for workers in dict.fromkeys(p.workers for p in points):
            tokens = args.attention_tokens // workers
            actors = [actor_class.remote(args.shape, tokens, seed) for seed in range(workers)]
            try:
                for point in (p for p in points if p.workers == workers):
                    bar.set_postfix(workers=point.workers, threads=point.threads)
                    row = {"workers": point.workers, "threads_per_worker": point.threads,
                           "total_threads": point.total_threads}
                    row.update(measure_attention(actors, point, shape=args.shape, tokens_per_worker=tokens,
                                                 warmup=args.warmup, repeats=args.repeats,
                                                 read_bytes=max(read_bytes // workers, MIN_READ_BYTES)))
                    row["decode_tok_s"] = decode_tok_s(point, preset=args.preset, context=args.context,
                                                       batch=args.batch, new_tokens=args.new_tokens)
                    log.info("workers=%d threads=%d: attention %.1f GB/s (workers' read %.1f GB/s), decode %.1f tok/s",
                             point.workers, point.threads, row["attention_gbps"], row["workers_read_gbps"],
                             row["decode_tok_s"])
                    rows.append(row)
                    bar.update()
            finally:
                for actor in actors:
                    with contextlib.suppress(Exception):
                        ray.kill(actor)
    after = machine_read_gbps(read_bytes)
    roofline = max(before, after)
    log.info("machine read roofline (probe after the sweep): %.1f GB/s; using the best, %.1f GB/s", after, roofline)
    for row in rows:
        row["roofline_read_gbps"] = roofline
        row["attention_of_roofline"] = row["attention_gbps"] / roofline
        row["attention_of_workers_read"] = row["attention_gbps"] / row["workers_read_gbps"]
    return [{key: row[key] for key in CSV_COLUMNS} for row in rows], roofline


def write_csv(rows: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})


def plot(rows: list[dict], path: str, roofline: float, title: str) -> None:
    """Attention GB/s and decode tok/s against total threads, one line per worker count (Agg, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.6), layout="constrained")
    FigureCanvasAgg(figure)
    attention_ax, decode_ax = figure.subplots(1, 2)
    for workers in sorted({r["workers"] for r in rows}):
        mine = sorted((r for r in rows if r["workers"] == workers), key=lambda r: r["total_threads"])
        x = [r["total_threads"] for r in mine]
        label = f"{workers} worker{'s' if workers > 1 else ''}"
        attention_ax.plot(x, [r["attention_gbps"] for r in mine], marker="o", label=label)
        decode_ax.plot(x, [r["decode_tok_s"] for r in mine], marker="o", label=label)
    attention_ax.axhline(roofline, color="grey", linestyle="--", label=f"read roofline {roofline:.1f} GB/s")
    attention_ax.set(xlabel="total threads (workers x threads per worker)", ylabel="aggregate KV GB/s",
                     title="CPU partial attention")
    decode_ax.set(xlabel="total threads (workers x threads per worker)", ylabel="decode tok/s",
                  title="end-to-end decode (Ray, all_cpu)")
    threads = sorted({r["total_threads"] for r in rows})
    tops = (max(roofline, *(r["attention_gbps"] for r in rows)), max(r["decode_tok_s"] for r in rows))
    for ax, top in zip((attention_ax, decode_ax), tops, strict=True):
        ax.set_xticks(threads)
        ax.set_ylim(0, top * 1.35)  # the legend's room, above every point and the roofline
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
    figure.suptitle(title)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=120)


def markdown_table(rows: list[dict]) -> str:
    from writescope.tools.profile_cpu_phases import format_figure

    lines = ["| workers | threads/worker | total threads | attention GB/s | of roofline | workers' read GB/s "
             "| of workers' read | decode tok/s | middle tile us | first tile / middle |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workers']} | {r['threads_per_worker']} | {r['total_threads']} | {r['attention_gbps']:.1f} "
                     f"| {r['attention_of_roofline']:.2f} | {r['workers_read_gbps']:.1f} "
                     f"| {r['attention_of_workers_read']:.2f} | {r['decode_tok_s']:.1f} "
                     f"| {format_figure(r['middle_tile_us'])} | {format_figure(r['first_tile_in_middle_tiles'])} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- command line
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: allowed 1 or more")
    return value


def build_parser() -> argparse.ArgumentParser:
    from writescope.models.presets import PRESETS
    from writescope.tools.bench_cpu_attention import SHAPES

    parser = argparse.ArgumentParser(prog="writescope numa-scaling", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--nodes", choices=["real", "emulated"], default=None,
        help="worker nodes: the host's real NUMA nodes, or its CPUs split into equal emulated nodes "
             "(default: real on a multi-node host, emulated on a one-node host)")
    add("--workers", type=_positive_int, nargs="+", default=None,
        help="CPU worker counts, one worker per node (default 1..N, N = the CPUs when emulated, the NUMA nodes "
             "when real)")
    add("--threads", nargs="+", default=["all"],
        help="threads per worker: integers, or 'all' = 1..the CPUs of the smallest node for each worker count "
             "(default all); a value too large for some worker counts is skipped for those")
    add("--context", type=_positive_int, default=None,
        help=f"prompt tokens of the decode run (default {DEFAULTS['context']}, --quick {QUICK['context']})")
    add("--batch", type=_positive_int, default=2, help="sequences decoded together (default 2)")
    add("--new-tokens", type=_positive_int, default=12,
        help="tokens generated per sequence (default 12); at least 4: the first two decode steps are warm-up")
    add("--preset", default="tiny-qwen3-moe", choices=list(PRESETS),
        help="model of the decode run (default tiny-qwen3-moe)")
    add("--attention-tokens", type=_positive_int, default=None,
        help=f"KV tokens of the attention measurement in all, split evenly across the workers "
             f"(default {DEFAULTS['attention_tokens']}, --quick {QUICK['attention_tokens']})")
    add("--shape", default="qwen3-moe", choices=[s.name for s in SHAPES],
        help="attention shape, bf16 KV, from tools/bench_cpu_attention.py (default qwen3-moe)")
    add("--repeats", type=_positive_int, default=None,
        help=f"timed attention calls per worker at least, in a window shared by the workers, median taken "
             f"(default {DEFAULTS['repeats']}, "
             f"--quick {QUICK['repeats']})")
    add("--warmup", type=int, default=2, help="untimed attention calls per worker before timing (default 2)")
    add("--read-mib", type=_positive_int, default=None,
        help=f"buffer of the read-bandwidth probes in MiB, split across the workers, 64 MiB each at least "
             f"(default {DEFAULTS['read_mib']}, --quick {QUICK['read_mib']})")
    add("--csv", default="bench_results/numa_scaling.csv",
        help="CSV output path (default bench_results/numa_scaling.csv)")
    add("--png", default="bench_results/numa_scaling.png",
        help="plot output path, PNG (default bench_results/numa_scaling.png)")
    add("--quick", action="store_true",
        help="a tiny sweep for tests: context 512, attention 2048 tokens, 1 repeat (explicit flags still win)")
    add("--no-progress", action="store_true", help="no progress bar")
    return parser


def resolve_args(parser: argparse.ArgumentParser, argv: list[str] | None):
    """Parsed arguments with the defaults filled in and checked, and the sweep's points; exits through
    parser.error (status 2, the message names what is allowed) on a bad flag."""
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.new_tokens < 4:
        parser.error(f"--new-tokens {args.new_tokens}: allowed 4 or more (two decode steps are warm-up, then at "
                     f"least one gap is timed)")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: allowed 0 or more")
    args.nodes = args.nodes or default_nodes_mode()
    if args.threads == ["all"]:
        threads = None
    else:
        try:
            threads = [_positive_int(t) for t in args.threads]
        except argparse.ArgumentTypeError as error:
            parser.error(f"--threads: {error} (allowed: integers >= 1, or 'all')")
    workers = args.workers or list(range(1, max_workers(args.nodes) + 1))
    try:
        points = plan_sweep(args.nodes, workers, threads)
        if any(p.workers > 1 for p in points) and args.attention_tokens < max(workers):
            raise ValueError(f"--attention-tokens {args.attention_tokens}: allowed at least {max(workers)} "
                             f"(one token per worker)")
    except ValueError as error:
        parser.error(str(error))
    return args, points


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, points = resolve_args(parser, argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import ray
    from tqdm.contrib.logging import logging_redirect_tqdm

    from writescope.actors.local_ray import start_local_ray

    log.info("%d points (%s nodes): %s", len(points), args.nodes,
             ", ".join(f"{p.workers}x{p.threads}" for p in points))
    started = not ray.is_initialized()
    if started:
        start_local_ray(num_cpus=os.cpu_count())
    try:
        with logging_redirect_tqdm():
            rows, roofline = run_sweep(points, args, progress=not args.no_progress)
    finally:
        if started:
            ray.shutdown()
    write_csv(rows, args.csv)
    cpus = len(os.sched_getaffinity(0))
    title = (f"{cpus} CPUs, {len(read_topology())} NUMA node(s), CPU workers on {args.nodes} nodes\n"
             f"attention: {args.shape}, bf16, {args.attention_tokens} KV tokens in all; decode: {args.preset}, "
             f"batch {args.batch} x {args.context} tokens of context")
    plot(rows, args.png, roofline, title)
    log.info("wrote %s and %s", args.csv, args.png)
    print(markdown_table(rows))
    print(f"\nMachine read roofline (streaming-read probe, every CPU of this process): {roofline:.1f} GB/s")
    return 0


if __name__ == "__main__":
    # Run through the package module, so Ray pickles AttentionWorker by reference, not by value.
    from writescope.tools.numa_scaling import main as package_main

    sys.exit(package_main())
