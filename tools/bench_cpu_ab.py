"""Builds, ISA variants and KV layouts of the CPU kernel against each other, interleaved in one process.

On a shared host the machine's speed drifts by tens of percent within a minute, so two benchmark
runs minutes apart cannot tell a 10% change from the drift. This loads every given build of the
extension side by side (each a `_cpu*.so` file: this checkout's, and one built from another commit)
and times them in turns on the same inputs: each round runs every contestant on the next cold copies
of the KV (as `bench_cpu_attention.py` lays them out: at least --cold-mib between two reads of the
same bytes), so a drift falls on all alike. Every contestant's result is checked against the float32
torch reference first. Reports each one's median wall time and 10th percentile, the median of the
kernel's own seconds (its return value: no Python), and each median over the first contestant's;
after every round it reads one copy of the KV whole (the first build's probe) and reports the host's
read rate, median and range, which says what stretch of a shared host the run met.

    git worktree add /tmp/before HEAD~1 && (cd /tmp/before && python setup.py build_ext --inplace)
    python tools/bench_cpu_ab.py --builds /tmp/before/core/_cpu*.so core/_cpu*.so --shape mixtral

The contestants are every combination of --builds, --variants (each build's file copied per variant,
so each copy keeps its own selection), --block-sizes, --run-blocks (a sequence's blocks in runs of
that many consecutive physical ids, the runs shuffled), --pages (the KV copies in 4 KB pages, as torch
allocates them, or in private memory advised for 2 MB transparent huge pages), --chunk-tokens (the
work item) and --pacing, in that order; --threads sets every build's pool. For example one build's variants, or
one build on two layouts, or on two page sizes:

    python tools/bench_cpu_ab.py --builds core/_cpu*.so --variants avx2 avx512 avx512bf16
    python tools/bench_cpu_ab.py --builds core/_cpu*.so --block-sizes 16 64 --run-blocks 16 2048
    python tools/bench_cpu_ab.py --builds core/_cpu*.so --pages 4k 2m
    python tools/bench_cpu_ab.py --builds core/_cpu*.so --pacing off on

--pacing sets the paired kernel's pacing (`_cpu.set_pacing`) before each of a contestant's calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import logging
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from writescope import ops, reference
from writescope.block_allocator import EXTENT_BLOCKS
from writescope.calibration import cpu_model
from writescope.tools.bench_cpu_attention import SHAPES, cache_source, copies_for, kv_bytes, make_inputs, probe_buffers
from writescope.tools.results import check_positive, write_json

log = logging.getLogger("bench_cpu_ab")


def load_build(path: str, index: int):
    """The extension module in `path`, under a package name of its own (the init symbol is the
    module's last name, `_cpu`, so every build loads beside the others)."""
    if not os.path.isfile(path):
        raise ValueError(f"--builds: {path!r} is not a file (give built _cpu*.so extension files)")
    spec = importlib.util.spec_from_file_location(f"writescope_build_{index}._cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_variant(path: str, index: int, variant: str, workdir: str):
    """The build in `path` with ISA variant `variant` selected, from a copy of its own (a file loaded
    twice is one library, whose selected variant the two would share)."""
    if not os.path.isfile(path):
        raise ValueError(f"--builds: {path!r} is not a file (give built _cpu*.so extension files)")
    copy = os.path.join(workdir, f"{index}_{os.path.basename(path)}")
    shutil.copy(path, copy)
    module = load_build(copy, index)
    if variant not in module.available_variants():
        raise ValueError(f"--variants: {variant!r} does not run on this CPU with {path!r}; it runs "
                         f"{', '.join(module.available_variants())}")
    module.set_variant(variant)
    return module


@dataclasses.dataclass(frozen=True)
class Contestant:
    """One combination the run times: a build (with a variant, None: its own best) on one KV layout."""

    build: str
    variant: str | None
    block_size: int
    run_blocks: int
    pages: str  # "4k": the copies as torch allocates them; "2m": advised for transparent huge pages
    chunk_tokens: int | None  # None: the kernel sizes its work items itself
    pacing: str | None = None  # "on" / "off": the paired kernel's pacing (_cpu.set_pacing); None: as built


_HUGE_PAGE_BYTES = 2 << 20
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_enabled() -> bool:
    """Whether this host gives private memory transparent huge pages when asked (madvise)."""
    try:
        with open(_THP_SETTING) as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False


def anon_huge_page_bytes() -> int:
    """Bytes of this host's private memory in transparent huge pages (/proc/meminfo AnonHugePages)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


class HugePageArrays:
    """Tensors copied into private anonymous mappings advised MADV_HUGEPAGE, 2 MB aligned; the
    mappings live as long as this object."""

    def __init__(self):
        self._mappings = []

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `tensor` in huge-page-advised memory."""
        nbytes = tensor.numel() * tensor.element_size()
        size = -(-nbytes // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES + _HUGE_PAGE_BYTES  # room to align
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
        self._mappings.append(mapping)
        raw = torch.frombuffer(mapping, dtype=torch.uint8)
        start = -raw.data_ptr() % _HUGE_PAGE_BYTES
        placed = raw[start:start + nbytes].view(tensor.dtype).view(tensor.shape)
        placed.copy_(tensor)
        return placed

    def source(self, shape, source: ops.KVSource) -> ops.KVSource:
        """`source` (as cache_source lays it out: [num_kv_heads, num_blocks, ...] storage seen
        through a transpose) with its K and V storage moved here."""
        k_cache = self.copy(source.k_cache.transpose(0, 1).contiguous()).transpose(0, 1)
        v_cache = (k_cache[..., : shape.head_dim_v] if shape.v_in_k
                   else self.copy(source.v_cache.transpose(0, 1).contiguous()).transpose(0, 1))
        return ops.KVSource(k_cache, v_cache, source.block_table, source.seq_lens)


def call(module, q, source: ops.KVSource, scale: float, out, lse, chunk_tokens: int | None = None,
         pacing: str | None = None) -> float:
    """One kernel call, with the build's pacing set first where `pacing` is given (two contestants of
    one build share its runtime); returns the kernel's own seconds.
    q [1, num_q_heads, head_dim_qk]; out [1, num_q_heads, head_dim_v]; lse [1, num_q_heads]"""
    if pacing is not None:
        module.set_pacing(pacing == "on")
    return module.paged_attention(ops._as_numpy(q), ops._as_numpy(source.k_cache), ops._as_numpy(source.v_cache),
                                  ops._as_numpy(source.block_table), ops._as_numpy(source.seq_lens), out.numpy(),
                                  lse.numpy(), q_dtype="bfloat16", kv_dtype="bfloat16", layout=source.layout,
                                  scale=scale, chunk_tokens=chunk_tokens)


def measure(contestants: list[Contestant], modules: list, shape, seq_len: int, cold_bytes: int,
            rounds: int) -> tuple[list[tuple[list[float], list[float]]], list[float]]:
    """(wall seconds, kernel seconds) of every call, per contestant, taking turns round by round, the
    order rotated each round; and after each round, the host's whole-array read of one KV copy in
    GB/s (the first build's probe and pool; empty where that build has no probe). The read says
    which stretch of a shared host a run met: on a 2-vCPU Zen 4 it moved between 31 and 58 GB/s
    within an hour, and a change to a memory-bound row can only show where the memory is fast."""
    q, k, v = make_inputs(shape, seq_len)
    scale = shape.head_dim_qk**-0.5
    num_copies = copies_for(shape, seq_len, cold_bytes)
    layouts = dict.fromkeys((c.block_size, c.run_blocks, c.pages) for c in contestants)
    huge = HugePageArrays()
    huge_before = anon_huge_page_bytes()
    sources = {}
    for block_size, run_blocks, pages in layouts:
        copies = [cache_source(shape, k, v, torch.Generator().manual_seed(i), run_blocks, block_size)
                  for i in range(num_copies)]
        sources[block_size, run_blocks, pages] = copies if pages == "4k" else [huge.source(shape, c) for c in copies]
    if any(pages == "2m" for _, _, pages in layouts):
        log.info("KV copies in transparent huge pages: %.0f MiB", (anon_huge_page_bytes() - huge_before) / 2**20)
    out = torch.empty((1, shape.num_q_heads, shape.head_dim_v))
    lse = torch.empty((1, shape.num_q_heads))
    ref_out, ref_lse = ops.partial_attention(q, k, v, scale=scale, backend="torch")
    for contestant, module in zip(contestants, modules, strict=True):
        call(module, q[None], sources[contestant.block_size, contestant.run_blocks, contestant.pages][0], scale, out,
             lse, contestant.chunk_tokens, contestant.pacing)
        # a build on its bf16-dot path or on AMX tiles rounds the probabilities to bf16 (see
        # ops.cpu_rounds_probabilities); older builds have only uses_bf16_dot
        older = getattr(module, "uses_bf16_dot", lambda: False)
        rounds_probabilities = getattr(module, "rounds_probabilities", older)()
        rounding = reference.probability_rounding_atol(v) if rounds_probabilities else 0.0
        torch.testing.assert_close(out[0], ref_out, atol=2e-5 + rounding, rtol=1e-4)
        torch.testing.assert_close(lse[0], ref_lse, atol=2e-5, rtol=1e-5)
    calls_per_turn = max(3, num_copies)
    times = [([], []) for _ in contestants]
    turn = 0
    entries = list(zip(contestants, modules, times, strict=True))
    first_copies = sources[next(iter(layouts))]
    read = getattr(modules[0], "stream_read_seconds", None)
    host_read_gbps = []
    for round_index in range(rounds):
        for contestant, module, (walls, kernels) in round_order(entries, round_index):
            copies = sources[contestant.block_size, contestant.run_blocks, contestant.pages]
            for _ in range(calls_per_turn):
                source = copies[turn % num_copies]
                turn += 1
                began = time.perf_counter()
                kernels.append(call(module, q[None], source, scale, out, lse, contestant.chunk_tokens,
                                    contestant.pacing))
                walls.append(time.perf_counter() - began)
        if read is not None:
            host_read_gbps.append(kv_bytes(shape, seq_len) / read(probe_buffers(shape, first_copies[turn % num_copies]))
                                  / 1e9)
            turn += 1
    return times, host_read_gbps


def round_order(entries: list, round_index: int) -> list:
    """The contestants' turns in a round: each round starts one contestant further on, so none always
    follows the same one (the build before leaves its pool's workers spinning and its bytes in the
    caches; with a fixed order the first of two builds measured up to 6% faster)."""
    start = round_index % len(entries)
    return entries[start:] + entries[:start]


def fast_rounds(host_read_gbps: list[float]) -> list[int]:
    """The rounds after which the host's read was in its top third: the stretches of a shared host
    where the memory was fast, the only ones where a memory-bound row can show a change to what caps
    it there (on a 2-vCPU Zen 4 the kernel's pacing moved Mixtral 1.19x in them, 1.05x in slow ones)."""
    if not host_read_gbps:
        return []
    cut = sorted(host_read_gbps)[len(host_read_gbps) * 2 // 3]
    return [r for r, gbps in enumerate(host_read_gbps) if gbps >= cut]


def calls_in_rounds(walls: list[float], num_rounds: int, rounds: list[int]) -> list[float]:
    """A contestant's calls in the given rounds (each round took the same number of calls, in order)."""
    per_round = len(walls) // num_rounds
    return [wall for r in rounds for wall in walls[r * per_round:(r + 1) * per_round]]


def summarize(contestants: list[Contestant], modules: list, times, shape, seq_len: int,
              threads: int | None, host_read_gbps: list[float] | None = None) -> list[dict]:
    first = statistics.median(times[0][0])
    fast = fast_rounds(host_read_gbps or [])
    first_fast = statistics.median(calls_in_rounds(times[0][0], len(host_read_gbps), fast)) if fast else None
    rows = []
    for contestant, module, (walls, kernels) in zip(contestants, modules, times, strict=True):
        median = statistics.median(walls)
        if fast:
            fast_median = statistics.median(calls_in_rounds(walls, len(host_read_gbps), fast))
            fast_fields = {"fast_rounds": len(fast), "fast_rounds_median_ms": fast_median * 1e3,
                           "fast_rounds_speedup_vs_first": first_fast / fast_median}
        else:
            fast_fields = {}
        rows.append({"build": contestant.build, "variant": getattr(module, "__cpu_variant__", "?"),
                     "block_size": contestant.block_size, "run_blocks": contestant.run_blocks,
                     "pages": contestant.pages,
                     "chunk_tokens": contestant.chunk_tokens, "pacing": contestant.pacing,
                     "threads": threads or module.num_threads(),
                     "shape": shape.name, "seq_len": seq_len, "calls": len(walls),
                     "median_ms": median * 1e3, "p10_ms": sorted(walls)[len(walls) // 10] * 1e3,
                     "kernel_ms": statistics.median(kernels) * 1e3,
                     "kv_gbps": kv_bytes(shape, seq_len) / median / 1e9, "speedup_vs_first": first / median,
                     **fast_fields})
    return rows


def contestants_of(args) -> list[Contestant]:
    return [Contestant(build, variant, block_size, run_blocks, pages, chunk_tokens, pacing)
            for build, variant, block_size, run_blocks, pages, chunk_tokens, pacing in itertools.product(
                args.builds, args.variants or [None], args.block_sizes, args.run_blocks, args.pages,
                args.chunk_tokens or [None], args.pacing or [None])]


def load(contestants: list[Contestant], workdir: str) -> list:
    """Each contestant's module: a build as it is, or a copy of it per variant."""
    modules = []
    for index, contestant in enumerate(contestants):
        if contestant.variant is None:
            modules.append(load_build(contestant.build, index))
        else:
            modules.append(load_variant(contestant.build, index, contestant.variant, workdir))
        if contestant.pacing is not None and not hasattr(modules[-1], "set_pacing"):
            raise ValueError(f"--pacing: {contestant.build!r} has no pacing (built before it): give --pacing "
                             f"only with builds that have it")
    return modules


def check_args(parser, args, shape) -> None:
    check_positive(parser, args, ("seq_len", "rounds"))
    for name in ("block_sizes", "run_blocks", "chunk_tokens"):
        bad = [n for n in getattr(args, name) or [] if n < 1]
        if bad:
            parser.error(f"--{name.replace('_', '-')} must each be >= 1, got {bad}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    odd = [n for n in args.block_sizes if n % 2] if not shape.v_in_k else []
    if odd:  # the paired layout stores tokens in pairs
        parser.error(f"--block-sizes must be even for {shape.name} (the paired layout), got {odd}")
    uneven = [n for n in args.block_sizes if args.seq_len % n]
    if uneven:
        parser.error(f"--seq-len {args.seq_len} must be a multiple of every block size, not of {uneven}")
    if args.cold_mib < 0:
        parser.error(f"--cold-mib must be >= 0, got {args.cold_mib}")
    if "2m" in args.pages and not huge_pages_enabled():
        parser.error(f"--pages 2m: this host gives no transparent huge pages ({_THP_SETTING} is [never]); "
                     f"allowed here: 4k")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--builds", nargs="+", required=True, help="_cpu*.so files; the first is the baseline")
    parser.add_argument("--shape", default="mixtral", choices=[s.name for s in SHAPES])
    parser.add_argument("--seq-len", type=int, default=32768, help="tokens (a multiple of every block size)")
    parser.add_argument("--cold-mib", type=int, default=1024, help="MiB read between two reads of the same KV")
    parser.add_argument("--rounds", type=int, default=6, help="turns of every contestant")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="ISA variants to run each build with (default: each build's own best)")
    parser.add_argument("--block-sizes", nargs="+", type=int, default=[16], help="tokens per KV block")
    parser.add_argument("--run-blocks", nargs="+", type=int, default=[EXTENT_BLOCKS],
                        help=f"consecutive physical blocks per run ({EXTENT_BLOCKS}: one allocator extent; 16: one "
                             "window flush, as lowest-first ids gave; 1: every block shuffled)")
    parser.add_argument("--pages", nargs="+", default=["4k"], choices=["4k", "2m"],
                        help="page size of the KV copies: 4k as torch allocates them, 2m advised for transparent "
                             "huge pages")
    parser.add_argument("--chunk-tokens", nargs="+", type=int, default=None,
                        help="tokens per work item (default: sized by the kernel)")
    parser.add_argument("--pacing", nargs="+", default=None, choices=["on", "off"],
                        help="the paired kernel's pacing, set before each call (default: each build's own)")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads of every build (default: theirs)")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    shape = {s.name: s for s in SHAPES}[args.shape]
    check_args(parser, args, shape)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    contestants = contestants_of(args)
    with tempfile.TemporaryDirectory() as workdir:
        try:
            modules = load(contestants, workdir)
        except ValueError as error:
            parser.error(str(error))
        if args.threads is not None:
            for module in modules:
                module.set_num_threads(args.threads)
        torch.manual_seed(0)
        times, host_read_gbps = measure(contestants, modules, shape, args.seq_len, args.cold_mib << 20, args.rounds)
    rows = summarize(contestants, modules, times, shape, args.seq_len, args.threads, host_read_gbps)
    log.info("%s (%d CPUs)", cpu_model(), os.cpu_count())  # a figure's host, beside every variant below
    if host_read_gbps:
        log.info("host whole-array read of the same KV after each round: median %.1f GB/s (%.1f-%.1f)",
                 statistics.median(host_read_gbps), min(host_read_gbps), max(host_read_gbps))
    for row in rows:
        log.info("%s L=%d %s (variant %s, block %d, runs of %d, %s pages, chunk %s, pacing %s, %d threads): "
                 "median %.3f ms, p10 %.3f ms, kernel %.3f ms, %.1f GB/s, %.2fx the first", row["shape"],
                 row["seq_len"], row["build"], row["variant"], row["block_size"], row["run_blocks"], row["pages"],
                 row["chunk_tokens"] or "auto", row["pacing"] or "as built", row["threads"],
                 row["median_ms"], row["p10_ms"], row["kernel_ms"], row["kv_gbps"], row["speedup_vs_first"])
        if "fast_rounds" in row:
            log.info("  in the %d rounds whose host read was in the top third: median %.3f ms, %.2fx the first",
                     row["fast_rounds"], row["fast_rounds_median_ms"], row["fast_rounds_speedup_vs_first"])
    if args.out:
        write_json(args.out, {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "rows": rows, "rounds": args.rounds,
                              "cold_mib": args.cold_mib, "host_read_gbps": host_read_gbps})
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
